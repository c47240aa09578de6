"""Dataset formats, detected from the columns or declared with `dataset_format`, turned into the messages (and tool
list) that Hugging Face chat templates take.

Conversations (rendered with the tokenizer's chat template; only assistant turns are learned, tool calls included):
- alpaca: `instruction`, optional `input`, `output` → user: instruction (+ blank line + input), assistant: output
- sharegpt: `conversations`, a list of {from: system|human|gpt|function_call|observation, value}, optional `system`
  and `tools` columns (LLaMA-Factory's shape: a `function_call` value is the JSON of {name, arguments} or a list of
  them, an `observation` is the tool's result)
- messages: OpenAI-style `messages`, a list of {role: system|user|assistant|tool, content}, assistant turns with
  optional `tool_calls` [{id, type: function, function: {name, arguments}}] and null content, tool turns with
  `tool_call_id`; optional top-level `tools`
Plain text (no template):
- prompt_completion: `prompt` and `completion` strings; only the completion (and EOS) is learned
- text: `text`; every token is learned (continued pre-training)

Tool calls become what `apply_chat_template(messages, tools=...)` expects (Transformers' chat templating docs,
"Tool use"): an assistant message with `tool_calls` whose `arguments` are a dict where they parse as JSON, and a
`tool` message for each result. `tools` may be a JSON string or a list of schemas, in either the OpenAI
({type: function, function: {...}}) or the bare ({name, description, parameters}) form.
"""

from __future__ import annotations

import json

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
# The roles chat templates render (OpenAI's, and Llama 3.1's `ipython` for tool results): any other would render as
# something no template knows, or vanish, leaving an example with nothing to learn.
MESSAGE_ROLES = ("system", "developer", "user", "assistant", "tool", "ipython")
SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "function_call": "assistant", "observation": "tool", "tool": "tool"}


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
    """The conversation of one example, as chat-template messages: `{role, content}`, plus `tool_calls` on an
    assistant turn that calls tools and `tool_call_id` on a tool result that names its call."""
    if dataset_format == "messages":
        return _opens_with_a_prompt([openai_message(message) for message in example["messages"]])
    if dataset_format == "sharegpt":
        messages = [sharegpt_message(turn) for turn in example["conversations"]]
        if example.get("system") and (not messages or messages[0]["role"] != "system"):
            messages.insert(0, {"role": "system", "content": example["system"]})
        return _opens_with_a_prompt(messages)
    if dataset_format == "alpaca":
        prompt = example["instruction"]
        if example.get("input"):
            prompt = f"{prompt}\n\n{example['input']}"
        return [{"role": "user", "content": prompt}, {"role": "assistant", "content": example["output"]}]
    raise RecipeError(f"`{dataset_format}` examples are plain text, not conversations.")


def to_tools(example: dict) -> list[dict] | None:
    """The example's `tools` column as a list of schemas (None when it has none): what the template lists."""
    tools = example.get("tools")
    if tools is None or tools == "" or tools == []:
        return None
    if isinstance(tools, str):
        tools = _parse_json(tools, "`tools`")
    if isinstance(tools, dict):
        tools = [tools]
    if not isinstance(tools, list) or not all(isinstance(tool, dict) for tool in tools):
        raise RecipeError(f"`tools` must be a list of tool schemas (or its JSON), got {tools!r:.200}.")
    tools = [_without_nulls(tool) for tool in tools]
    for tool in tools:
        if not tool_name(tool):
            raise RecipeError(f"a tool schema has no `name` (nor `function.name`): {json.dumps(tool):.200}.")
    return tools


def tool_name(tool: dict) -> str | None:
    """The function name of a tool schema in the OpenAI ({type, function: {name}}) or the bare ({name}) form."""
    function = tool.get("function")
    return function.get("name") if isinstance(function, dict) else tool.get("name")


def sharegpt_message(turn: dict) -> dict:
    sender = turn.get("from")
    role = SHAREGPT_ROLES.get(sender)
    if role is None:
        raise RecipeError(f"ShareGPT turn with `from: {sender}`; expected one of {', '.join(SHAREGPT_ROLES)}.")
    if sender != "function_call":
        return {"role": role, "content": turn.get("value")}
    calls = _parse_json(turn.get("value"), "a `function_call` turn's value")
    calls = calls if isinstance(calls, list) else [calls]
    return {"role": "assistant", "content": "",
            "tool_calls": [_tool_call(call, "a `function_call` turn") for call in calls]}


def _opens_with_a_prompt(messages: list[dict]) -> list[dict]:
    """An answer needs a prompt before it: an assistant turn first (after system turns) has none to render, and
    templates refuse or misrender it."""
    first = next((message for message in messages if message["role"] not in ("system", "developer")), None)
    if first is not None and first["role"] == "assistant":
        raise RecipeError("the conversation opens with an assistant turn; it must open with a user turn (after an "
                          "optional system turn): drop the leading assistant turn or put the user's message first.")
    return messages


def openai_message(message: dict) -> dict:
    role = message.get("role")
    if role not in MESSAGE_ROLES:
        raise RecipeError(f"a message has `role: {role}`; expected one of {', '.join(MESSAGE_ROLES)}.")
    converted = {"role": role, "content": message.get("content")}
    if role == "assistant" and message.get("tool_calls"):
        converted["tool_calls"] = [_tool_call(call, "an assistant turn's `tool_calls`")
                                   for call in message["tool_calls"]]
        converted["content"] = converted["content"] or ""  # OpenAI sends null beside tool calls
    if role == "tool" and message.get("tool_call_id"):
        converted["tool_call_id"] = message["tool_call_id"]
    return converted


def _tool_call(call, where: str) -> dict:
    """One call as templates read it: {type: function, function: {name, arguments}}, `arguments` a dict where it
    parses as JSON (templates `tojson` a dict; a string they would quote a second time)."""
    if not isinstance(call, dict):
        raise RecipeError(f"{where}: a call must be an object with `name` and `arguments`, got {call!r:.200}.")
    function = call.get("function") if isinstance(call.get("function"), dict) else call
    name = function.get("name")
    if not isinstance(name, str) or not name:
        raise RecipeError(f"{where}: a call has no function `name`: {json.dumps(call, default=str):.200}.")
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError:
            pass  # some datasets keep free text; the template renders it as given
    elif arguments is None:
        arguments = {}
    elif isinstance(arguments, dict):
        arguments = _without_nulls(arguments)
    converted = {"type": "function", "function": {"name": name, "arguments": arguments}}
    if call.get("id"):
        converted["id"] = call["id"]
    return converted


def _parse_json(value, what: str):
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError as error:
        raise RecipeError(f"{what} is not valid JSON ({error.msg} at column {error.colno}): {value!r:.200}.") from None


def _without_nulls(value):
    """`value` without null members. A JSON or Parquet column of objects becomes one Arrow struct holding the union
    of every row's keys, the keys a row lacks filled with null; dropping them gives each row back its own keys."""
    if isinstance(value, dict):
        return {key: _without_nulls(item) for key, item in value.items() if item is not None}
    if isinstance(value, list):
        return [_without_nulls(item) for item in value]
    return value
