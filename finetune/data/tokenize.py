"""Tokenization with completion-only labels, the over-long and answer-less policies, and the data summary.

Conversations: each assistant turn's tokens are found by rendering the conversation up to that turn with
the tokenizer's own chat template (prompt with `add_generation_prompt`, then prompt + answer) and taking
the difference; this works for any template that renders a conversation as a prefix of its continuation,
which is checked. Prompt/completion pairs learn the completion and EOS; plain text learns every token.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from datasets import Dataset, concatenate_datasets, interleave_datasets

from finetune.data.formats import CONVERSATION_FORMATS, detect_format, to_messages
from finetune.errors import RecipeError

IGNORE_INDEX = -100


def _render_ids(tokenizer, messages, add_generation_prompt=False) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def encode_conversation(messages: list[dict], tokenizer) -> tuple[list[int], list[int]]:
    """`(input_ids, labels)` of a whole conversation, every assistant turn labelled."""
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
    return input_ids, labels


def _with_eos(ids: list[int], tokenizer) -> list[int]:
    eos = tokenizer.eos_token_id
    return ids + [eos] if eos is not None and (not ids or ids[-1] != eos) else ids


def _text(value, what: str) -> str:
    """A text field; numbers (as CSV and Parquet readers type "7") are their text, anything else is an error."""
    if isinstance(value, str):
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    raise RecipeError(f"{what} has no text ({value!r}).")


def encode_example(example: dict, dataset_format: str, tokenizer) -> tuple[list[int], list[int]]:
    """`(input_ids, labels)` of one example, before truncation."""
    if dataset_format in CONVERSATION_FORMATS:
        messages = [{"role": m["role"], "content": _text(m["content"], f"a {m['role']} turn")}
                    for m in to_messages(example, dataset_format)]
        return encode_conversation(messages, tokenizer)
    if dataset_format == "prompt_completion":
        prompt_ids = tokenizer(_text(example["prompt"], "`prompt`"))["input_ids"]
        completion = _text(example["completion"], "`completion`")
        completion_ids = _with_eos(tokenizer(completion, add_special_tokens=False)["input_ids"], tokenizer)
        return prompt_ids + completion_ids, [IGNORE_INDEX] * len(prompt_ids) + completion_ids
    if dataset_format == "text":
        input_ids = _with_eos(tokenizer(_text(example["text"], "`text`"))["input_ids"], tokenizer)
        return input_ids, list(input_ids)
    raise RecipeError(f"unknown dataset format `{dataset_format}`.")


def encode_messages(messages: list[dict], tokenizer, max_seq_length: int) -> dict[str, list[int]]:
    """`input_ids`, `attention_mask` and `labels` for one conversation, truncated to `max_seq_length`."""
    input_ids, labels = encode_conversation(messages, tokenizer)
    input_ids, labels = input_ids[:max_seq_length], labels[:max_seq_length]
    return {"input_ids": input_ids, "attention_mask": [1] * len(input_ids), "labels": labels}


@dataclass
class PreparedData:
    train: Dataset
    eval: Dataset | None
    # Raw eval conversations for generation: prompt messages, reference answer and task name.
    generation_examples: list[dict]
    summary: dict  # per split: rows, tokens, length percentiles, truncated and dropped rows (data_summary.json)


def _tokenize_split(split: Dataset, name: str, tokenizer, data_args, dataset_format: str) -> tuple[Dataset, dict]:
    max_length = data_args.max_seq_length

    def encode(example, index):
        try:
            input_ids, labels = encode_example(example, dataset_format, tokenizer)
        except RecipeError as error:
            raise RecipeError(f"{name} example {index + 1}: {error}") from None
        length, drop = len(input_ids), ""
        if length > max_length:
            if data_args.overlong_policy == "error":
                raise RecipeError(f"{name} example {index + 1} has {length} tokens, more than `max_seq_length: "
                                  f"{max_length}` (`overlong_policy: error`; or truncate, drop).")
            drop = "overlong" if data_args.overlong_policy == "drop" else ""
            input_ids, labels = input_ids[:max_length], labels[:max_length]
        if not drop and all(label == IGNORE_INDEX for label in labels):
            if data_args.unlabeled_policy == "error":
                raise RecipeError(f"{name} example {index + 1} has no answer token left after truncation to "
                                  f"`max_seq_length: {max_length}` (`unlabeled_policy: error`; or drop).")
            drop = "no_answer_tokens"  # its loss would be 0/0
        return {"input_ids": input_ids, "attention_mask": [1] * len(input_ids), "labels": labels,
                "original_length": length, "drop": drop}

    started = time.time()
    encoded = split.map(encode, with_indices=True, remove_columns=split.column_names, desc=f"tokenizing {name}")
    # Another rank (or an earlier run) wrote the cache file this map read: it did not tokenize again.
    from_cache = bool(encoded.cache_files) and Path(encoded.cache_files[0]["filename"]).stat().st_mtime < started
    lengths = np.asarray(encoded["original_length"])
    reasons = encoded["drop"]
    kept = encoded.filter(lambda drop: drop == "", input_columns="drop").remove_columns(["original_length", "drop"])
    kept_lengths = np.minimum(lengths[np.asarray(reasons) == ""], max_length)
    summary = {
        "rows": len(split),
        "rows_kept": len(kept),
        "tokens": int(kept_lengths.sum()),
        "length_percentiles": {f"p{q}": int(np.percentile(lengths, q)) for q in (50, 90, 99)}
        | {"max": int(lengths.max())},
        "truncated_rows": int(((lengths > max_length) & (np.asarray(reasons) == "")).sum())
        if data_args.overlong_policy == "truncate" else 0,
        "dropped": {reason: reasons.count(reason) for reason in ("overlong", "no_answer_tokens") if reason in reasons},
        "from_cache": from_cache,
    }
    return kept, summary


def generation_examples(split: Dataset, dataset_format: str, limit: int) -> list[dict]:
    """Eval conversations cut before their last assistant turn, for exact-match generation."""
    if dataset_format not in CONVERSATION_FORMATS:
        return []
    examples = []
    for example in split.select(range(min(limit, len(split)))):
        messages = to_messages(example, dataset_format)
        answers = [i for i, message in enumerate(messages) if message["role"] == "assistant"]
        if answers:
            examples.append({"prompt": messages[: answers[-1]], "reference": messages[answers[-1]]["content"],
                             "task": example.get("task") or "all"})
    return examples


def prepare_datasets(raw, tokenizer, data_args, training_args) -> PreparedData:
    """Tokenizes each source once (rank 0 first; the other ranks then read the `datasets` cache it wrote),
    mixes the training sources by weight and concatenates their eval splits."""
    trains, evals, examples, sources = [], [], [], []
    with training_args.main_process_first(desc="tokenizing the dataset"):
        for source in raw.sources:
            dataset_format = detect_format(source.train.column_names, data_args.dataset_format)
            train, train_summary = _tokenize_split(source.train, "train", tokenizer, data_args, dataset_format)
            record = {"name": source.name, "format": dataset_format, "train": train_summary, "eval": None}
            trains.append(train)
            if source.eval is not None:
                detect_format(source.eval.column_names, dataset_format)  # the eval split must have the same columns
                eval_split = source.eval
                if data_args.max_eval_samples is not None:
                    eval_split = eval_split.select(range(min(data_args.max_eval_samples, len(eval_split))))
                evaluation, record["eval"] = _tokenize_split(eval_split, "eval", tokenizer, data_args, dataset_format)
                evals.append(evaluation)
                wanted = data_args.generation_eval_samples - len(examples)
                examples += generation_examples(eval_split, dataset_format, wanted) if wanted > 0 else []
            sources.append(record)
    for record, train in zip(sources, trains):
        if len(train) == 0:
            raise RecipeError(f"no training example of {record['name']} is left after the data policies "
                              f"({record['train']['dropped']}); raise `max_seq_length: {data_args.max_seq_length}` "
                              f"or check the data.")
    if len(trains) > 1:  # draw from each source with its probability until one runs out
        train = interleave_datasets(trains, probabilities=raw.weights, seed=training_args.seed)
    else:
        train = trains[0]
    evaluation = (concatenate_datasets(evals) if len(evals) > 1 else evals[0]) if evals else None
    summary = {"sources": sources, "weights": raw.weights, "train_rows": len(train),
               "eval_rows": len(evaluation) if evaluation is not None else 0}
    return PreparedData(train, evaluation, examples, summary)
