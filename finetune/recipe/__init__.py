"""What the user asks, checked: the recipe's sections (`args`), YAML and command-line parsing (`parse`), other tools'
keys (`aliases`), the launch checked before any process group (`preflight`), the batch plan (`batch_plan`), the
training methods a recipe can name (`methods`) and the generated recipe reference (`docs`)."""

from finetune.recipe.parse import Recipe, parse_recipe

__all__ = ["Recipe", "parse_recipe"]
