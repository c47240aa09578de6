"""`finetune chat`: the trained demo model answers held-out reverse tasks, one-shot and in a conversation read from
stdin (history kept, /reset, /exit); a LoRA run answers the same with and without --merge-lora; ZeRO-3 shards answer
as the gathered model; a tokenizer without a template gets training's default; help and error paths."""

import json
import subprocess

import pytest
from support import PROJECT_ROOT, assert_succeeded, finetune_command, run

from finetune import presets
from finetune.cli import main

# Held out: in the synthetic eval split, not among the training inputs (checked below). The fixture's model gets about
# nine in ten held-out reversals right (exact match 0.87-0.99 after 800 to 1500 steps, varying with the libraries'
# versions), so the one-shot test asks eight and wants a clear majority right, each answer alone on its line.
HELD_OUT = ["plihu", "jvvsk", "dyl", "utpto", "cfwd", "qph", "irc", "oqva"]
# A LoRA run whose adapter changes the greedy answer (after 3 steps it is the base's, after 5 to 10 it is empty).
LORA_RUN = ["--use_lora", "true", "--lora_r", "8", "--learning_rate", "1e-2", "--max_steps", "40",
            "--eval_on_start", "false", "--generation_eval_samples", "0", "--max_eval_samples", "10",
            "--report_to", "none", "--disable_tqdm", "true"]


def reverse(letters: str) -> str:
    return f"reverse\n\n{letters}"  # the alpaca rendering of a synthetic task (finetune.data.formats)


def train(output_dir, *overrides: str):
    assert_succeeded(run(finetune_command("train", "recipes/demo.yaml", "--output_dir", str(output_dir), *overrides),
                         timeout=600))
    return output_dir


@pytest.fixture(scope="session")
def lora_run(tmp_path_factory):
    return train(tmp_path_factory.mktemp("chat_lora"), *LORA_RUN)


def chat_in_subprocess(*args: str, turns: str = ""):
    result = subprocess.run(finetune_command("chat", *args), input=turns, capture_output=True, text=True,
                            cwd=PROJECT_ROOT, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def test_the_prompts_are_held_out():
    data = presets.synthetic_data_dir()
    inputs = {split: {json.loads(line)["input"] for line in (data / f"{split}.jsonl").read_text().splitlines()}
              for split in ("train", "eval")}
    assert set(HELD_OUT) <= inputs["eval"] and not set(HELD_OUT) & inputs["train"]


def ask(model_dir, prompt: str, capsys) -> tuple[str, str]:
    assert main(["chat", str(model_dir), "--prompt", prompt]) == 0
    output = capsys.readouterr()
    return output.out, output.err


def test_one_shot_answers_held_out_reverse_tasks(trained_demo, capsys):
    answers = {letters: ask(trained_demo, reverse(letters), capsys) for letters in HELD_OUT}
    right = [letters for letters, (out, _) in answers.items() if out == f"{letters[::-1]}\n"]
    assert len(right) >= 6, answers  # the streamed answer alone: no prompt, no special token
    assert all(out.count("\n") == 1 and "<|" not in out for out, _ in answers.values())
    assert all(f"loaded {trained_demo} (torch.float32" in err for _, err in answers.values())


def test_conversation_from_stdin_keeps_history_until_reset_and_stops_at_exit(trained_demo, capsys):
    first_letters, second_letters = HELD_OUT[:2]
    alone = ask(trained_demo, reverse(second_letters), capsys)[0].strip()  # the second task asked on its own
    turns = (f"reverse\\\n\\\n{first_letters}\n"  # a line ending in \ goes on on the next: the task's blank line
             f"reverse\\\n\\\n{second_letters}\n"
             "/reset\n"
             f"reverse\\\n\\\n{second_letters}\n"
             "/exit\n"
             "never answered\n")
    result = chat_in_subprocess(str(trained_demo), "--show-prompt", turns=turns)
    prompts = [shown_prompt(line) for line in result.stderr.splitlines() if line.startswith("[prompt] ")]
    answers = result.stdout.splitlines()
    assert len(answers) == 3 and ">>>" not in result.stdout  # no `>>> ` prompt off a terminal; nothing after /exit
    first = f"<|user|>reverse\n\n{first_letters}<|end|><|assistant|>"
    second = f"<|user|>reverse\n\n{second_letters}<|end|><|assistant|>"
    assert prompts == [first, f"{first}{answers[0]}<|end|>{second}", second]  # history, then none after /reset
    assert answers[-1] == alone  # after /reset the answer is the one given without the first turn in the prompt


def shown_prompt(line: str) -> str:
    """The prompt `--show-prompt` printed as a Python string literal."""
    import ast

    return ast.literal_eval(line.removeprefix("[prompt] "))


def test_lora_output_dir_answers_the_same_merged_and_through_peft(lora_run, capsys):
    from finetune.commands.chat import Conversation, generation_settings

    answers = {}
    for merge in ([], ["--merge-lora"]):
        assert main(["chat", str(lora_run), "--prompt", reverse("abc"), "--max-new-tokens", "12", *merge]) == 0
        output = capsys.readouterr()
        answers[bool(merge)] = output.out
        assert ("with its LoRA adapter" in output.err) == (not merge)
    tokenizer = presets.build_tokenizer()
    base = presets.build_model(tokenizer, seed=0).eval()
    base_answer = Conversation(base, tokenizer, generation_settings(12, None, None)).ask(reverse("abc"))
    capsys.readouterr()
    # The adapter, rebuilt on the `tiny` base, is used: the base's answer (random weights, never empty) differs.
    assert base_answer.strip() and answers[False] == answers[True] != f"{base_answer}\n"


def test_a_tokenizer_without_a_template_gets_the_one_training_gives_it(tmp_path, capsys):
    tokenizer = presets.build_tokenizer()
    presets.build_model(tokenizer).save_pretrained(tmp_path)
    tokenizer.chat_template = None
    tokenizer.save_pretrained(tmp_path)
    assert main(["chat", str(tmp_path), "--prompt", "hi", "--system", "be brief", "--max-new-tokens", "1",
                 "--show-prompt"]) == 0
    assert "[prompt] '<|system|>be brief<|end|><|user|>hi<|end|><|assistant|>'" in capsys.readouterr().err


def test_a_hub_like_bf16_checkpoint_answers_in_its_own_chat_template(hub_model_dir, capsys):
    """A Qwen2-shaped model stored in bf16 safetensors with a BPE tokenizer and a ChatML template: loaded in the
    dtype it was saved in, prompts rendered by its own template, history kept."""
    assert main(["chat", str(hub_model_dir), "--prompt", "hello there", "--system", "be brief", "--max-new-tokens",
                 "2", "--show-prompt"]) == 0
    err = capsys.readouterr().err
    assert "torch.bfloat16" in err
    assert ("[prompt] '<|im_start|>system\\nbe brief<|im_end|>\\n<|im_start|>user\\nhello there<|im_end|>\\n"
            "<|im_start|>assistant\\n'") in err


def test_chat_help(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["chat", "--help"])
    help_text = capsys.readouterr().out
    assert exit_info.value.code == 0
    assert all(option in help_text for option in ("--prompt", "--system", "--merge-lora", "--max-new-tokens",
                                                  "--temperature", "--top-p", "/reset"))


def one_error_line(capsys) -> str:
    output = capsys.readouterr()
    assert output.out == "" and len(output.err.strip().splitlines()) == 1, output.err
    return output.err.strip()


def test_chat_errors_name_the_path_and_the_fix(tmp_path, capsys):
    missing = tmp_path / "missing"
    assert main(["chat", str(missing), "--prompt", "hi"]) == 2
    assert one_error_line(capsys) == (f"finetune: error: {missing} is not a directory: give a run's output_dir or "
                                      "one of its checkpoint-N folders.")
    assert main(["chat", str(tmp_path), "--prompt", "hi"]) == 2
    error = one_error_line(capsys)
    assert error.startswith(f"finetune: error: {tmp_path} holds no model: expected model.safetensors")
    assert "adapter_config.json" in error
    assert main(["chat", str(tmp_path), "--temperature", "0"]) == 2
    assert "leave it out for greedy decoding" in one_error_line(capsys)



def test_a_reward_model_is_refused_by_chat_eval_and_serve_in_one_line(tmp_path, capsys):
    """What `method: reward` saves: a one-score ...ForSequenceClassification, which scores and has nothing to generate
    with (it ended in `AttributeError: generation_config`)."""
    import transformers
    from hub_fixtures import build_tokenizer

    from finetune.launch.commands import free_port

    tokenizer = build_tokenizer("chatml")
    config = transformers.Qwen2Config(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2, num_labels=1,
                                      pad_token_id=tokenizer.pad_token_id)
    transformers.Qwen2ForSequenceClassification(config).save_pretrained(tmp_path / "reward")
    tokenizer.save_pretrained(tmp_path / "reward")
    reward = tmp_path / "reward"
    for command in (["chat", str(reward), "--prompt", "hi"], ["eval", str(reward), "--tasks", "arc_easy"],
                    ["serve", str(reward), "--port", str(free_port())]):
        assert main(command) == 2, command
        output = capsys.readouterr()
        assert "Traceback" not in output.err
        assert output.err.strip().splitlines()[-1] == (
            f"finetune: error: {reward} is a reward model (Qwen2ForSequenceClassification, a reward model or "
            "classifier): it scores text, it does not generate, so it cannot chat, be evaluated on answers or be "
            f"served. Use it to score a GRPO run's completions (`reward_funcs: [{reward}]`), or `finetune export` it "
            "as safetensors.")


def test_a_missing_base_model_folder_is_named(tmp_path, capsys):
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": "tiny", "peft_type": "LORA"}))
    missing = tmp_path / "bases" / "missing"
    assert main(["chat", str(adapter), "--base-model", str(missing), "--prompt", "hi"]) == 2
    assert one_error_line(capsys) == (f"finetune: error: `--base-model: {missing}`: no such directory; give the folder "
                                      "holding config.json (as save_pretrained writes it), or a hub id such as "
                                      "`Qwen/Qwen2.5-0.5B`.")
