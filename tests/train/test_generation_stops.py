"""Generation stops where training taught the model to stop: at every token that closes an assistant turn in the chat
template (ChatML `<|im_end|>`, Llama-3 `<|eot_id|>`, Gemma `<end_of_turn>`, Mistral `</s>`), not only at the
generation config's EOS, in `finetune chat` and in the exact-match evaluation; and chat talks to a run in the format
it was trained on: plain text, without a chat template, for prompt/completion and text runs (the run's
data_summary.json says which)."""

import io
import json
import shutil

import pytest
from hub_fixtures import build_tokenizer, save_hub_model
from support import assert_succeeded, finetune_command, run

from finetune.cli import main

ANSWER = "The answer is"
INVENTED_TURN = "user"  # what a base model writes after its turn ends: the next turn, here `<|im_start|>user`


def rig_bigram(model, chain: list[int]) -> None:
    """Makes a Qwen2 model a bigram lookup that writes `chain` on: every layer adds nothing to the residual stream
    (output projections zeroed), token `chain[i]` embeds as unit vector i, and the head maps unit vector i to
    `chain[i + 1]`; every other token embeds as zero (all logits 0)."""
    import torch

    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.embed_tokens.weight.zero_()
        model.lm_head.weight.zero_()
        for slot, (token, following) in enumerate(zip(chain, chain[1:])):
            model.model.embed_tokens.weight[token, slot] = 1.0
            model.lm_head.weight[following, slot] = 1.0


@pytest.fixture(scope="module")
def rambling_base(tmp_path_factory):
    """A Qwen2.5-base-like checkpoint: ChatML template closing turns with `<|im_end|>`, EOS `<|endoftext|>` (in the
    tokenizer, config and generation config), bf16 weights forced to answer `The answer is<|im_end|>`, then invent the
    next turn (`<|im_start|>user`) and only then write EOS."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    directory = save_hub_model(tmp_path_factory.mktemp("rambling_base"), "chatml")
    tokenizer = AutoTokenizer.from_pretrained(directory)
    tokenizer.eos_token = "<|endoftext|>"
    model = AutoModelForCausalLM.from_pretrained(directory)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                           add_generation_prompt=True)
    ids = tokenizer.convert_tokens_to_ids

    def tokens(text):
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    chain = [tokens(prompt)[-1], *tokens(ANSWER), ids("<|im_end|>"), ids("<|im_start|>"), *tokens(INVENTED_TURN),
             tokenizer.eos_token_id]
    assert len(set(chain[:-1])) == len(chain) - 1  # a bigram model writes a chain of distinct tokens
    rig_bigram(model, chain)
    model.config.eos_token_id = model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def test_the_rigged_base_writes_an_invented_turn_before_its_eos(rambling_base):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(rambling_base)
    model = AutoModelForCausalLM.from_pretrained(rambling_base)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                           return_tensors="pt", return_dict=True)
    output = model.generate(**prompt, max_new_tokens=20, do_sample=False)  # the generation config's EOS alone
    written = tokenizer.decode(output[0, prompt["input_ids"].shape[1]:])
    assert written == f"{ANSWER}<|im_end|><|im_start|>{INVENTED_TURN}<|endoftext|>"


def test_chat_stops_at_the_templates_end_of_turn_not_only_at_eos(rambling_base, capsys):
    assert main(["chat", str(rambling_base), "--prompt", "hi", "--max-new-tokens", "20"]) == 0
    assert capsys.readouterr().out == f"{ANSWER}\n"


def test_the_conversation_keeps_the_answer_up_to_its_turns_end(rambling_base, capsys, monkeypatch):
    from finetune.train.trained_model import render_prompt

    monkeypatch.setattr("sys.stdin", io.StringIO("hi\nand then?\n"))
    assert main(["chat", str(rambling_base), "--show-prompt", "--max-new-tokens", "20"]) == 0
    output = capsys.readouterr()
    assert output.out == f"{ANSWER}\n{ANSWER}\n"
    prompts = [line for line in output.err.splitlines() if line.startswith("[prompt] ")]
    tokenizer = build_tokenizer("chatml")
    history = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": ANSWER},
               {"role": "user", "content": "and then?"}]
    assert prompts[1] == f"[prompt] {render_prompt(tokenizer, history)!r}"  # no invented turn in the history


def test_exact_match_stops_at_the_templates_end_of_turn(rambling_base):
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerState

    from finetune.train.evaluation import ExactMatchCallback

    tokenizer = AutoTokenizer.from_pretrained(rambling_base)
    model = AutoModelForCausalLM.from_pretrained(rambling_base)
    examples = [{"prompt": [{"role": "user", "content": "hi"}], "reference": ANSWER, "task": "answer"},
                {"prompt": [{"role": "system", "content": "be brief"},
                            {"role": "user", "content": "a longer question, so the batch is padded"}],
                 "reference": ANSWER, "task": "answer"}]
    callback = ExactMatchCallback(tokenizer, examples, max_new_tokens=20)
    callback.on_evaluate(None, TrainerState(), None, model=model, metrics={"eval_loss": 1.0})
    result = callback.history[-1]
    assert [sample["answer"] for sample in result["samples"]] == [ANSWER, ANSWER]
    assert result["per_task"] == {"answer": 1.0}


@pytest.mark.parametrize(("family", "eos", "turn_end"), [
    ("chatml", "<|endoftext|>", "<|im_end|>"),  # Qwen2.5 base
    ("chatml_think_latest", "<|endoftext|>", "<|im_end|>"),  # Qwen3: found in the whole rendered conversation
    ("llama3", "<|end_of_text|>", "<|eot_id|>"),  # Llama-3 base
    ("gemma", "<eos>", "<end_of_turn>"),
    ("mistral", "</s>", "</s>"),  # the template closes turns with EOS itself
])
def test_generation_stops_at_every_end_of_turn_token_and_eos(family, eos, turn_end):
    from transformers import GenerationConfig

    from finetune.train.evaluation import stop_token_ids

    tokenizer = build_tokenizer(family)
    tokenizer.eos_token = eos
    ids = tokenizer.convert_tokens_to_ids
    configured = GenerationConfig(eos_token_id=ids(eos))
    assert stop_token_ids(tokenizer, configured) == sorted({ids(eos), ids(turn_end)})
    # several EOS in the generation config (Llama-3 instruct lists two): all kept
    configured = GenerationConfig(eos_token_id=[ids(eos), 7])
    assert stop_token_ids(tokenizer, configured) == sorted({ids(eos), ids(turn_end), 7})
    # plain-text runs learned EOS alone (finetune.data.tokenize: prompt/completion and text)
    assert stop_token_ids(tokenizer, configured, chat_template=False) == sorted({ids(eos), 7})


# A run trained on prompt/completion pairs: the model saw `prompt` + `completion` + EOS, never a chat template.
PAIRS = [{"prompt": f"reverse {letters}: ", "completion": letters[::-1]} for letters in ("abc", "xyz", "hello", "tuv")]


@pytest.fixture(scope="module")
def prompt_completion_run(tmp_path_factory):
    directory = tmp_path_factory.mktemp("prompt_completion_run")
    data = directory / "pairs.jsonl"
    data.write_text("".join(json.dumps(pair) + "\n" for pair in PAIRS))
    output_dir = directory / "run"
    assert_succeeded(run(finetune_command(
        "train", "recipes/demo.yaml", "--output_dir", str(output_dir), "--train_file", str(data),
        "--max_steps", "2", "--per_device_train_batch_size", "4", "--save_strategy", "steps", "--save_steps", "2",
        "--eval_on_start", "false", "--report_to", "none", "--disable_tqdm", "true"), timeout=600))
    return output_dir


def shown_prompts(err: str) -> list[str]:
    import ast

    return [ast.literal_eval(line.removeprefix("[prompt] ")) for line in err.splitlines()
            if line.startswith("[prompt] ")]


@pytest.mark.parametrize("where", ["output_dir", "checkpoint"])
def test_a_prompt_completion_run_is_prompted_with_plain_text(prompt_completion_run, where, capsys):
    source = prompt_completion_run / "checkpoint-2" if where == "checkpoint" else prompt_completion_run
    assert main(["chat", str(source), "--prompt", "reverse abc: ", "--max-new-tokens", "4", "--show-prompt"]) == 0
    err = capsys.readouterr().err
    assert shown_prompts(err) == ["reverse abc: "]  # as training tokenized it: no `<|user|>`, no `<|assistant|>`
    assert "prompt_completion" in err and "without a chat template" in err


def test_an_export_of_a_prompt_completion_run_is_prompted_with_plain_text(prompt_completion_run, tmp_path, capsys):
    exported = tmp_path / "exported"
    assert main(["export", str(prompt_completion_run), str(exported)]) == 0
    capsys.readouterr()
    assert main(["chat", str(exported), "--prompt", "reverse abc: ", "--max-new-tokens", "1", "--show-prompt"]) == 0
    assert shown_prompts(capsys.readouterr().err) == ["reverse abc: "]


def test_turns_to_a_plain_text_run_are_answered_each_on_its_own(prompt_completion_run, capsys, monkeypatch):
    monkeypatch.setattr("sys.stdin", io.StringIO("reverse abc: \nreverse xyz: \n"))
    assert main(["chat", str(prompt_completion_run), "--show-prompt", "--max-new-tokens", "4"]) == 0
    output = capsys.readouterr()
    assert shown_prompts(output.err) == ["reverse abc: ", "reverse xyz: "]  # no history: one-shot
    assert "each turn is answered on its own" in output.err


def test_a_system_turn_to_a_plain_text_run_is_refused_in_one_line(prompt_completion_run, capsys):
    assert main(["chat", str(prompt_completion_run), "--prompt", "reverse abc: ", "--system", "be brief"]) == 2
    output = capsys.readouterr()
    assert output.out == "" and len(output.err.strip().splitlines()) == 1, output.err
    assert "--system" in output.err and "prompt_completion" in output.err


def copy_with_formats(run_dir, destination, formats: list[str]):
    """The run with its data summary saying it was trained on sources of `formats`."""
    shutil.copytree(run_dir, destination)
    summary = json.loads((destination / "data_summary.json").read_text())
    summary["sources"] = [{**summary["sources"][0], "name": f"source{i}", "format": fmt}
                          for i, fmt in enumerate(formats)]
    (destination / "data_summary.json").write_text(json.dumps(summary))
    return destination


@pytest.mark.parametrize(("formats", "templated"), [
    (["text"], False),  # continued pre-training: plain text
    (["text", "prompt_completion"], False),
    (["prompt_completion", "alpaca"], True),  # it learned conversations too
    (["messages"], True),
    (["sharegpt_pairs"], True),  # preference pairs as conversations
])
def test_the_recorded_data_format_decides_the_rendering(prompt_completion_run, tmp_path, formats, templated, capsys):
    source = copy_with_formats(prompt_completion_run, tmp_path / "run", formats)
    assert main(["chat", str(source), "--prompt", "reverse abc: ", "--max-new-tokens", "1", "--show-prompt"]) == 0
    [prompt] = shown_prompts(capsys.readouterr().err)
    assert prompt == ("<|user|>reverse abc: <|end|><|assistant|>" if templated else "reverse abc: ")


@pytest.mark.parametrize(("plain_text", "templated"), [(True, False), (False, True)])
def test_preference_pairs_of_plain_strings_are_prompted_as_plain_text(prompt_completion_run, tmp_path, plain_text,
                                                                        templated, capsys):
    """DPO renders pairs given as plain strings without a template (TRL's is_conversational), and records so."""
    source = copy_with_formats(prompt_completion_run, tmp_path / "run", ["pairs"])
    summary = json.loads((source / "data_summary.json").read_text())
    summary["sources"][0]["plain_text"] = plain_text
    (source / "data_summary.json").write_text(json.dumps(summary))
    assert main(["chat", str(source), "--prompt", "reverse abc: ", "--max-new-tokens", "1", "--show-prompt"]) == 0
    [prompt] = shown_prompts(capsys.readouterr().err)
    assert prompt == ("<|user|>reverse abc: <|end|><|assistant|>" if templated else "reverse abc: ")


def test_a_run_saves_its_templates_end_of_turn_as_a_stop_token_for_generate_elsewhere(rambling_base, tmp_path):
    """One step of training on conversations from the ChatML base whose EOS is `<|endoftext|>`: the saved model's
    generation config stops at `<|im_end|>` too, so a plain `generate` (a pipeline, a server) ends the turn there."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    output_dir = tmp_path / "run"
    assert_succeeded(run(finetune_command(
        "train", "recipes/demo.yaml", "--model_name_or_path", str(rambling_base), "--output_dir", str(output_dir),
        "--max_steps", "1", "--learning_rate", "1e-12", "--per_device_train_batch_size", "2",
        "--eval_on_start", "false", "--generation_eval_samples", "0", "--max_eval_samples", "2",
        "--report_to", "none", "--disable_tqdm", "true"), timeout=600))
    tokenizer = AutoTokenizer.from_pretrained(output_dir)
    saved = GenerationConfig.from_pretrained(output_dir).eos_token_id
    assert sorted(saved) == sorted({tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.eos_token_id})
    model = AutoModelForCausalLM.from_pretrained(output_dir)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                           return_tensors="pt", return_dict=True)
    output = model.generate(**prompt, max_new_tokens=20, do_sample=False)  # the saved generation config alone
    assert tokenizer.decode(output[0, prompt["input_ids"].shape[1]:]) == f"{ANSWER}<|im_end|>"


def test_a_plain_text_run_keeps_eos_alone_as_its_stop_token(prompt_completion_run):
    from transformers import AutoTokenizer, GenerationConfig

    saved = GenerationConfig.from_pretrained(prompt_completion_run).eos_token_id
    assert saved == AutoTokenizer.from_pretrained(prompt_completion_run).eos_token_id
