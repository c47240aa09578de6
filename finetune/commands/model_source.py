"""The arguments every command that reads a trained model takes (chat, eval, serve, export): the run or checkpoint,
and what rebuilds a LoRA adapter's base (finetune.train.trained_model.load_with_tokenizer)."""

from __future__ import annotations

CHECKPOINT_HELP = "a run's output_dir or one of its checkpoint-N folders"


def add_model_source_arguments(parser, merge_lora_help: str | None = None, seed_help: str | None = None) -> None:
    """`checkpoint`, `--base-model` and `--seed`, and `--merge-lora` when the command may keep an adapter unmerged."""
    parser.add_argument("checkpoint", help=CHECKPOINT_HELP)
    if merge_lora_help is not None:
        parser.add_argument("--merge-lora", action="store_true", help=merge_lora_help)
    parser.add_argument("--base-model", help="the adapter's base model (default: the one the adapter names)")
    parser.add_argument("--seed", type=int, help=seed_help or "seed that built the `tiny` base (default: the seed the "
                        "run recorded in its effective_config.json)")
