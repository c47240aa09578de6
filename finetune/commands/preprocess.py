"""`finetune preprocess RECIPE.yaml [--key value ...]`: tokenize (and pack) the recipe's data once, in one process,
before a launch, so that no rank of `finetune train` waits at a barrier while rank 0 tokenizes (`ddp_timeout`).

It parses the recipe as `finetune train` does, runs the same data pipeline (`finetune.data.pipeline.tokenize_data`) and
writes the cache `finetune train` reads on every rank while its key matches (`finetune.data.cache`).
"""

from __future__ import annotations

import os
import sys

from finetune.commands.train import add_recipe_arguments, recipe_and_overrides


def preprocess_command_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "preprocess", help="tokenize (and pack) a recipe's data once, before launching",
        description="Tokenize (and pack) the recipe's data in one process exactly as `finetune train` would, and "
        "write it to `preprocessed_dir` (default <output_dir>/preprocessed) with a key of everything that changes "
        "the tokens. `finetune train` with the same recipe then memory-maps it on every rank instead of tokenizing, "
        "and says when the key no longer matches. `--key value` overrides any recipe key; give the data keys you "
        "will train with.",
    )
    add_recipe_arguments(parser)  # the recipe you will train with, positional or after `--config`
    parser.set_defaults(func=preprocess_command)


def preprocess_command(args) -> int:
    from finetune.data.cache import cache_dir, cache_key, check_cache_dir, key_digest, save_preprocessed
    from finetune.data.pipeline import tokenize_data
    from finetune.data.summary import print_data_summary
    from finetune.errors import RecipeError
    from finetune.models.loading import load_tokenizer
    from finetune.recipe.parse import parse_recipe

    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise RecipeError("`finetune preprocess` runs as one process: run it without `accelerate launch`/`torchrun`, "
                          "then launch `finetune train` with the same recipe.")
    recipe = parse_recipe(*recipe_and_overrides(args))
    if recipe.method.preprocess_refusal is not None:
        raise RecipeError("`finetune preprocess` is for supervised fine-tuning data: "
                          f"{recipe.method.preprocess_refusal}; launch `finetune train` with this recipe directly.")
    if recipe.data.streaming:
        raise RecipeError("`streaming: true` tokenizes the data as training reads it: there is nothing to preprocess; "
                          "drop `streaming` to tokenize the whole dataset ahead of the launch.")
    output_dir = recipe.training.output_dir
    directory = check_cache_dir(cache_dir(recipe.data, output_dir), output_dir)  # before the work, not after
    tokenizer = load_tokenizer(recipe.model)
    # Every eval example's prompt, so that `generation_eval_samples` stays out of the key: a run takes the first N.
    recipe.data.generation_eval_samples = sys.maxsize
    data = tokenize_data(recipe, tokenizer)
    key = cache_key(recipe.data, tokenizer, recipe.training.seed)
    save_preprocessed(data, directory, key, output_dir)
    print_data_summary(data.summary)
    print(f"wrote the preprocessed data to {directory} (key {key_digest(key)}, {data.summary['train_fingerprint']}): "
          "`finetune train` with this recipe reads it on every rank instead of tokenizing.")
    return 0
