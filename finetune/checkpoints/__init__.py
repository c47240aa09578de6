"""What makes checkpoints safe: complete and rotated checkpoints (`complete`), resuming them (`resume`), their files
read as untrusted input (`untrusted_files`), one run per output_dir (`run_lock`), a full disk named (`disk`), SIGTERM
saving the current step (`preemption`), and a checkpoint exported as a standalone model (`export`)."""
