"""Completion-only labels under the chat templates of the families people fine-tune (tests/hub_fixtures.py), checked
token by token; templates whose labels cannot be verified are refused by name; `finetune labels` shows them."""

import json

import pytest
from hub_fixtures import FAMILIES, build_tokenizer

from finetune import presets
from finetune.cli import main
from finetune.data.tokenize import IGNORE_INDEX, encode_conversation
from finetune.errors import RecipeError
from finetune.models.loading import load_tokenizer
from finetune.recipe.args import ModelArguments

# What each family's template writes after an answer, and which of it is learned: the end-of-turn token (it is what
# generation stops on) but not the newline some templates put between turns, which follows it and is never generated.
AFTER_ANSWER = {
    "chatml": ("<|im_end|>", "<|im_end|>\n"),
    "chatml_think": ("<|im_end|>", "<|im_end|>\n"),
    "chatml_think_latest": ("<|im_end|>", "<|im_end|>\n"),
    "llama3": ("<|eot_id|>", "<|eot_id|>"),
    "mistral": ("</s>", "</s>"),
    "gemma": ("<end_of_turn>", "<end_of_turn>\n"),
    "base": ("<|endoftext|>", "<|endoftext|>"),  # the default template, closing turns with the tokenizer's EOS
}
# What the template writes just before an answer (the end of the prompt the model sees).
BEFORE_ANSWER = {"chatml": "<|im_start|>assistant\n", "chatml_think": "<|im_start|>assistant\n",
                 "chatml_think_latest": "<|im_start|>assistant\n",
                 "llama3": "<|start_header_id|>assistant<|end_header_id|>\n\n", "mistral": " [/INST]",
                 "gemma": "<start_of_turn>model\n", "base": "<|assistant|>"}
ANSWERS = ["the answer is cba", "ok, sorted: abc"]
SYSTEM = {"role": "system", "content": "be brief"}
TURNS = [{"role": "user", "content": "reverse abc"}, {"role": "assistant", "content": ANSWERS[0]},
         {"role": "user", "content": "and sort cab?"}, {"role": "assistant", "content": ANSWERS[1]}]


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    """Each family's tokenizer as `load_tokenizer` gives it to training (saved, then loaded from its directory: the
    base one gets the default template and EOS as padding)."""
    loaded = {}
    for family in FAMILIES:
        directory = tmp_path_factory.mktemp(family)
        build_tokenizer(family).save_pretrained(directory)
        loaded[family] = load_tokenizer(ModelArguments(model_name_or_path=str(directory)))
    return loaded


def learned_runs(tokenizer, input_ids, labels) -> list[list[int]]:
    """The labelled token ids, as runs of consecutive positions; every label must equal its input token."""
    assert all(label in (IGNORE_INDEX, token) for label, token in zip(labels, input_ids))
    runs, previous = [], IGNORE_INDEX
    for token, label in zip(input_ids, labels):
        if label != IGNORE_INDEX:
            if previous == IGNORE_INDEX:
                runs.append([])
            runs[-1].append(token)
        previous = label
    return runs


def conversation(family: str, turns: int) -> list[dict]:
    """The first `turns` user/assistant pairs, after a system prompt where the family has one (Gemma refuses it)."""
    return ([] if family == "gemma" else [SYSTEM]) + TURNS[: 2 * turns]


@pytest.mark.parametrize("turns", [1, 2])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_exactly_each_answer_and_its_end_of_turn_token_are_learned(tokenizers, family, turns):
    tokenizer = tokenizers[family]
    messages = conversation(family, turns)
    input_ids, labels = encode_conversation(messages, tokenizer)
    end_token, after = AFTER_ANSWER[family]
    # Qwen3-style: the latest answer opens with the empty thinking block the template writes there, which the model
    # must produce too; earlier answers are rendered (and learned) without it.
    opening = ["<think>\n\n</think>\n\n" if family == "chatml_think_latest" and turn == turns - 1 else ""
               for turn in range(turns)]
    learned = [opening[turn] + answer + end_token for turn, answer in enumerate(ANSWERS[:turns])]
    expected = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in learned]
    runs = learned_runs(tokenizer, input_ids, labels)
    assert [tokenizer.decode(run) for run in runs] == learned
    assert runs == expected  # token by token, not only as text
    text = tokenizer.decode(input_ids)
    for turn, answer in enumerate(ANSWERS[:turns]):
        assert BEFORE_ANSWER[family] + opening[turn] + answer + after in text  # the prompt ends before the answer
    if family != "gemma":
        assert "be brief" in text and "be brief" not in tokenizer.decode([t for run in runs for t in run])


def test_a_generation_prompt_that_is_not_a_prefix_of_the_turn_no_longer_shifts_the_labels(tokenizers):
    tokenizer = tokenizers["chatml_think"]
    messages = conversation("chatml_think", 1)
    prompt = tokenizer.apply_chat_template(messages[:-1], tokenize=False, add_generation_prompt=True)
    rendered = tokenizer.apply_chat_template(messages, tokenize=False)
    assert prompt.endswith("<|im_start|>assistant\n<think>\n") and not rendered.startswith(prompt)
    input_ids, labels = encode_conversation(messages, tokenizer)
    # The generation prompt is 2 tokens longer than the shared header: counting from its length lost "the answer".
    assert tokenizer.decode(learned_runs(tokenizer, input_ids, labels)[0]) == "the answer is cba<|im_end|>"


def test_an_opening_the_generation_prompt_writes_is_not_learned(tokenizers):
    """A reasoning answer starting with `<think>\\n`: the prompt writes that at inference, the model the rest."""
    tokenizer = tokenizers["chatml_think"]
    messages = [{"role": "user", "content": "reverse abc"},
                {"role": "assistant", "content": "<think>\nreverse it</think>cba"}]
    input_ids, labels = encode_conversation(messages, tokenizer)
    assert [tokenizer.decode(run) for run in learned_runs(tokenizer, input_ids, labels)] == [
        "reverse it</think>cba<|im_end|>"]


def test_the_default_template_ends_turns_with_the_tokenizers_eos():
    tiny = presets.build_tokenizer()  # eos `<|end|>`: renders exactly as before the template used `eos_token`
    assert tiny.apply_chat_template(TURNS[:2], tokenize=False) == (
        "<|user|>reverse abc<|end|><|assistant|>the answer is cba<|end|>")
    base = build_tokenizer("base")
    base.chat_template = presets.CHAT_TEMPLATE
    rendered = base.apply_chat_template(TURNS[:2], tokenize=False)
    assert rendered == "<|user|>reverse abc<|endoftext|><|assistant|>the answer is cba<|endoftext|>"
    assert base(rendered, add_special_tokens=False)["input_ids"][-1] == base.eos_token_id


def saved_with_template(tmp_path, template: str):
    tokenizer = build_tokenizer("chatml")
    tokenizer.chat_template = template
    tokenizer.save_pretrained(tmp_path / "odd")
    return load_tokenizer(ModelArguments(model_name_or_path=str(tmp_path / "odd")))


def test_a_template_that_never_ends_a_turn_with_a_special_token_is_refused_by_name(tmp_path):
    tokenizer = saved_with_template(tmp_path, "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n\n"
                                              "{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}")
    with pytest.raises(RecipeError, match=rf"chat template of `{tmp_path / 'odd'}` ends assistant turn 1 "
                                          r"\('the answer is cba\\n\\n'\) without a special token .*eos_token"):
        encode_conversation(TURNS[:2], tokenizer)


def test_a_span_without_the_answer_is_refused_rather_than_trained_on(tmp_path):
    tokenizer = saved_with_template(tmp_path, "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
                                              "{{ m['content'] | upper }}<|im_end|>{% endfor %}"
                                              "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    with pytest.raises(RecipeError, match=r"`.*odd`: the tokens found for assistant turn 1 \('THE ANSWER IS CBA'\) "
                                          r"do not hold its answer \('the answer is cba'\)"):
        encode_conversation(TURNS[:2], tokenizer)


def test_a_template_that_rewrites_earlier_answers_beyond_recognition_is_refused(tmp_path):
    tokenizer = saved_with_template(tmp_path, "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
                                              "{{ m['content'] if loop.last else m['content'][:4] }}<|im_end|>"
                                              "{% endfor %}")
    with pytest.raises(RecipeError, match="does not render a conversation as a prefix of its continuation, and the "
                                          "answers cannot be found"):
        encode_conversation(TURNS, tokenizer)


def test_a_turn_rendered_differently_once_the_conversation_goes_on_is_found_in_the_whole_rendering(tokenizers):
    """Qwen3's template writes `<think>\n\n</think>\n\n` before the latest answer only: the first answer, rendered
    as the last, is not a prefix of the whole conversation, and is found in it instead."""
    tokenizer = tokenizers["chatml_think_latest"]
    first_as_last = tokenizer.apply_chat_template(TURNS[:2], tokenize=False)
    assert not tokenizer.apply_chat_template(TURNS, tokenize=False).startswith(first_as_last)
    input_ids, labels = encode_conversation(TURNS, tokenizer)
    assert [tokenizer.decode(run) for run in learned_runs(tokenizer, input_ids, labels)] == [
        "the answer is cba<|im_end|>", "<think>\n\n</think>\n\nok, sorted: abc<|im_end|>"]


def test_a_template_error_is_a_recipe_error_naming_the_template(tokenizers):
    with pytest.raises(RecipeError, match="chat template of .* cannot render the conversation: System role not "
                                          "supported"):
        encode_conversation([SYSTEM, *TURNS[:2]], tokenizers["gemma"])


def test_labels_help(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["labels", "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "--num-examples" in out and "--split" in out and "learned" in out


def test_labels_past_the_end_or_without_an_eval_split_is_a_one_line_error(tmp_path, capsys):
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"instruction": "reverse", "input": w, "output": w[::-1]}) + "\n"
                            for w in ("abc", "xyz")))
    assert main(["labels", "recipes/demo.yaml", "--train_file", str(data), "--example", "3"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"finetune: error: `--example 3` is past the end of the train split of {data} (2 examples).")
    assert main(["labels", "recipes/demo.yaml", "--split", "eval", "--train_file", str(data)]) == 2
    assert "has no eval split; set `eval_file` or `eval_split_ratio`" in capsys.readouterr().err


def test_labels_shows_learned_tokens_and_counts_as_training_sees_them(capsys):
    assert main(["labels", "recipes/demo.yaml", "--split", "eval", "--num-examples", "2", "--example", "2"]) == 0
    out = capsys.readouterr().out
    eval_rows = [json.loads(line) for line in (presets.synthetic_data_dir() / "eval.jsonl").read_text().splitlines()]
    tokenizer = presets.build_tokenizer()
    for number in (2, 3):
        row = eval_rows[number - 1]
        prompt = row["instruction"] + (f"\n\n{row['input']}" if row["input"] else "")
        shown = f"<|user|>{prompt}<|end|><|assistant|>[[{row['output']}<|end|>]]"
        tokens = len(tokenizer(f"<|user|>{prompt}<|end|><|assistant|>{row['output']}<|end|>")["input_ids"])
        learned = len(tokenizer(row["output"])["input_ids"]) + 1
        assert f"── eval example {number} (alpaca, synthetic): {tokens} tokens, {learned} learned\n{shown}\n" in out
    assert "eval example 1 " not in out and "eval example 4" not in out
    assert out.strip().splitlines()[-1].startswith("2 example(s): ")


def test_labels_shows_what_truncation_leaves(capsys):
    assert main(["labels", "recipes/demo.yaml", "--num-examples", "1", "--max_seq_length", "8"]) == 0
    out = capsys.readouterr().out
    assert "dropped from training: no answer tokens): 8 tokens, 0 learned" in out and "[[" not in out


def test_labels_colours_learned_tokens_on_a_terminal():
    from io import StringIO

    from rich.console import Console

    from finetune.commands.labels import ShownExample, print_example

    console = Console(file=StringIO(), force_terminal=True, color_system="standard", width=200)
    print_example(console, ShownExample("train example 1", [("<|user|>hi<|assistant|>", False), ("yo<|end|>", True)],
                                        6, 2, "alpaca, x"), plain=False)
    styled = console.file.getvalue()
    assert "train example 1 (alpaca, x): 6 tokens, 2 learned" in styled and "[[" not in styled
    assert "\x1b[2m<|user|>hi<|assistant|>\x1b[0m\x1b[1;32myo<|end|>\x1b[0m" in styled  # dim, then bold green


def multi_turn(family: str, turns: int, seed: int, then_user: bool) -> list[dict]:
    """`turns` exchanges of varied words (some answers empty), after a system prompt where the family has one."""
    import random

    rng = random.Random(seed)
    words = "reverse sort the answer is abc cba ok count letters in word".split()
    say = lambda most: " ".join(rng.choice(words) for _ in range(rng.randint(0, most))).strip()  # noqa: E731
    messages = [] if family == "gemma" else [SYSTEM]
    for _ in range(turns):
        messages += [{"role": "user", "content": say(6) or "hi"}, {"role": "assistant", "content": say(9)}]
    return messages + ([{"role": "user", "content": "and then?"}] if then_user else [])


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_one_rendering_finds_the_spans_rendering_turn_by_turn_finds(tokenizers, family, monkeypatch):
    """Labels from the conversation rendered and tokenized once (linear in its turns) equal those of each assistant
    turn rendered as the last with its generation prompt (the square of them), on every family, 1 to 12 turns, with
    empty answers and a trailing user turn; the templates whose turns render otherwise (a generation prompt that
    opens a `<think>` block, Mistral's, which has none) keep the turn-by-turn path."""
    import finetune.data.tokenize as tokenize

    tokenizer = tokenizers[family]
    conversations = [multi_turn(family, turns, seed, then_user) for turns in (1, 2, 5, 12) for seed in range(3)
                     for then_user in (False, True)]
    one_pass = [encode_conversation(messages, tokenizer) for messages in conversations]
    taken = {tokenize._spans_from_one_render(messages, tokenize._render(tokenizer, messages), tokenizer, None,
                                             tokenize._special_ids(tokenizer))[1] is not None
             for messages in conversations}
    monkeypatch.setattr(tokenize, "_spans_from_one_render", lambda *args: (None, None))
    assert one_pass == [encode_conversation(messages, tokenizer) for messages in conversations]
    assert taken == ({False} if family in ("chatml_think", "chatml_think_latest", "mistral") else {True})
