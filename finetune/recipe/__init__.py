"""What the user asks, checked: the recipe's sections (`args`), YAML and command-line parsing (`parse`), other tools'
keys (`aliases`), the launch checked before any process group (`preflight`), the batch plan (`batch_plan`), the
training methods a recipe can name (`methods`) and the generated recipe reference (`docs`).

`Recipe` and `parse_recipe` are imported when first used: the parser needs Transformers' `TrainingArguments`, which
commands that only plan, lint or print help never load."""

__all__ = ["Recipe", "parse_recipe"]


def __getattr__(name: str):
    if name in __all__:
        from finetune.recipe import parse

        return getattr(parse, name)
    raise AttributeError(f"module 'finetune.recipe' has no attribute {name!r}")
