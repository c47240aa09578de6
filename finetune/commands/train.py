"""`finetune train RECIPE.yaml [--key value ...]`, or `finetune train --config RECIPE.yaml ...` as TRL spells it:
fine-tune as the recipe says (run it under a launcher)."""

from __future__ import annotations

import argparse


def train_command_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "train",
        help="fine-tune a model from a YAML recipe",
        description="Fine-tune a model from a YAML recipe; `--key value` overrides any recipe key. Started without a "
        "launcher, it launches itself on the GPUs it sees (or `--gpus N`; CPU processes stand in on a machine "
        "without GPUs) with the recipe's `strategy` (a shipped one, or auto: the first the plan finds fits), "
        "through Accelerate's launcher and the shipped config, printing that command; under `accelerate launch "
        "--config_file ... -m finetune train RECIPE.yaml` the launcher decides. `finetune train --help-keys` lists "
        "every recipe key; TRL's, axolotl's and LLaMA-Factory's key names are read too (docs/from_other_tools.md).",
        add_help=True,
    )
    add_recipe_arguments(parser)
    from finetune.launch.self_launch import add_launch_options

    add_launch_options(parser.add_argument_group("launch (started without a launcher; before or after the recipe)"))
    parser.add_argument("--help-keys", action="store_true", help="list every recipe key with its help and exit")
    parser.set_defaults(func=train_command)


def add_recipe_arguments(parser) -> None:
    """The recipe and its overrides, positional or after `--config` (`recipe_and_overrides` reads them)."""
    parser.add_argument("recipe", nargs="?", help="YAML recipe (flat keys: model, data, LoRA, TrainingArguments)")
    parser.add_argument("overrides", nargs=argparse.REMAINDER, help="`--key value` pairs that win over the recipe")
    # REMAINDER: everything after `--config` is the recipe and its overrides, as `trl sft --config R.yaml --key value`.
    parser.add_argument("--config", nargs=argparse.REMAINDER, metavar="RECIPE.yaml [--key value ...]",
                        help="the recipe given as TRL's scripts take it (instead of the positional recipe)")


def recipe_and_overrides(args) -> tuple[str, list[str]]:
    """The recipe file and its overrides, from `finetune train R.yaml ...` or `finetune train --config R.yaml ...`."""
    from finetune.errors import RecipeError

    if args.config is None:
        if args.recipe is None:
            raise RecipeError(f"`finetune {args.command}` needs a recipe: finetune {args.command} recipes/demo.yaml")
        if "--config" in args.overrides:
            given = args.overrides[args.overrides.index("--config") + 1:][:1]
            raise RecipeError(f"the recipe is given twice, as `{args.recipe}` and as `--config {' '.join(given)}`: "
                              f"keep one (finetune {args.command} R.yaml, or finetune {args.command} --config R.yaml).")
        return args.recipe, args.overrides
    if not args.config or args.config[0].startswith("-"):
        raise RecipeError(f"`--config` needs a recipe file: finetune {args.command} --config recipes/demo.yaml "
                          "[--key value ...]")
    recipe, overrides = args.config[0], args.config[1:]
    if "--config" in overrides:
        second = overrides[overrides.index("--config") + 1:][:1]
        raise RecipeError(f"`--config` is given twice (`{recipe}` and `{' '.join(second)}`): give one recipe.")
    return recipe, overrides


def train_command(args) -> int:
    if args.help_keys:
        from finetune.recipe.parse import RecipeParser

        print(RecipeParser().format_help())
        return 0
    from finetune.plan.launch import launch_or_run_here

    recipe, overrides = recipe_and_overrides(args)
    overrides = launch_or_run_here(recipe, overrides, given=args)
    if overrides is None:  # --dry-run: the plan and the command were printed
        return 0
    from finetune.train.run import train_command as run

    run(recipe, overrides)
    return 0
