"""`finetune universal CHECKPOINT [--workers N]`: a DeepSpeed ZeRO checkpoint converted to DeepSpeed's universal
format, with several processes, before a relaunch on another GPU count (the run then loads it as it is). A resume
that finds none runs this command itself from its main process while the other ranks wait for the result
(finetune.checkpoints.complete.converted_outside_the_process_group)."""

from __future__ import annotations


def universal_command_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "universal", help="convert a DeepSpeed ZeRO checkpoint to the universal format before resuming elsewhere",
        description="Convert a DeepSpeed ZeRO-1/2/3 checkpoint (a checkpoint-N folder, or a run's output_dir: its "
        "newest complete checkpoint) to DeepSpeed's universal format, beside the original. A run resuming from it "
        "on another number of GPUs then loads the conversion instead of making it.",
    )
    parser.add_argument("checkpoint", help="a checkpoint-N folder, or a run's output_dir")
    parser.add_argument("--workers", type=int, help="processes extracting and merging the shards (default: the "
                        "machine's cores, up to 8; each holds shards in host memory)")
    parser.set_defaults(func=universal_command)


def universal_command(args) -> int:
    import time
    from pathlib import Path

    from finetune.checkpoints.complete import (
        conversion_workers,
        convert_to_universal,
        convertible_to_universal,
        newest_complete_checkpoint,
    )
    from finetune.errors import RecipeError

    checkpoint = Path(args.checkpoint)
    if not checkpoint.is_dir():
        raise RecipeError(f"{checkpoint} is not a directory: give a checkpoint-N folder or a run's output_dir.")
    if not (checkpoint / "trainer_state.json").is_file():  # an output_dir: its newest complete checkpoint
        newest, _ = newest_complete_checkpoint(checkpoint, whole=True)
        if newest is None:
            raise RecipeError(f"{checkpoint} holds no complete checkpoint to convert.")
        checkpoint = newest
    if args.workers is not None and args.workers < 1:
        raise RecipeError(f"`--workers {args.workers}` must be at least 1.")
    convertible_to_universal(checkpoint)
    if (checkpoint / "latest_universal").is_file():
        print(f"{checkpoint} is already in the universal format ({(checkpoint / 'latest_universal').read_text()})")
        return 0
    workers = args.workers or conversion_workers()
    started = time.monotonic()
    universal = convert_to_universal(checkpoint, workers=workers)
    print(f"converted {checkpoint} to DeepSpeed's universal format ({universal.name}, {workers} worker(s), "
          f"{time.monotonic() - started:.1f} s): `resume_from_checkpoint` on another GPU count now loads it as it is")
    return 0
