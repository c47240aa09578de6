"""Tool-calling data: LLaMA-Factory's ShareGPT (`function_call`, `observation`, `tools`) and OpenAI `messages`
(`tool_calls`, `tool` turns, `tools`) rendered by the template's own tool support; the calls are learned, the tool
list and the results are not; templates without tool support and malformed calls are refused by name."""

import json
import math

import pytest
from hub_fixtures import build_tokenizer

from finetune import presets
from finetune.cli import main
from finetune.data import encode_example, load_raw_data, prepare_datasets, to_messages
from finetune.data.tokenize import IGNORE_INDEX
from finetune.errors import RecipeError
from finetune.models.loading import load_tokenizer
from finetune.recipe.args import DataArguments, ModelArguments

WEATHER = {"name": "get_weather", "description": "Weather of a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
TIME = {"name": "get_time", "description": "Time in a timezone",
        "parameters": {"type": "object", "properties": {"timezone": {"type": "string"}}}}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>'
ANSWER = "It is sunny and 21 degrees.<|im_end|>"


def sharegpt_row(tools=(WEATHER,), call=None):
    call = call or json.dumps({"name": "get_weather", "arguments": {"city": "Paris"}})
    return {"conversations": [{"from": "human", "value": "Weather in Paris?"}, {"from": "function_call", "value": call},
                              {"from": "observation", "value": "sunny, 21"},
                              {"from": "gpt", "value": "It is sunny and 21 degrees."}],
            "tools": json.dumps(list(tools))}


def openai_row(arguments='{"city": "Paris"}', tools=(WEATHER,), name="get_weather"):
    return {"messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": name, "arguments": arguments}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21"},
        {"role": "assistant", "content": "It is sunny and 21 degrees."}],
        "tools": [{"type": "function", "function": tool} for tool in tools]}


@pytest.fixture(scope="module")
def chatml():
    return build_tokenizer("chatml")


def learned_runs(tokenizer, input_ids, labels) -> list[str]:
    runs, previous = [], IGNORE_INDEX
    for token, label in zip(input_ids, labels):
        if label != IGNORE_INDEX:
            assert label == token
            if previous == IGNORE_INDEX:
                runs.append([])
            runs[-1].append(token)
        previous = label
    return [tokenizer.decode(run) for run in runs]


def test_sharegpt_function_calls_become_template_tool_calls():
    messages = to_messages(sharegpt_row(), "sharegpt")
    assert [m["role"] for m in messages] == ["user", "assistant", "tool", "assistant"]
    assert messages[1] == {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}
    assert messages[2] == {"role": "tool", "content": "sunny, 21"}
    with_system = to_messages({**sharegpt_row(), "system": "be brief"}, "sharegpt")  # LLaMA-Factory's `system` column
    assert with_system[0] == {"role": "system", "content": "be brief"} and with_system[1:] == messages


@pytest.mark.parametrize("row,dataset_format", [(sharegpt_row(), "sharegpt"), (openai_row(), "messages")],
                         ids=["sharegpt", "openai"])
def test_the_call_and_the_answer_are_learned_not_the_tools_or_the_result(chatml, row, dataset_format):
    input_ids, labels = encode_example(row, dataset_format, chatml)
    assert learned_runs(chatml, input_ids, labels) == [CALL, ANSWER]
    text = chatml.decode(input_ids)
    assert '<tools>\n{"' in text and '"name": "get_weather", "description": "Weather of a city"' in text
    assert "<|im_start|>user\n<tool_response>\nsunny, 21\n</tool_response><|im_end|>" in text
    learned = [t for t, label in zip(input_ids, labels) if label != IGNORE_INDEX]
    assert len(learned) == len(chatml(CALL + ANSWER, add_special_tokens=False)["input_ids"])


def test_both_shapes_encode_the_same_conversation_identically(chatml):
    openai = openai_row(arguments={"city": "Paris"})
    openai["tools"] = json.dumps([WEATHER])  # the same tool list, as LLaMA-Factory gives it
    assert encode_example(openai, "messages", chatml) == encode_example(sharegpt_row(), "sharegpt", chatml)


def test_each_row_keeps_its_own_argument_and_schema_keys_through_a_jsonl_file(tmp_path, chatml):
    """Arrow reads a column of objects as one struct of every row's keys; a row must not gain the others' as null."""
    path = tmp_path / "tools.jsonl"
    rows = [openai_row(arguments={"city": "Paris"}), openai_row(arguments={"timezone": "CET"}, tools=(TIME,),
                                                                name="get_time")]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    data_args = DataArguments(train_file=str(path), generation_eval_samples=0)
    source = load_raw_data(data_args).sources[0]
    first, second = (chatml.decode(encode_example(source.train[i], "messages", chatml)[0]) for i in (0, 1))
    assert '"arguments": {"city": "Paris"}}' in first and "timezone" not in first and "null" not in first
    assert '"arguments": {"timezone": "CET"}}' in second and "city" not in second and "null" not in second


@pytest.mark.parametrize("family", ["gemma", "base", "llama3", "chatml_think"])
def test_a_template_without_tool_support_is_refused_by_name(tmp_path, family):
    tokenizer = build_tokenizer(family)
    tokenizer.chat_template = tokenizer.chat_template or presets.CHAT_TEMPLATE
    tokenizer.save_pretrained(tmp_path / family)
    tokenizer.name_or_path = str(tmp_path / family)
    with pytest.raises(RecipeError, match=rf"chat template of `{tmp_path / family}`.* does not render the `tools` "
                                          r"list \(`get_weather` is missing.*it has no tool support; use a model "
                                          r"whose chat template supports tools"):
        encode_example(sharegpt_row(), "sharegpt", tokenizer)


def test_tool_calls_without_a_tool_list_still_need_a_template_that_renders_them():
    tokenizer = build_tokenizer("base")
    tokenizer.chat_template = presets.CHAT_TEMPLATE
    row = openai_row()
    del row["tools"]
    with pytest.raises(RecipeError, match=r"\(the default template given to tokenizers without one\) does not render "
                                          r"tool calls \(the call to `get_weather` in assistant turn 1 is missing"):
        encode_example(row, "messages", tokenizer)
    with pytest.raises(RecipeError, match="cannot render the conversation: roles must be user/assistant/system "
                                          r"\(the conversation has tool calls or results, which it may not support"):
        encode_example(row, "messages", build_tokenizer("mistral"))


def test_malformed_calls_and_tool_lists_name_the_example(tmp_path, chatml):
    cases = [(2, '{"name": "get_weather", "arguments": {"city": "Par',
              r"a `function_call` turn's value is not valid JSON \(Unterminated string"),
             (3, '{"arguments": {"city": "Paris"}}', r"a `function_call` turn: a call has no function `name`: \{")]
    for number, call, expected in cases:
        path = tmp_path / f"bad{number}.jsonl"
        rows = [sharegpt_row()] * (number - 1) + [sharegpt_row(call=call)]
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
        with pytest.raises(RecipeError, match=rf"train example {number}: {expected}"):
            prepare_datasets(load_raw_data(DataArguments(train_file=str(path))), chatml,
                             DataArguments(train_file=str(path)), OneProcess())
    with pytest.raises(RecipeError, match=r"`tools` is not valid JSON"):
        encode_example({**sharegpt_row(), "tools": "[{"}, "sharegpt", chatml)
    with pytest.raises(RecipeError, match=r"a tool schema has no `name`"):
        encode_example({**sharegpt_row(), "tools": [{"description": "x"}]}, "sharegpt", chatml)


class OneProcess:
    seed = 0

    @staticmethod
    def main_process_first(desc=""):
        import contextlib

        return contextlib.nullcontext()


CITIES = ["Paris", "Rome", "Oslo", "Lima"]


def write_tool_data(path, shape: str = "sharegpt", rows: int = 16):
    """Tool-calling rows in LLaMA-Factory's ShareGPT or OpenAI's shape, two tools, each row with its own city."""
    lines = []
    for index in range(rows):
        city = CITIES[index % len(CITIES)]
        if shape == "sharegpt":
            row = sharegpt_row(tools=(WEATHER, TIME),
                               call=json.dumps({"name": "get_weather", "arguments": {"city": city}}))
            row["conversations"][0]["value"] = f"Weather in {city}?"
        else:
            row = openai_row(arguments=json.dumps({"city": city}), tools=(WEATHER, TIME))
            row["messages"][0]["content"] = f"Weather in {city}?"
        lines.append(json.dumps(row))
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.parametrize("shape, dataset_format", [("sharegpt", "sharegpt"), ("openai", "messages")])
def test_a_hub_like_model_trains_on_tool_calls(tmp_path, hub_model_dir, shape, dataset_format):
    data = write_tool_data(tmp_path / "tools.jsonl", shape)
    output_dir = tmp_path / "out"
    status = main(["train", "recipes/demo.yaml", "--model_name_or_path", str(hub_model_dir), "--train_file", str(data),
                   "--max_seq_length", "512", "--per_device_train_batch_size", "4", "--max_steps", "6",
                   "--learning_rate", "3e-3", "--warmup_steps", "0", "--logging_steps", "1",
                   "--generation_eval_samples", "0", "--output_dir", str(output_dir), "--disable_tqdm", "true"])
    assert status == 0
    summary = json.loads((output_dir / "data_summary.json").read_text())["sources"][0]
    assert summary["format"] == dataset_format and summary["train"]["dropped"] == {}
    assert summary["train"]["rows_kept"] == 16 and summary["train"]["truncated_rows"] == 0
    # Exactly each row's call and answer with their end tokens: the tool list and the results carry no label.
    tokenizer = load_tokenizer(ModelArguments(model_name_or_path=str(hub_model_dir)))
    learned = sum(len(tokenizer(CALL.replace("Paris", CITIES[i % 4]) + ANSWER, add_special_tokens=False)["input_ids"])
                  for i in range(16))
    assert summary["train"]["labelled_tokens"] == learned
    state = json.loads((output_dir / "trainer_state.json").read_text())
    losses = [entry["loss"] for entry in state["log_history"] if "loss" in entry]
    assert len(losses) == 6 and all(math.isfinite(loss) for loss in losses) and losses[-1] < losses[0]


def test_labels_view_shows_the_call_learned_and_the_result_masked(tmp_path, hub_model_dir, capsys):
    data = write_tool_data(tmp_path / "tools.jsonl", rows=2)
    assert main(["labels", "recipes/demo.yaml", "--model_name_or_path", str(hub_model_dir), "--train_file", str(data),
                 "--max_seq_length", "512", "--num-examples", "1"]) == 0
    out = capsys.readouterr().out
    assert f"[[{CALL}]]\n<|im_start|>user\n<tool_response>\nsunny, 21\n</tool_response><|im_end|>\n" in out
    assert f"[[{ANSWER}]]\n" in out and "[[" not in out.split("<|im_start|>assistant")[0]
    assert "── train example 1 (sharegpt, " in out and "1 example(s): " in out


@pytest.mark.parametrize("row", [sharegpt_row(), openai_row(), sharegpt_row(tools=(WEATHER, TIME))])
def test_tool_calls_are_found_in_one_rendering_as_turn_by_turn(chatml, row, monkeypatch):
    """A conversation with tool calls and results is labelled from its one rendering (linear in its turns) exactly
    as rendering each assistant turn as the last labels it."""
    import finetune.data.tokenize as tokenize

    dataset_format = "sharegpt" if "conversations" in row else "messages"
    messages = to_messages(row, dataset_format)
    tools = tokenize.to_tools(row)
    text = tokenize._render(chatml, messages, tools)
    assert tokenize._spans_from_one_render(messages, text, chatml, tools, tokenize._special_ids(chatml))[1]
    one_pass = encode_example(row, dataset_format, chatml)
    monkeypatch.setattr(tokenize, "_spans_from_one_render", lambda *args: (None, None))
    assert one_pass == encode_example(row, dataset_format, chatml)
    assert learned_runs(chatml, *one_pass)[-1] == ANSWER
