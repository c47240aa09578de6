"""`finetune configs write|check|lint`: the shipped DeepSpeed and Accelerate configs (and, in the project checkout,
docs/recipes.md and docs/from_trl.md), generated from finetune/configs/ and the recipe dataclasses."""

from __future__ import annotations

import sys
from pathlib import Path

from finetune.configs.lint import lint_file


def configs_command_parser(subparsers) -> None:
    parser = subparsers.add_parser("configs", help="write or check the generated launch configs")
    actions = parser.add_subparsers(dest="action", required=True)
    write = actions.add_parser("write", help="write the shipped config set (and, in the project checkout, the "
                               "generated docs)")
    write.add_argument("--out", type=Path, default=Path("."), help="root to write under (default: here)")
    write.add_argument("--force", action="store_true",
                       help="replace files that exist with other content (refused otherwise, naming them)")
    check = actions.add_parser("check", help="exit non-zero with a diff if a shipped file differs from the generator")
    check.add_argument("--root", type=Path, default=Path("."), help="project root holding the shipped configs")
    lint = actions.add_parser("lint",
                              help="report invalid or contradictory settings in DeepSpeed JSON / Accelerate YAML")
    lint.add_argument("files", nargs="+", type=Path)
    lint.add_argument("--world-size", type=int, help="world size for the batch-size product check")
    lint.add_argument("--visible-devices", type=int, help="GPUs per machine for the process-count check")
    parser.set_defaults(func=configs_command)


def configs_command(args) -> int:
    # the generated docs come from the recipe's dataclasses (Transformers' TrainingArguments): loaded for write/check
    from finetune.generated_files import check_configs, write_configs

    if args.action == "write":
        written = write_configs(args.out, force=args.force)
        for path in written:
            print(f"wrote {path}")
        if not written:
            print(f"the generated configs in {args.out} are up to date")
        return 0
    if args.action == "lint":
        problems = [problem for path in args.files
                    for problem in lint_file(path, args.world_size, args.visible_devices)]
        for problem in problems:
            print(problem)
        print(f"{len(problems)} problem(s) in {len(args.files)} file(s)")
        return 1 if problems else 0
    problems = check_configs(args.root)
    for problem in problems:
        sys.stdout.write(problem)
    if problems:
        print(f"{len(problems)} shipped config(s) differ from the generator; run `finetune configs write`.")
        return 1
    print("shipped configs match the generator")
    return 0
