"""`finetune export CHECKPOINT OUT_DIR [--merge-lora] [--dtype bf16] [--force]`: a plain Hugging Face model directory
in safetensors that `from_pretrained` loads; never the source, and a user's files only with `--force`."""

from __future__ import annotations


def export_command_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "export", help="export a run or checkpoint to a plain Hugging Face model (safetensors)",
        description="Export a run's output_dir or a checkpoint-N folder: full weights (ZeRO-3 shards consolidated), "
        "a LoRA adapter merged into its base (--merge-lora) or kept standalone.",
    )
    parser.add_argument("checkpoint", help="a run's output_dir or one of its checkpoint-N folders")
    parser.add_argument("out_dir", help="directory to write the model to")
    parser.add_argument("--merge-lora", action="store_true", help="merge the LoRA adapter into its base model")
    parser.add_argument("--dtype", help="cast the weights: bf16, fp16 or fp32 (default: a checkpoint is exported in "
                        "the dtype its run saves its final weights in, `save_dtype`: bf16 in, bf16 out)")
    parser.add_argument("--base-model", help="the adapter's base model (default: the one the adapter names)")
    parser.add_argument("--seed", type=int, help="seed that built the `tiny` base (default: the seed the run "
                        "recorded in its effective_config.json)")
    parser.add_argument("--force", action="store_true", help="write into a non-empty directory that holds no "
                        "earlier export")
    parser.set_defaults(func=export_command)


def export_command(args) -> int:
    from finetune.checkpoints.export import export

    out_dir = export(args.checkpoint, args.out_dir, merge_lora=args.merge_lora, dtype=args.dtype,
                     base_model=args.base_model, seed=args.seed, force=args.force)
    print(f"exported {args.checkpoint} to {out_dir}")
    return 0
