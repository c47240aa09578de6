"""The `finetune` command line: one subcommand a module under finetune/commands/."""

from __future__ import annotations

import argparse
import sys

from finetune.commands.bench import bench_command_parser
from finetune.commands.chat import chat_command_parser
from finetune.commands.configs import configs_command_parser
from finetune.commands.export import export_command_parser
from finetune.commands.labels import labels_command_parser
from finetune.commands.plan import plan_command_parser
from finetune.commands.preprocess import preprocess_command_parser
from finetune.commands.rendezvous import rendezvous_command_parser
from finetune.commands.report import report_command_parser
from finetune.commands.train import train_command_parser
from finetune.errors import RecipeError, report_user_error


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="finetune", description="Fine-tune causal LMs across GPUs.")
    subparsers = parser.add_subparsers(dest="command", required=True)
    for add in (train_command_parser, configs_command_parser, plan_command_parser, report_command_parser,
                export_command_parser, bench_command_parser, rendezvous_command_parser, labels_command_parser,
                preprocess_command_parser, chat_command_parser):
        add(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except RecipeError as error:
        return report_user_error(error)


if __name__ == "__main__":
    sys.exit(main())
