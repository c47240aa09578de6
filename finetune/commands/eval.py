"""`finetune eval OUTPUT_DIR|CHECKPOINT --tasks ...`: score a trained model with lm-evaluation-harness (what `axolotl
lm-eval` and torchtune's `eleuther_eval` do), the run's chat template and stops included (finetune.train.harness).
Results go beside the model, under eval_harness/, one file an evaluation; with --compare-base, next to the model the
run started from. An lm-eval task file under --include-path is code: a `!function` in it runs Python (a notice names
the file); its templates are rendered in Jinja's sandbox."""

from __future__ import annotations


def eval_command_parser(subparsers) -> None:
    from finetune.commands.model_source import add_model_source_arguments
    from finetune.train.harness import RUN_BASE, SYNTHETIC

    parser = subparsers.add_parser(
        "eval", help="score a trained model on lm-eval tasks, the synthetic tasks or your own JSONL",
        description="Load a run's output_dir or one of its checkpoint-N folders (full weights, DeepSpeed ZeRO or FSDP "
        "shards, a LoRA adapter on its base) and score it with lm-evaluation-harness: its own tasks by name, "
        f"`{SYNTHETIC}` (the embedded tasks, exact match), or a JSONL file of yours (any format training reads; the "
        "last assistant turn, or the completion, is the answer to match). Prompts are rendered with the chat template "
        "training used and answers stop where training taught them to.",
    )
    add_model_source_arguments(parser, merge_lora_help="merge the LoRA adapter into its base first")
    parser.add_argument("--tasks", nargs="+", required=True,
                        help=f"lm-eval task names, `{SYNTHETIC}` (or synthetic_add, synthetic_reverse, "
                        "synthetic_sort), or JSONL files")
    parser.add_argument("--include-path", help="a folder of your own lm-eval task YAML, named in --tasks (a task file "
                        "is code: a `!function` in it runs Python)")
    parser.add_argument("--compare-base", nargs="?", const=RUN_BASE, metavar="MODEL",
                        help="score the model the run started from too, and show before → after (default: the one "
                        "the run recorded; or a directory, hub id, or tiny)")
    parser.add_argument("--max-new-tokens", type=int, help="longest answer on generation tasks (default: the run's "
                        "generation_max_new_tokens, else 256)")
    parser.add_argument("--batch-size", type=int, default=32, help="prompts a forward (default 32)")
    parser.add_argument("--limit", type=int, help="score the first N examples of each task only")
    parser.add_argument("--output", help="a new .json results file, its answers in a new folder of the same name "
                        "(default: <checkpoint>/eval_harness/results_<time>.json)")
    parser.set_defaults(func=eval_command)


def eval_command(args) -> int:
    import sys

    from finetune.errors import RecipeError
    from finetune.train.harness import check_installed, code_in_task_files, evaluate_run, print_scores, select_tasks

    for name, value in (("--batch-size", args.batch_size), ("--limit", args.limit),
                        ("--max-new-tokens", args.max_new_tokens)):
        if value is not None and value < 1:
            raise RecipeError(f"{name} {value}: give 1 or more.")
    check_installed()
    selection = select_tasks(args.tasks, args.include_path)
    if notice := code_in_task_files(args.include_path):
        print(notice, file=sys.stderr, flush=True)
    record = evaluate_run(args.checkpoint, selection, compare_base=args.compare_base,
                          max_new_tokens=args.max_new_tokens, batch_size=args.batch_size, limit=args.limit,
                          merge_lora=args.merge_lora, base_model=args.base_model, seed=args.seed, output=args.output)
    print_scores(record)
    return 0
