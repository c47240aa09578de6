"""Tokenization with completion-only labels: only assistant tokens are learned, every other label is -100.

Each assistant turn's tokens are found by rendering the conversation up to that turn with the tokenizer's
own chat template (prompt with `add_generation_prompt`, then prompt + answer) and taking the difference.
This works for any template that renders a conversation as a prefix of its continuation, which we check.
"""

from __future__ import annotations

from dataclasses import dataclass

from datasets import Dataset, DatasetDict

from finetune.data.formats import detect_format, to_messages
from finetune.errors import RecipeError

IGNORE_INDEX = -100


def _render_ids(tokenizer, messages, add_generation_prompt=False) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def encode_messages(messages: list[dict], tokenizer, max_seq_length: int) -> dict[str, list[int]]:
    """`input_ids`, `attention_mask` and `labels` for one conversation, truncated to `max_seq_length`."""
    input_ids = _render_ids(tokenizer, messages)
    labels = [IGNORE_INDEX] * len(input_ids)
    for index, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        start = len(_render_ids(tokenizer, messages[:index], add_generation_prompt=True))
        upto = _render_ids(tokenizer, messages[: index + 1])
        if upto != input_ids[: len(upto)]:
            raise RecipeError(
                "the tokenizer's chat template does not render a conversation as a prefix of its continuation, "
                "so assistant tokens cannot be located; set a template that does (`chat_template` in the tokenizer)."
            )
        labels[start : len(upto)] = input_ids[start : len(upto)]
    input_ids, labels = input_ids[:max_seq_length], labels[:max_seq_length]
    return {"input_ids": input_ids, "attention_mask": [1] * len(input_ids), "labels": labels}


@dataclass
class PreparedData:
    train: Dataset
    eval: Dataset | None
    # Raw eval conversations for generation: prompt messages, reference answer and task name.
    generation_examples: list[dict]
    dropped: dict[str, int]


def _tokenize_split(split: Dataset, tokenizer, max_seq_length: int, dataset_format: str) -> tuple[Dataset, int]:
    def encode(example):
        return encode_messages(to_messages(example, dataset_format), tokenizer, max_seq_length)

    encoded = split.map(encode, remove_columns=split.column_names, desc="tokenizing")
    # An example whose answer was cut away entirely would contribute a 0/0 loss: drop it, and count it.
    kept = encoded.filter(lambda labels: any(label != IGNORE_INDEX for label in labels), input_columns="labels")
    return kept, len(encoded) - len(kept)


def generation_examples(split: Dataset, dataset_format: str, limit: int) -> list[dict]:
    examples = []
    for example in split.select(range(min(limit, len(split)))):
        messages = to_messages(example, dataset_format)
        last = max(i for i, message in enumerate(messages) if message["role"] == "assistant")
        examples.append(
            {"prompt": messages[:last], "reference": messages[last]["content"], "task": example.get("task") or "all"}
        )
    return examples


def prepare_datasets(splits: DatasetDict, tokenizer, data_args, training_args) -> PreparedData:
    """Tokenizes once: rank 0 first, the other ranks then read the `datasets` cache it wrote."""
    dataset_format = detect_format(splits["train"].column_names)
    eval_split = splits.get("eval")
    if eval_split is not None and data_args.max_eval_samples is not None:
        eval_split = eval_split.select(range(min(data_args.max_eval_samples, len(eval_split))))
    dropped = {}
    with training_args.main_process_first(desc="tokenizing the dataset"):
        train, dropped["train"] = _tokenize_split(splits["train"], tokenizer, data_args.max_seq_length, dataset_format)
        evaluation = None
        if eval_split is not None:
            evaluation, dropped["eval"] = _tokenize_split(eval_split, tokenizer, data_args.max_seq_length, dataset_format)
    if len(train) == 0:
        raise RecipeError(
            f"no training example keeps an answer token after truncation to `max_seq_length: {data_args.max_seq_length}`."
        )
    examples = []
    if eval_split is not None and data_args.generation_eval_samples > 0:
        examples = generation_examples(eval_split, dataset_format, data_args.generation_eval_samples)
    return PreparedData(train, evaluation, examples, dropped)
