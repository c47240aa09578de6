"""Preference pairs: a prompt, a chosen answer and a rejected one, as TRL's preference trainers take them; and
unpaired examples (a prompt, a completion, a `label` saying whether it is desirable), as TRL's KTOTrainer takes them.

The formats (`PAIR_FORMATS`: TRL's own, and LLaMA-Factory's alpaca and sharegpt pairs) share the SFT formats' message
readers (finetune.data.formats); `dataset: synthetic` makes pairs from the synthetic tasks, the correct answer chosen
and a plausible wrong one rejected (`synthetic_pair`). For unpaired examples every pair of those formats becomes two
(TRL's `unpair_preference_dataset`: the chosen answer desirable, the rejected one not), beside rows that are unpaired
already (`UNPAIRED`). Pairs and examples are checked and counted per source as SFT examples are; what TRL drops or
truncates when it tokenizes them goes through the same length policies (`apply_pair_length_policies`).
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass

import numpy as np
import pyarrow.compute as pc
from datasets import Dataset, concatenate_datasets
from trl.data_utils import is_conversational, maybe_extract_prompt, unpair_preference_dataset

from finetune.data.formats import openai_message, sharegpt_message
from finetune.data.tokenize import column
from finetune.errors import RecipeError

PAIR_FORMATS = {
    "sharegpt_pairs": ("conversations", "chosen", "rejected"),
    "alpaca_pairs": ("instruction", "chosen", "rejected"),
    "pairs": ("chosen", "rejected"),
}
# Unpaired examples (TRL's unpaired preference format): a prompt, a completion and whether it is desirable.
UNPAIRED = "unpaired"
UNPAIRED_COLUMNS = ("prompt", "completion", "label")
# The index of the source a pair comes from, carried through mixing and TRL's tokenizing so that what TRL drops or
# truncates is counted per source; Trainer leaves it out of the batches (not an input of the model).
SOURCE_COLUMN = "source_index"
# Where TRL's tokenized pairs hold their answers' token ids (the prompt's: `prompt_ids`)
PAIR_ANSWER_IDS = ("chosen_ids", "rejected_ids")


@dataclass
class PreferenceData:
    train: Dataset
    eval: Dataset | None
    summary: dict


def detect_pair_format(column_names, unpaired: bool = False) -> str:
    """The pair format of the columns; with `unpaired` (a method that reads unpaired examples), `UNPAIRED` for rows
    with a `completion`, whose other columns must be there too."""
    columns = set(column_names)
    if unpaired and "completion" in columns:
        missing = [f"`{column}`" for column in UNPAIRED_COLUMNS if column not in columns]
        if missing:
            raise RecipeError(f"the data has a `completion` column, read as unpaired examples, but no "
                              f"{' or '.join(missing)} column: each row needs the `prompt` it answers and a `label`, "
                              "true where the completion is desirable and false where it is not (or give pairs: "
                              "prompt, chosen, rejected).")
        return UNPAIRED
    for name, required in PAIR_FORMATS.items():
        if set(required) <= columns:
            return name
    expected = "; ".join(f"{name}: {', '.join(required)}" for name, required in PAIR_FORMATS.items())
    if unpaired:
        expected = f"{UNPAIRED}: {', '.join(UNPAIRED_COLUMNS)}; {expected}"
    kind = "unpaired examples or preference pairs" if unpaired else "preference pairs"
    raise RecipeError(f"a preference method trains on {kind}, but the data's columns are "
                      f"{', '.join(sorted(columns))}; expected one of: {expected} (`prompt` optional with `pairs`).")


def to_pair(example: dict, pair_format: str) -> dict:
    """One example as TRL's preference row: `prompt`, `chosen`, `rejected`, each a string (plain text) or a list of
    chat messages (rendered with the tokenizer's template)."""
    if pair_format == "alpaca_pairs":
        prompt = example["instruction"]
        if example.get("input"):
            prompt = f"{prompt}\n\n{example['input']}"
        return {"prompt": [{"role": "user", "content": prompt}],
                "chosen": [{"role": "assistant", "content": example["chosen"]}],
                "rejected": [{"role": "assistant", "content": example["rejected"]}]}
    if pair_format == "sharegpt_pairs":
        prompt = [sharegpt_message(turn) for turn in example["conversations"]]
        if example.get("system") and (not prompt or prompt[0]["role"] != "system"):
            prompt.insert(0, {"role": "system", "content": example["system"]})
        return {"prompt": prompt, "chosen": [sharegpt_message(example["chosen"])],
                "rejected": [sharegpt_message(example["rejected"])]}
    row = {key: example.get(key) for key in ("prompt", "chosen", "rejected")}
    for key, value in row.items():
        if isinstance(value, list):
            row[key] = [openai_message(message) for message in value]
    if row["prompt"] is None:
        if not isinstance(row["chosen"], list):
            raise RecipeError("preference rows without a `prompt` column must give `chosen` and `rejected` as whole "
                              "conversations (lists of messages) that share the prompt; plain-text pairs need a "
                              "`prompt` column.")
        del row["prompt"]  # TRL's extract_prompt takes the shared start of both conversations
    return row


def to_unpaired(example: dict) -> dict:
    """An unpaired row as TRL's KTOTrainer reads it: `prompt` and `completion` as given (messages normalised as for
    pairs), `label` as given (checked by `check_unpaired`)."""
    row = {key: example.get(key) for key in UNPAIRED_COLUMNS}
    for key in ("prompt", "completion"):
        if isinstance(row[key], list):
            row[key] = [openai_message(message) for message in row[key]]
    return row


def unpair(pairs: Dataset) -> Dataset:
    """Each pair as two unpaired examples (TRL's `unpair_preference_dataset`): the prompt with the chosen answer,
    desirable, and with the rejected one, not; a pair of whole conversations has its prompt taken from their shared
    start first (TRL's `extract_prompt`), which unpaired examples can no longer give."""
    if "prompt" not in pairs.column_names:
        pairs = pairs.map(maybe_extract_prompt)
    return unpair_preference_dataset(pairs)


def answer_text(answer) -> str:
    """The text of an answer: a string, or the content of its messages."""
    if isinstance(answer, list):
        return "".join(str(message.get("content") or "") for message in answer
                       if message.get("role") == "assistant" or message.get("tool_calls"))
    return "" if answer is None else str(answer)


def check_pairs(dataset: Dataset, name: str, unlabeled_policy: str) -> tuple[Dataset, dict]:
    """Refuses rows whose parts differ in kind (text vs conversation); drops, counted, pairs with an empty answer
    (`unlabeled_policy: error` stops on the first) and pairs whose answers are equal (they teach nothing)."""
    dropped = {"empty_answer": 0, "same_answers": 0}
    keep = []
    for index, row in enumerate(dataset):
        kinds = {key: isinstance(row[key], list) for key in ("prompt", "chosen", "rejected") if key in row}
        if len(set(kinds.values())) > 1:
            raise RecipeError(f"{name} row {index}: {', '.join(k for k, v in kinds.items() if v)} are conversations "
                              f"but {', '.join(k for k, v in kinds.items() if not v)} plain text; give all of a "
                              "pair as strings or all as lists of messages.")
        chosen, rejected = answer_text(row["chosen"]), answer_text(row["rejected"])
        if not chosen.strip() or not rejected.strip():
            if unlabeled_policy == "error":
                raise RecipeError(f"{name} row {index} has an empty {'chosen' if not chosen.strip() else 'rejected'} "
                                  "answer (`unlabeled_policy: error`); fix the row or let such rows be dropped.")
            dropped["empty_answer"] += 1
        elif chosen == rejected and row["chosen"] == row["rejected"]:
            dropped["same_answers"] += 1
        else:
            keep.append(index)
    if not keep:
        raise RecipeError(f"no preference pair of {name} is left ({dropped}): every pair has an empty answer or two "
                          "equal answers.")
    return (dataset if len(keep) == len(dataset) else dataset.select(keep)), dropped


def check_unpaired(dataset: Dataset, name: str, unlabeled_policy: str) -> tuple[Dataset, dict]:
    """Refuses a row whose `label` is not true or false (it says whether the completion is desirable, which is what
    the method learns) and rows whose prompt and completion differ in kind; drops, counted, examples with an empty
    completion (`unlabeled_policy: error` stops on the first)."""
    dropped = {"empty_answer": 0}
    keep = []
    for index, row in enumerate(dataset):
        if not isinstance(row["label"], bool):
            raise RecipeError(f"{name} row {index} has `label: {row['label']!r}`; a label is true (the completion is "
                              "desirable) or false (it is not): fix the column, 1/0 or text are not read as either.")
        if isinstance(row["prompt"], list) != isinstance(row["completion"], list):
            raise RecipeError(f"{name} row {index}: one of prompt and completion is a conversation and the other "
                              "plain text; give both as strings or both as lists of messages.")
        if not answer_text(row["completion"]).strip():
            if unlabeled_policy == "error":
                raise RecipeError(f"{name} row {index} has an empty completion (`unlabeled_policy: error`); fix the "
                                  "row or let such rows be dropped.")
            dropped["empty_answer"] += 1
        else:
            keep.append(index)
    if not keep:
        raise RecipeError(f"no example of {name} is left ({dropped}): every completion is empty.")
    return (dataset if len(keep) == len(dataset) else dataset.select(keep)), dropped


def synthetic_pair(example: dict, rng: random.Random) -> dict:
    """A synthetic task as a preference pair: the correct answer chosen, a typical mistake rejected: the letters left
    as given (reverse, sort), sorted the wrong way round, or a sum off by one or ten; two neighbours swapped where
    those would be right."""
    answer, given = example["output"], example["input"]
    if example["task"] == "add":
        total = int(answer)
        wrong = [str(total + delta) for delta in (1, -1, 10) if total + delta >= 0]
    else:
        wrong = [given] if example["task"] == "reverse" else [given, answer[::-1]]
    wrong = sorted({candidate for candidate in wrong if candidate != answer})
    if not wrong:  # a palindrome, or letters already in order
        wrong = [answer[:i] + answer[i + 1] + answer[i] + answer[i + 2:] for i in range(len(answer) - 1)
                 if answer[i] != answer[i + 1]] or [answer + answer[-1:]]
    prompt = f"{example['instruction']}\n\n{given}"
    return {"prompt": [{"role": "user", "content": prompt}],
            "chosen": [{"role": "assistant", "content": answer}],
            "rejected": [{"role": "assistant", "content": rng.choice(wrong)}]}


def synthetic_pairs(dataset: Dataset, seed: int) -> Dataset:
    rng = random.Random(seed)
    return Dataset.from_list([synthetic_pair(row, rng) for row in dataset])


def check_pair_data_keys(data_args, method: str, trainer: str) -> None:
    """Refuses the data keys that mean nothing for a method trained on pairs, which TRL's `trainer` tokenizes itself
    when training starts."""
    if data_args.packing or data_args.padding_free:
        raise RecipeError(f"`packing` and `padding_free` are for supervised fine-tuning; TRL's {trainer} pads each "
                          f"pair (drop them with `method: {method}`).")
    if data_args.streaming:
        raise RecipeError(f"`streaming: true` is for supervised fine-tuning; under `method: {method}` TRL's "
                          f"{trainer} tokenizes every pair before training: drop `streaming`.")
    if data_args.preprocessed_dir is not None:
        raise RecipeError(f"`preprocessed_dir: {data_args.preprocessed_dir}` names a cache of tokenized SFT data "
                          f"(`finetune preprocess`); under `method: {method}` TRL's {trainer} tokenizes the pairs "
                          "itself and reads no cache: drop the key.")


def load_preference_data(data_args, seed: int, unpaired: bool = False) -> PreferenceData:
    """The training and eval pairs of every source (mixed by `mix_weights`), checked, with a summary per source.
    `unpaired`: unpaired examples instead (`UNPAIRED` rows, and every pair as two), shuffled with `seed`, since TRL's
    KTOTrainer reads them in order (its KL term pairs each example with its batch neighbours' completions) and
    unpairing puts each batch of pairs' desirable examples before their undesirable ones."""
    from finetune import presets
    from finetune.data.loading import load_raw_data

    raw = load_raw_data(data_args)
    unit = "examples" if unpaired else "pairs"
    trains, evals, sources = [], [], []
    for source in raw.sources:
        record = {"name": source.name}
        for split, dataset in source.splits(data_args.max_eval_samples).items():
            if dataset is None:
                record[split] = None
                continue
            where = f"{source.name} ({split})"
            if source.name == presets.SYNTHETIC_DATASET:  # the embedded tasks (finetune.data.loading names it)
                pair_format, pairs = "synthetic_pairs", synthetic_pairs(dataset, seed + (split == "eval"))
            else:
                pair_format = detect_pair_format(dataset.column_names, unpaired)
                convert = to_unpaired if pair_format == UNPAIRED else lambda row: to_pair(row, pair_format)
                pairs = Dataset.from_list([convert(row) for row in dataset])
            if pair_format == UNPAIRED:
                pairs, dropped = check_unpaired(pairs, where, data_args.unlabeled_policy)
            else:
                pairs, dropped = check_pairs(pairs, where, data_args.unlabeled_policy)
                pairs = unpair(pairs) if unpaired else pairs
            pairs = pairs.add_column(SOURCE_COLUMN, [len(sources)] * len(pairs))
            record["format"] = pair_format
            if len(pairs):  # TRL renders conversational pairs with the chat template and plain ones as they are
                record["plain_text"] = not is_conversational(pairs[0])
            record[split] = {"rows": len(dataset), unit: len(pairs), "truncated_rows": 0,
                             "dropped": dropped | {"overlong": 0, "no_answer_tokens": 0}}
            if unpaired:
                record[split]["desirable"] = int(column(pairs, "label").sum())
            (trains if split == "train" else evals).append(pairs)
        sources.append(record)
    train = raw.mixed(trains, seed)
    evaluation = (concatenate_datasets(evals) if len(evals) > 1 else evals[0]) if evals else None
    if unpaired:
        train = train.shuffle(seed=seed).flatten_indices()
        evaluation = None if evaluation is None else evaluation.shuffle(seed=seed).flatten_indices()
    summary = {"sources": sources, "train_rows": len(train),
               "eval_rows": 0 if evaluation is None else len(evaluation)}
    return PreferenceData(train, evaluation, summary)


def apply_pair_length_policies(pairs: Dataset, tokenized: Dataset, data_args, split: str, summary: dict,
                               prompt: str | None = "prompt_ids", answers: tuple[str, ...] = PAIR_ANSWER_IDS,
                               unit: str = "pair") -> Dataset:
    """TRL's tokenized pairs under the recipe's length policies, with what became of them added to `summary` per
    source. TRL's trainer (its `_prepare_dataset`, truncation_mode `keep_start`) has already dropped every pair whose
    prompt alone fills `max_length` (our `max_seq_length`: no answer token would be left), and its collator keeps the
    first `max_length` tokens of each longer sequence (prompt + chosen, prompt + rejected). As for SFT examples, a
    pair longer than `max_seq_length` (its prompt and longer answer) is then truncated so (`overlong_policy:
    truncate`, counted), dropped (`drop`, counted) or refused (`error`), and a pair left with no answer token is
    dropped (`unlabeled_policy: drop`, counted as `no_answer_tokens`) or refused (`error`).

    A sequence's length is its `prompt` column's and its longest of `answers` (`prompt` None: the answer columns hold
    whole sequences); `unit`: what a row is (`example` for unpaired examples, whose summary counts `examples`)."""
    max_length, overlong_policy = data_args.max_seq_length, data_args.overlong_policy
    names = [source["name"] for source in summary["sources"]]
    dropped_by_trl = Counter(pairs[SOURCE_COLUMN]) - Counter(tokenized[SOURCE_COLUMN])
    for index, count in dropped_by_trl.items():
        fault = (f"{count} {unit}(s) of {names[index]} ({split}) have a prompt of `max_seq_length: {max_length}` "
                 "tokens or more, leaving no answer token")
        if overlong_policy == "error":
            raise RecipeError(f"{fault} (`overlong_policy: error`; or truncate, drop).")
        if overlong_policy == "truncate" and data_args.unlabeled_policy == "error":
            raise RecipeError(f"{fault} (`unlabeled_policy: error`; or drop; or raise `max_seq_length`).")
    # Token counts read from Arrow, not as Python lists: a large dataset's token ids would not fit in memory so.
    table = tokenized.select_columns([*filter(None, [prompt]), *answers, SOURCE_COLUMN]).with_format("arrow")[:]

    def token_counts(column: str):
        return pc.list_value_length(table[column]).to_numpy(zero_copy_only=False).astype(np.int64)

    lengths = np.max([token_counts(column) for column in answers], axis=0) + (token_counts(prompt) if prompt else 0)
    sources = table[SOURCE_COLUMN].to_numpy()
    is_overlong = lengths > max_length
    if is_overlong.any() and overlong_policy == "error":
        first = int(np.argmax(is_overlong))
        parts = "prompt and longer answer" if len(answers) > 1 else "prompt and answer"
        article = "an" if unit[0] in "aeiou" else "a"
        raise RecipeError(f"{article} {unit} of {names[sources[first]]} ({split}) has {lengths[first]} tokens "
                          f"({parts}), more than `max_seq_length: {max_length}` (`overlong_policy: error`; or "
                          "truncate, drop).")
    overlong_by_source = Counter(sources[is_overlong].tolist())
    if is_overlong.any() and overlong_policy == "drop":
        tokenized = tokenized.select(np.flatnonzero(~is_overlong))
    kept_by_source = Counter(sources[~is_overlong].tolist() if overlong_policy == "drop" else sources.tolist())
    for index in range(len(names)):
        record = summary["sources"][index][split]
        if record is None:
            continue
        if overlong_policy == "drop":
            record["dropped"]["overlong"] += dropped_by_trl[index] + overlong_by_source[index]
        else:
            record["dropped"]["no_answer_tokens"] += dropped_by_trl[index]
            record["truncated_rows"] += overlong_by_source[index]
        record[f"{unit}s"] = kept_by_source[index]
    summary[f"{split}_rows"] = len(tokenized)
    if not len(tokenized):
        dropped = Counter()
        for source in summary["sources"]:
            dropped.update(source[split]["dropped"] if source[split] else {})
        counts = ", ".join(f"{count} {reason.replace('_', ' ')}" for reason, count in dropped.items() if count)
        raise RecipeError(f"no {split} {unit} of {', '.join(names)} is left at `max_seq_length: {max_length}` "
                          f"(dropped: {counts}): raise `max_seq_length` above the {unit}s' prompt and answer"
                          f"{'' if overlong_policy != 'drop' else ', or set `overlong_policy: truncate`'}.")
    return tokenized


def print_preference_summary(summary: dict) -> None:
    for source in summary["sources"]:
        parts = []
        for split in ("train", "eval"):
            if source.get(split):
                record = source[split]
                dropped = {reason: count for reason, count in record["dropped"].items() if count}
                truncated = record.get("truncated_rows", 0)
                counted = (f"{record['pairs']} pairs" if "pairs" in record
                           else f"{record['examples']} examples ({record['desirable']} desirable)")
                parts.append(f"{split} {counted}" + (f" (dropped {dropped})" if dropped else "")
                             + (f" ({truncated} truncated to max_seq_length)" if truncated else ""))
        print(f"preference data {source['name']} ({source['format']}): {', '.join(parts)}")
