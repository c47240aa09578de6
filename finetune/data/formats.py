"""Dataset formats, detected from the columns, and their conversion to chat messages.

- alpaca: `instruction`, optional `input`, `output` → user: instruction (+ blank line + input), assistant: output
- messages: OpenAI-style `messages` list of {role, content}
"""

from __future__ import annotations

from finetune.errors import RecipeError

FORMAT_COLUMNS = {
    "messages": ("messages",),
    "alpaca": ("instruction", "output"),
}


def detect_format(column_names) -> str:
    columns = set(column_names)
    for name, required in FORMAT_COLUMNS.items():
        if set(required) <= columns:
            return name
    expected = "; ".join(f"{name}: {', '.join(required)}" for name, required in FORMAT_COLUMNS.items())
    raise RecipeError(
        f"cannot tell the dataset format from its columns ({', '.join(sorted(columns))}); expected one of: {expected}."
    )


def to_messages(example: dict, dataset_format: str) -> list[dict]:
    if dataset_format == "messages":
        return list(example["messages"])
    if dataset_format == "alpaca":
        prompt = example["instruction"]
        if example.get("input"):
            prompt = f"{prompt}\n\n{example['input']}"
        return [{"role": "user", "content": prompt}, {"role": "assistant", "content": example["output"]}]
    raise RecipeError(f"unknown dataset format `{dataset_format}`; known: {', '.join(FORMAT_COLUMNS)}.")
