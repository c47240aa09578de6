"""`finetune labels RECIPE.yaml [--split train|eval] [--example I] [--num-examples N] [--key value ...]`: the
recipe's examples as training sees them, the learned tokens highlighted (what axolotl's `preprocess --debug` shows).

It loads only the tokenizer and the data, tokenizes only the examples shown, and starts no process group.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass


def _add_view_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--split", choices=("train", "eval"), default="train", help="which split to show")
    parser.add_argument("--example", type=_positive, default=1, metavar="I",
                        help="first example to show, counted from 1 as errors count them (default 1)")
    parser.add_argument("--num-examples", type=_positive, default=3, metavar="N",
                        help="how many examples to show from each source (default 3)")
    parser.add_argument("--plain", action="store_true",
                        help="mark learned text as [[...]] instead of colour (the default when not on a terminal)")


def labels_command_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "labels", help="show which tokens of the recipe's examples are learned",
        description="Tokenize a few of the recipe's examples exactly as `finetune train` does (chat template, tool "
        "calls, max_seq_length and the data policies) and print them with the learned tokens in green and the "
        "masked ones dimmed ([[learned]] in plain text), with counts. `--key value` overrides any recipe key.",
    )
    parser.add_argument("recipe", help="YAML recipe")
    _add_view_options(parser)
    parser.add_argument("overrides", nargs=argparse.REMAINDER, help="`--key value` pairs that win over the recipe")
    parser.set_defaults(func=labels_command)


def _positive(value: str) -> int:
    number = int(value)
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be 1 or more, got {value}")
    return number


@dataclass
class ShownExample:
    where: str                      # "train example 3", as errors name it
    pieces: list[tuple[str, bool]]  # runs of text and whether they are learned
    tokens: int                     # after the length policy
    learned: int                    # 0 when the policy drops the example
    note: str                       # format, source, and whether it is truncated or dropped


def labels_command(args) -> int:
    # Options given after the recipe arrive among the overrides (argparse.REMAINDER): take ours back.
    view = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    _add_view_options(view)
    args, overrides = view.parse_known_args(args.overrides, namespace=args)

    from rich.console import Console

    from finetune.data import load_raw_data
    from finetune.models.loading import load_tokenizer
    from finetune.recipe.parse import parse_recipe

    recipe = parse_recipe(args.recipe, overrides)
    tokenizer = load_tokenizer(recipe.model)
    console = Console(highlight=False, soft_wrap=True)
    plain = args.plain or not console.is_terminal
    shown = [example for source in load_raw_data(recipe.data).sources
             for example in examples_to_show(source, args, recipe.data, tokenizer)]
    for example in shown:
        print_example(console, example, plain)
    tokens, learned = sum(example.tokens for example in shown), sum(example.learned for example in shown)
    console.print(f"{len(shown)} example(s): {tokens:,} tokens, {learned:,} learned ({learned / max(tokens, 1):.0%}).")
    return 0


def examples_to_show(source, args, data_args, tokenizer) -> list[ShownExample]:
    """The chosen examples of one source, encoded and put through the length policies as training does."""
    from finetune.data import detect_format
    from finetune.data.tokenize import IGNORE_INDEX, apply_length_policies, encode_example
    from finetune.errors import RecipeError

    split = source.train if args.split == "train" else source.eval
    if split is None:
        raise RecipeError(f"{source.name} has no eval split; set `eval_file` or `eval_split_ratio`, or show "
                          f"`--split train`.")
    if args.example > len(split):
        raise RecipeError(f"`--example {args.example}` is past the end of the {args.split} split of {source.name} "
                          f"({len(split)} examples).")
    dataset_format = detect_format(split.column_names, source.declared_format(data_args))
    shown = []
    for index in range(args.example - 1, min(args.example - 1 + args.num_examples, len(split))):
        where = f"{args.split} example {index + 1}"
        try:
            input_ids, labels = encode_example(split[index], dataset_format, tokenizer)
        except RecipeError as error:
            raise RecipeError(f"{source.name}, {where}: {error}") from None
        length = len(input_ids)
        input_ids, labels, drop = apply_length_policies(input_ids, labels, data_args, where)
        note = f"{dataset_format}, {source.name}"
        if drop:
            note += f"; dropped from training: {drop.replace('_', ' ')}"
        elif length > len(input_ids):
            note += f"; truncated from {length} tokens to max_seq_length"
        learned = [label != IGNORE_INDEX for label in labels]
        shown.append(ShownExample(where, _runs(tokenizer, input_ids, learned), len(input_ids),
                                  0 if drop else sum(learned), note))
    return shown


def _runs(tokenizer, input_ids: list[int], learned: list[bool]) -> list[tuple[str, bool]]:
    """The text of each run of consecutive learned, or masked, tokens."""
    pieces, start = [], 0
    for end in range(1, len(input_ids) + 1):
        if end == len(input_ids) or learned[end] != learned[start]:
            text = tokenizer.decode(input_ids[start:end], skip_special_tokens=False,
                                    clean_up_tokenization_spaces=False)
            pieces.append((text, learned[start]))
            start = end
    return pieces


def print_example(console, example: ShownExample, plain: bool) -> None:
    from rich.text import Text

    header = f"── {example.where} ({example.note}): {example.tokens} tokens, {example.learned} learned"
    if plain:
        print(header)
        print("".join(f"[[{text}]]" if learned else text for text, learned in example.pieces))
        print()
        return
    console.print(Text(header, style="bold"))
    body = Text()
    for text, learned in example.pieces:
        body.append(text, style="bold green" if learned else "dim")
    console.print(body)
    console.print()
