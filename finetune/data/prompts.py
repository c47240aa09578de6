"""Prompts for online reinforcement learning (`method: grpo`): the policy writes the completions, the rewards score
them, so the data are prompts and what the rewards check them against.

A row becomes `{"prompt", "answer", "task", ...}`, the row's other columns kept (TRL hands every column to each
reward function as a keyword argument):
- a row with a `prompt` column (TRL's prompt-only and prompt-completion formats) keeps its prompt, text or chat
  messages; a `completion`, where given, is the `answer`;
- a conversation (every SFT format: messages, sharegpt, alpaca, and `dataset: synthetic`) is cut before its last
  assistant turn, which becomes the `answer`.

A prompt that leaves no room for `max_completion_length` new tokens within `max_seq_length` goes through the recipe's
`overlong_policy` (a prompt is never cut: it would change the question): refused under `error`, else dropped and
counted.
"""

from __future__ import annotations

from dataclasses import dataclass

from datasets import Dataset, concatenate_datasets

from finetune.data.formats import CONVERSATION_FORMATS, detect_format, openai_message, to_messages
from finetune.errors import RecipeError

ANSWER_COLUMN = "answer"   # what the built-in rewards compare a completion with
TASK_COLUMN = "task"       # the exact match is reported per task (a row's `task`, else its source's name)


@dataclass
class PromptData:
    train: Dataset
    eval: Dataset | None
    summary: dict


def to_prompt_row(example: dict, dataset_format: str, source: str) -> dict:
    """One row as a GRPO prompt: `prompt` (text or messages), `answer` (text or None) and `task`, with the row's
    other columns as they are."""
    row = {key: value for key, value in example.items()}
    if dataset_format == "prompt":
        prompt = example["prompt"]
        if isinstance(prompt, list):
            prompt = [openai_message(message) for message in prompt]
        completion = example.get("completion")
        if isinstance(completion, list):
            completion = "".join(str(message.get("content") or "") for message in completion)
        answer = example.get(ANSWER_COLUMN, completion)
        row.pop("completion", None)
    else:
        messages = to_messages(example, dataset_format)
        answers = [index for index, message in enumerate(messages) if message["role"] == "assistant"]
        if not answers:
            raise RecipeError(f"{source}: a conversation without an assistant turn has no answer to check; give "
                              "such rows as `prompt` rows.")
        prompt, answer = messages[: answers[-1]], messages[answers[-1]]["content"]
        for column in ("messages", "conversations", "instruction", "input", "output", "system"):
            row.pop(column, None)
    row.update({"prompt": prompt, ANSWER_COLUMN: None if answer is None else str(answer),
                TASK_COLUMN: str(example.get(TASK_COLUMN) or source)})
    return row


def prompt_format(column_names, declared: str) -> str:
    if "prompt" in column_names and declared in ("auto", "prompt_completion"):
        return "prompt"
    dataset_format = detect_format(column_names, declared)
    if dataset_format not in CONVERSATION_FORMATS:
        raise RecipeError(f"`method: grpo` trains on prompts, but the data are `{dataset_format}` rows (plain text): "
                          "give a `prompt` column, or conversations whose last assistant turn is the answer.")
    return dataset_format


def drop_overlong_prompts(prompts: Dataset, tokenizer, data_args, max_completion_length: int, name: str):
    """Prompts leaving fewer than `max_completion_length` tokens of `max_seq_length`: refused (`overlong_policy:
    error`) or dropped, counted."""
    room = data_args.max_seq_length - max_completion_length  # at least 1 (the method's training arguments)
    lengths = [len(prompt_ids(tokenizer, prompt)) for prompt in prompts["prompt"]]
    overlong = [index for index, length in enumerate(lengths) if length > room]
    if overlong and data_args.overlong_policy == "error":
        raise RecipeError(f"a prompt of {name} has {lengths[overlong[0]]} tokens, more than the {room} that "
                          f"`max_seq_length: {data_args.max_seq_length}` leaves beside `max_completion_length: "
                          f"{max_completion_length}` (`overlong_policy: error`; or drop).")
    if overlong:
        drop = set(overlong)
        prompts = prompts.select([index for index in range(len(prompts)) if index not in drop])
    return prompts, len(overlong), max(lengths, default=0)


def prompt_ids(tokenizer, prompt) -> list[int]:
    """The tokens of a prompt as TRL's GRPOTrainer renders it: chat messages with the template and the generation
    prompt, text as it is."""
    if isinstance(prompt, list):
        return tokenizer.apply_chat_template(prompt, tokenize=True, add_generation_prompt=True, return_dict=False)
    return tokenizer(prompt, add_special_tokens=False)["input_ids"]


def load_prompt_data(data_args, seed: int, tokenizer=None, max_completion_length: int | None = None) -> PromptData:
    """The training and eval prompts of every source (mixed by `mix_weights`), with a summary per source; with a
    `tokenizer`, prompts without room for `max_completion_length` tokens go through `overlong_policy`."""
    from finetune.data.loading import load_raw_data

    raw = load_raw_data(data_args)
    trains, evals, sources = [], [], []
    for source in raw.sources:
        record = {"name": source.name}
        for split, dataset in source.splits(data_args.max_eval_samples).items():
            if dataset is None:
                record[split] = None
                continue
            dataset_format = prompt_format(dataset.column_names, source.declared_format(data_args))
            prompts = Dataset.from_list([to_prompt_row(row, dataset_format, source.name) for row in dataset])
            dropped, longest = 0, None
            if tokenizer is not None:
                prompts, dropped, longest = drop_overlong_prompts(prompts, tokenizer, data_args,
                                                                  max_completion_length, f"{source.name} ({split})")
            if not len(prompts):
                raise RecipeError(f"no {split} prompt of {source.name} is left: every one is longer than "
                                  f"`max_seq_length` less `max_completion_length` allows.")
            record["format"] = dataset_format
            record[split] = {"rows": len(dataset), "prompts": len(prompts), "dropped": {"overlong": dropped},
                             "with_answer": sum(answer is not None for answer in prompts[ANSWER_COLUMN]),
                             "longest_prompt_tokens": longest}
            (trains if split == "train" else evals).append(prompts)
        sources.append(record)
    train = raw.mixed(trains, seed)
    evaluation = (concatenate_datasets(evals) if len(evals) > 1 else evals[0]) if evals else None
    summary = {"sources": sources, "train_rows": len(train),
               "eval_rows": 0 if evaluation is None else len(evaluation)}
    return PromptData(train, evaluation, summary)


def exact_match_examples(prompts, limit: int) -> list[dict]:
    """The first `limit` eval prompts with an answer, as the exact-match callback scores them (chat prompts only:
    it renders them with the template, as generation does)."""
    if prompts is None:
        return []
    examples = []
    for row in prompts:
        if len(examples) >= limit:
            break
        if isinstance(row["prompt"], list) and row[ANSWER_COLUMN] is not None:
            examples.append({"prompt": row["prompt"], "reference": row[ANSWER_COLUMN], "task": row[TASK_COLUMN]})
    return examples


def print_prompt_summary(summary: dict) -> None:
    for source in summary["sources"]:
        parts = []
        for split in ("train", "eval"):
            if source.get(split):
                counts = source[split]
                dropped = counts["dropped"]["overlong"]
                parts.append(f"{split} {counts['prompts']} prompts ({counts['with_answer']} with an answer)"
                             + (f", {dropped} dropped (no room for the completion)" if dropped else ""))
        print(f"prompts {source['name']} ({source['format']}): {', '.join(parts)}")
