"""The `finetune` command line: one subcommand a module under finetune/commands/."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from finetune.commands.bench import bench_command_parser
from finetune.commands.chat import chat_command_parser
from finetune.commands.configs import configs_command_parser
from finetune.commands.env import env_command_parser
from finetune.commands.eval import eval_command_parser
from finetune.commands.export import export_command_parser
from finetune.commands.labels import labels_command_parser
from finetune.commands.plan import plan_command_parser
from finetune.commands.preprocess import preprocess_command_parser
from finetune.commands.rendezvous import rendezvous_command_parser
from finetune.commands.report import report_command_parser
from finetune.commands.serve import serve_command_parser
from finetune.commands.train import train_command_parser
from finetune.commands.universal import universal_command_parser
from finetune.errors import RecipeError, report_user_error


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="finetune", description="Fine-tune causal LMs across GPUs.")
    subparsers = parser.add_subparsers(dest="command", required=True)
    for add in (train_command_parser, configs_command_parser, plan_command_parser, report_command_parser,
                export_command_parser, bench_command_parser, rendezvous_command_parser, labels_command_parser,
                preprocess_command_parser, chat_command_parser, universal_command_parser, env_command_parser,
                eval_command_parser, serve_command_parser):
        add(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except RecipeError as error:
        return report_to_user_and_launcher(error)
    except OSError as error:
        refused = refused_write(error)
        if refused is None:
            raise
        return report_to_user_and_launcher(refused)


def report_to_user_and_launcher(error: RecipeError) -> int:
    """Prints the error's one line and, under a torch.distributed.elastic launcher (`accelerate launch`, `torchrun`),
    leaves it in the rank's reply file (TORCHELASTIC_ERROR_FILE): the launcher's closing `ChildFailedError` summary,
    the last thing the user reads, then quotes that line where it would say "To enable traceback see ...". The
    launcher's own traceback above the summary is Accelerate's (`multi_gpu_launcher` re-raises) and cannot be muted
    from a rank."""
    status = report_user_error(error)
    reply_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if reply_file:
        # elastic's reply format with a plain-text message (ProcessFailure._get_error_data), shown as it is
        record = {"message": f"finetune: error: {error}", "timestamp": int(time.time())}
        Path(reply_file).parent.mkdir(parents=True, exist_ok=True)
        Path(reply_file).write_text(json.dumps(record))
    return status


def refused_write(error: OSError) -> RecipeError | None:
    """A file the file system refused (permissions, a read-only mount, no space) outside the saves that say so
    themselves (finetune.checkpoints.disk): the user's to fix, said in one line naming the file; None for any other
    OSError."""
    from finetune.checkpoints.disk import DISK_FULL_ERRNOS, UNWRITABLE_ERRNOS

    if error.errno not in UNWRITABLE_ERRNOS | DISK_FULL_ERRNOS or not error.filename:
        return None
    return RecipeError(f"the file system refused {error.filename}: {(error.strerror or str(error)).lower()}; fix "
                       "the permissions, the read-only mount or the free space there, or use another folder.")


if __name__ == "__main__":
    sys.exit(main())
