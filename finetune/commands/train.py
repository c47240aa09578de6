"""`finetune train RECIPE.yaml [--key value ...]`: fine-tune as the recipe says (run it under a launcher)."""

from __future__ import annotations

import argparse


def train_command_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "train",
        help="fine-tune a model from a YAML recipe",
        description="Fine-tune a model from a YAML recipe; `--key value` overrides any recipe key. "
        "Run it under `accelerate launch --config_file ... -m finetune train RECIPE.yaml` for several processes. "
        "`finetune train --help-keys` lists every recipe key.",
        add_help=True,
    )
    parser.add_argument("recipe", nargs="?", help="YAML recipe (flat keys: model, data, LoRA, TrainingArguments)")
    parser.add_argument("overrides", nargs=argparse.REMAINDER, help="`--key value` pairs that win over the recipe")
    parser.add_argument("--help-keys", action="store_true", help="list every recipe key with its help and exit")
    parser.set_defaults(func=train_command)


def train_command(args) -> int:
    if args.help_keys:
        from finetune.recipe import RecipeParser

        print(RecipeParser().format_help())
        return 0
    from finetune.errors import RecipeError
    from finetune.train import train_command as run

    if args.recipe is None:
        raise RecipeError("`finetune train` needs a recipe: finetune train recipes/demo.yaml")
    run(args.recipe, args.overrides)
    return 0
