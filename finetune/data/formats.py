"""Dataset formats, detected from the columns or declared with `dataset_format`.

Conversations (rendered with the tokenizer's chat template; only assistant turns are learned):
- alpaca: `instruction`, optional `input`, `output` → user: instruction (+ blank line + input), assistant: output
- sharegpt: `conversations`, a list of {from: system|human|gpt, value}
- messages: OpenAI-style `messages`, a list of {role: system|user|assistant, content}
Plain text (no template):
- prompt_completion: `prompt` and `completion` strings; only the completion (and EOS) is learned
- text: `text`; every token is learned (continued pre-training)
"""

from __future__ import annotations

from finetune.errors import RecipeError

# In detection order: the first whose columns are all present wins.
FORMAT_COLUMNS = {
    "messages": ("messages",),
    "sharegpt": ("conversations",),
    "alpaca": ("instruction", "output"),
    "prompt_completion": ("prompt", "completion"),
    "text": ("text",),
}
CONVERSATION_FORMATS = ("messages", "sharegpt", "alpaca")
SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant"}


def detect_format(column_names, declared: str = "auto") -> str:
    columns = set(column_names)
    if declared != "auto":
        if declared not in FORMAT_COLUMNS:
            raise RecipeError(f"`dataset_format: {declared}` is not one of auto, {', '.join(FORMAT_COLUMNS)}.")
        missing = [column for column in FORMAT_COLUMNS[declared] if column not in columns]
        if missing:
            raise RecipeError(f"`dataset_format: {declared}` needs column(s) {', '.join(missing)}; the dataset has: "
                              f"{', '.join(sorted(columns))}.")
        return declared
    for name, required in FORMAT_COLUMNS.items():
        if set(required) <= columns:
            return name
    expected = "; ".join(f"{name}: {', '.join(required)}" for name, required in FORMAT_COLUMNS.items())
    raise RecipeError(
        f"cannot tell the dataset format from its columns ({', '.join(sorted(columns))}); expected one of: {expected}."
    )


def to_messages(example: dict, dataset_format: str) -> list[dict]:
    """The conversation of one example, as `{role, content}` messages."""
    if dataset_format == "messages":
        return [{"role": m["role"], "content": m["content"]} for m in example["messages"]]
    if dataset_format == "sharegpt":
        messages = []
        for turn in example["conversations"]:
            role = SHAREGPT_ROLES.get(turn.get("from"))
            if role is None:
                raise RecipeError(f"ShareGPT turn with `from: {turn.get('from')}`; expected one of "
                                  f"{', '.join(SHAREGPT_ROLES)}.")
            messages.append({"role": role, "content": turn["value"]})
        return messages
    if dataset_format == "alpaca":
        prompt = example["instruction"]
        if example.get("input"):
            prompt = f"{prompt}\n\n{example['input']}"
        return [{"role": "user", "content": prompt}, {"role": "assistant", "content": example["output"]}]
    raise RecipeError(f"`{dataset_format}` examples are plain text, not conversations.")
