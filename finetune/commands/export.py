"""`finetune export CHECKPOINT OUT_DIR [--merge-lora] [--dtype bf16] [--force]`: a plain Hugging Face model directory
in safetensors that `from_pretrained` loads; never the source, and a user's files only with `--force`.
`--gguf [--gguf-type f16|q8_0]`: instead, one GGUF file for llama.cpp and Ollama (finetune.models.gguf), with the
tokenizer and the chat template training used, under the same destination rules."""

from __future__ import annotations

from pathlib import Path


def export_command_parser(subparsers) -> None:
    from finetune.commands.model_source import add_model_source_arguments

    parser = subparsers.add_parser(
        "export", help="export a run or checkpoint to a plain Hugging Face model (safetensors)",
        description="Export a run's output_dir or a checkpoint-N folder: full weights (ZeRO-3 shards consolidated), "
        "a LoRA adapter merged into its base (--merge-lora) or kept standalone.",
    )
    add_model_source_arguments(parser, merge_lora_help="merge the LoRA adapter into its base model")
    parser.add_argument("out_dir", help="directory to write the model to")
    parser.add_argument("--dtype", help="cast the weights: bf16, fp16 or fp32 (default: a checkpoint is exported in "
                        "the dtype its run saves its final weights in, `save_dtype`: bf16 in, bf16 out)")
    parser.add_argument("--force", action="store_true", help="write into a non-empty directory that holds no "
                        "earlier export")
    parser.add_argument("--gguf", action="store_true", help="write one GGUF file for llama.cpp and Ollama instead: "
                        "OUT_DIR/<OUT_DIR's name>-<type>.gguf, with the tokenizer and the chat template training used "
                        "(a LoRA adapter needs --merge-lora)")
    parser.add_argument("--gguf-type", help="the GGUF weights' type: f16 (default) or q8_0 (8-bit, about half the "
                        "size); norms stay f32")
    parser.set_defaults(func=export_command)


def export_command(args) -> int:
    from finetune.checkpoints.export import earlier_export_files, export
    from finetune.errors import RecipeError

    if args.gguf:
        path, replaced = export_gguf(args)
        print(f"exported {args.checkpoint} to {path}{replacing(replaced)}")
        return 0
    if args.gguf_type is not None:
        raise RecipeError(f"--gguf-type {args.gguf_type} is the type of a GGUF export: add --gguf, or leave it out.")
    replaced = earlier_export_files(Path(args.out_dir))  # an earlier export's (GGUF files too): named, not unsaid
    out_dir = export(args.checkpoint, args.out_dir, merge_lora=args.merge_lora, dtype=args.dtype,
                     base_model=args.base_model, seed=args.seed, force=args.force)
    print(f"exported {args.checkpoint} to {out_dir}{replacing(replaced)}")
    return 0


def replacing(names: list[str]) -> str:
    return f" (replacing the earlier {', '.join(names)})" if names else ""


def export_gguf(args) -> tuple[Path, list[str]]:
    """The model and tokenizer as `finetune chat` loads them, written as one GGUF file: checked for what GGUF can
    hold before the destination is touched, then under `finetune export`'s destination rules and record. GGUF files
    of other types exported there before stay beside it; returns the file and the names of the files it replaced (an
    earlier file of the same type, or an earlier safetensors export's)."""
    from finetune import outputs
    from finetune.checkpoints.export import (
        EXPORT_RECORD,
        check_destination,
        earlier_export_files,
        forget_earlier_export,
        writing_export,
    )
    from finetune.errors import RecipeError
    from finetune.models.gguf import GGUF_TYPES, check_convertible, gguf_bytes, write_gguf
    from finetune.train.trained_model import load_with_tokenizer

    gguf_type = args.gguf_type or "f16"
    if gguf_type not in GGUF_TYPES:
        raise RecipeError(f"--gguf-type {gguf_type} is not one of {', '.join(GGUF_TYPES)}.")
    if args.dtype is not None:
        raise RecipeError(f"--dtype {args.dtype} casts a safetensors export: with --gguf, the weights' type is "
                          "--gguf-type (f16 or q8_0).")
    source, out_dir = Path(args.checkpoint), Path(args.out_dir)
    model, tokenizer = load_with_tokenizer(source, args.merge_lora, args.base_model, args.seed)
    check_convertible(model, tokenizer, gguf_type)
    check_destination(source, out_dir, args.force)
    name = out_dir.resolve().name
    path = out_dir / f"{name}-{gguf_type}.gguf"
    earlier = outputs.read_record(out_dir, EXPORT_RECORD, missing=None) if out_dir.is_dir() else None
    if isinstance(earlier, dict) and earlier.get("format") == "gguf":  # other types stay: only this name is replaced
        kept = [file for file in earlier_export_files(out_dir) if file != path.name]
        replaced = [path.name] if path.is_file() else []
    else:
        kept, replaced = [], forget_earlier_export(out_dir)
    with writing_export(out_dir, gguf_bytes(model, gguf_type), f"the {gguf_type} GGUF file"):
        write_gguf(model, tokenizer, path, gguf_type, name=name)
    outputs.write_record(out_dir, EXPORT_RECORD, {"source": str(source.resolve()), "format": "gguf",
                                                  "dtype": gguf_type, "files": sorted([*kept, path.name])})
    return path, replaced
