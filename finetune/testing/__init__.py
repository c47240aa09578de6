"""Support for the tests and `finetune bench --cpu`, never on a user's GPU path: CPU shims that let Accelerate prepare
what it prepares only for GPUs (`fsdp_on_cpu`), and subprocess launches with a timeout (`subprocesses`)."""
