"""`finetune configs write|check|lint`: the shipped DeepSpeed and Accelerate configs (and, in the project checkout,
docs/recipes.md and docs/from_other_tools.md), generated from finetune/configs/ and the recipe dataclasses."""

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
    lint.add_argument("--model", help="the model the config will train (a known shape, a local directory or "
                      "config.json): checks ZeRO-3's NVMe parameter buffer holds its largest partition at --world-size "
                      "(default: the Accelerate config's num_processes, else 1)")
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
        if args.model is not None:
            problems += [problem for path in args.files for problem in model_problems(path, args.model,
                                                                                      args.world_size)]
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


def model_problems(path: Path, model: str, world_size: int | None) -> list[str]:
    """What the DeepSpeed config of `path` (a DeepSpeed JSON, or an Accelerate YAML naming or holding one) cannot do
    for `model`: an NVMe parameter buffer smaller than its largest ZeRO-3 partition."""
    import json

    import yaml

    from finetune.configs.accelerate import deepspeed_section_as_json
    from finetune.configs.deepspeed import nvme_buffer_problem
    from finetune.memory.estimate import largest_partition
    from finetune.memory.shapes import model_shape

    try:
        config = json.loads(path.read_text()) if path.suffix == ".json" else yaml.safe_load(path.read_text())
        if path.suffix != ".json":
            world_size = world_size or int(config.get("num_processes", 1) or 1)
            section = config.get("deepspeed_config") or {}
            named = section.get("deepspeed_config_file")
            config = json.loads(Path(named).read_text()) if named else deepspeed_section_as_json(section)
    except (OSError, ValueError, AttributeError, yaml.YAMLError):
        return []  # unreadable: lint_file has said so
    problem = nvme_buffer_problem(config, largest_partition(model_shape(model), world_size or 1), source=str(path))
    return [problem] if problem else []
