"""`finetune eval` (lm-evaluation-harness) and `eval_harness_tasks:` at the end of training: the synthetic tasks scored
through lm-eval agree with the toolkit's own exact match, a user's JSONL and a user's lm-eval YAML task run offline, a
LoRA run and ZeRO-3 shards are scored without an export by hand, bad input stops in one line, an evaluation writes
only what is its own and removes only that, and a task file's templates run no code."""

import json
import shutil

import pytest

from finetune.cli import main
from finetune.presets import synthetic_data_dir

SYNTHETIC = ["synthetic_add", "synthetic_reverse", "synthetic_sort"]


def synthetic_rows(task: str, count: int) -> list[dict]:
    rows = [json.loads(line) for line in (synthetic_data_dir() / "eval.jsonl").read_text().splitlines()]
    return [row for row in rows if row["task"] == task][:count]


def user_conversations() -> list[dict]:
    """Reverse prompts as a user writes them (`messages`), every other one after an earlier exchange: the history is
    rendered by the chat template as training renders it."""
    rows = []
    for index, row in enumerate(synthetic_rows("reverse", 40)):
        turns = [{"role": "user", "content": f"reverse\n\n{row['input']}"},
                 {"role": "assistant", "content": row["output"]}]
        if index % 2:
            turns = [{"role": "user", "content": "sort\n\nbca"}, {"role": "assistant", "content": "abc"}, *turns]
        rows.append({"messages": turns})
    return rows


def write_jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def lm_eval_yaml_task(folder) -> str:
    """A task of the user's own, as lm-eval writes one: lm-eval applies the chat template itself."""
    rows = [{"question": f"reverse\n\n{row['input']}", "answer": row["output"]}
            for row in synthetic_rows("reverse", 40)]
    data = write_jsonl(folder / "rows.jsonl", rows)
    (folder / "my_reverse.yaml").write_text(
        "task: my_reverse\ndataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {data}\n"
        "test_split: test\noutput_type: generate_until\n"
        "doc_to_text: '{{question}}'\ndoc_to_target: '{{answer}}'\n"
        "generation_kwargs:\n  until: ['<|end|>']\n  do_sample: false\n  max_gen_toks: 8\n"
        "metric_list:\n  - metric: exact_match\n    aggregation: mean\n    higher_is_better: true\n"
        "metadata:\n  version: 1.0\n")
    return str(folder)


def test_synthetic_tasks_score_through_lm_eval_as_the_run_scored_them(trained_demo, tmp_path, capsys):
    """One load of the demo model: the embedded tasks (lm-eval's exact_match equals the run's own, per task, on the
    same 300 prompts), a user's JSONL of conversations (equal to the toolkit's exact match on the same rows), a user's
    lm-eval YAML task (lm-eval renders the template: the same score as ours on the same prompts), and the base."""
    from finetune.train.evaluation import exact_match
    from finetune.train.trained_model import load_with_tokenizer

    tasks = tmp_path / "tasks"
    tasks.mkdir()
    mine = write_jsonl(tmp_path / "my_conversations.jsonl", user_conversations())
    results = tmp_path / "results.json"
    assert main(["eval", str(trained_demo), "--tasks", "synthetic", mine, "my_reverse", "--include-path",
                 lm_eval_yaml_task(tasks), "--compare-base", "--output", str(results)]) == 0
    shown = capsys.readouterr().out
    record = json.loads(results.read_text())

    trained = json.loads((trained_demo / "eval_results.json").read_text())["after"]["exact_match"]
    assert {name: record["scores"][name]["exact_match"] for name in SYNTHETIC} == \
        {f"synthetic_{task}": value for task, value in trained.items()}  # e.g. add 0.12, reverse 0.98, sort 0.82
    assert record["max_new_tokens"] == 8  # the run's generation_max_new_tokens, from its effective config
    assert record["base_model"] == "tiny" and all(record["before"][name]["exact_match"] == 0 for name in SYNTHETIC)
    change = f"+{record['scores']['synthetic_reverse']['exact_match']:.4f}"  # from 0 before: e.g. +0.9800
    assert "synthetic_reverse" in shown and change in shown  # before → after, with the change

    model, tokenizer = load_with_tokenizer(trained_demo)
    examples = [{"prompt": row["messages"][:-1], "reference": row["messages"][-1]["content"], "task": "mine"}
                for row in user_conversations()]
    ours = exact_match(model, tokenizer, examples, max_new_tokens=8)["per_task"]["mine"]
    assert record["scores"]["my_conversations"]["exact_match"] == pytest.approx(ours)
    assert ours >= 0.45  # measured 0.5: the single-turn prompts answered, those after an earlier exchange mostly not
    by_lm_eval = [row["answer"] for row in answers(results, "my_reverse")]  # lm-eval rendered the template
    assert by_lm_eval == [row["answer"] for row in answers(results, "synthetic_reverse")[:40]]

    rendered = [row["doc"]["prompt"] for row in answers(results, "my_conversations")]
    assert sum("sort\n\nbca" in prompt for prompt in rendered) == 20  # the earlier turns went in
    assert rendered[0] == tokenizer.apply_chat_template(examples[0]["prompt"], tokenize=False,
                                                        add_generation_prompt=True)


def answers(results, task: str) -> list[dict]:
    """lm-eval's answers kept beside the results, in the order of the task's rows."""
    rows = [json.loads(line) for line in (results.with_suffix("") / f"{task}.answers.jsonl").read_text().splitlines()]
    return rows


@pytest.mark.distributed
def test_a_lora_run_and_zero3_shards_score_without_an_export_by_hand(lora_runs, deepspeed_runs, tmp_path, capsys):
    """The shards of a ZeRO-3 checkpoint give the answers the weights DeepSpeed gathered at the same step give; a
    LoRA run (adapter on the `tiny` base rebuilt from the run's seed) gives its merged export's answers, and its
    results go beside it, one new file an evaluation."""
    output_dir = deepspeed_runs["zero3"]["output_dir"]
    checkpoint = tmp_path / "run" / "checkpoint-3"  # results go outside the run it belongs to
    shutil.copytree(output_dir / "checkpoint-3", checkpoint)
    (checkpoint / "model.safetensors").unlink()  # leave only the ZeRO shards
    scored = {}
    for name, source in (("shards", checkpoint), ("gathered", output_dir / "checkpoint-3")):
        results = tmp_path / f"{name}.json"
        assert main(["eval", str(source), "--tasks", "synthetic_sort", "--limit", "20", "--max-new-tokens", "8",
                     "--output", str(results)]) == 0
        scored[name] = [row["answer"] for row in answers(results, "synthetic_sort")]
    assert scored["shards"] == scored["gathered"] and len(scored["shards"]) == 20

    lora = tmp_path / "lora"
    shutil.copytree(lora_runs["zero3"], lora)
    assert main(["export", str(lora), str(tmp_path / "merged"), "--merge-lora"]) == 0
    for _ in range(2):
        assert main(["eval", str(lora), "--tasks", "synthetic_reverse", "--limit", "20"]) == 0
    kept = sorted((lora / "eval_harness").glob("results_*.json"))
    assert len(kept) == 2  # the second evaluation did not overwrite the first
    merged_results = tmp_path / "merged_scores.json"  # merged.json's answers folder would be the model's own folder
    assert main(["eval", str(tmp_path / "merged"), "--tasks", "synthetic_reverse", "--limit", "20", "--output",
                 str(merged_results)]) == 0
    lora_answers = [row["answer"] for row in answers(kept[0], "synthetic_reverse")]
    assert lora_answers == [row["answer"] for row in answers(merged_results, "synthetic_reverse")]
    assert json.loads(kept[0].read_text())["scores"]["synthetic_reverse"]["exact_match"] is not None


@pytest.mark.distributed
def test_eval_harness_tasks_score_the_final_model_when_training_ends(deepspeed_runs):
    """`--eval_harness_tasks synthetic_add` on the self-launched 2-process ZeRO-3 run (tests/conftest.py): rank 0
    alone scores the saved model once training ended, and keeps the results beside it."""
    run = deepspeed_runs["zero3"]
    kept = list((run["output_dir"] / "eval_harness").glob("results_*.json"))
    assert len(kept) == 1
    record = json.loads(kept[0].read_text())
    assert record["model"] == str(run["output_dir"]) and set(record["scores"]) == {"synthetic_add"}
    assert 0 <= record["scores"]["synthetic_add"]["exact_match"] <= 1
    assert len(answers(kept[0], "synthetic_add")) == 100
    assert run["output"].count("lm-eval: ") == 1  # one table: rank 0's


def test_a_model_no_gpu_holds_alone_is_spread_over_the_gpus_and_one_they_cannot_hold_is_refused(monkeypatch,
                                                                                                  capsys):
    """Where an evaluation puts the model, on 8 simulated GPUs: the first GPU when the weights fit its free memory
    (less room for a batch), else spread layer by layer over as many as hold it (Accelerate's big-model dispatch),
    else refused by size. A 16-layer model a few MB large stands in for a 70B on 80 GB GPUs."""
    import accelerate
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from finetune.errors import RecipeError
    from finetune.train.harness import EVALUATION_WEIGHT_SHARE, placed_for_evaluation

    model = LlamaForCausalLM(LlamaConfig(vocab_size=600, hidden_size=64, intermediate_size=256, num_hidden_layers=16,
                                         num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=False))
    need = sum(tensor.numel() * tensor.element_size() for tensor in (*model.parameters(), *model.buffers()))
    dispatched, moved = [], []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setattr(accelerate, "dispatch_model", lambda model, device_map: dispatched.append(device_map) or model)
    monkeypatch.setattr(type(model), "to", lambda self, device: moved.append(device) or self)
    for free_per_gpu, expected in ((2 * need, "whole"), (need / 3, "spread"), (need / 10, "refused")):
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device, free=free_per_gpu: (int(free), 80 * 1024**3))
        dispatched.clear(), moved.clear()
        if expected == "refused":
            with pytest.raises(RecipeError, match=r"more than the 8 GPU\(s\) here leave for them"):
                placed_for_evaluation(model)
            assert not dispatched and not moved  # nothing was moved before the refusal
            continue
        placed_for_evaluation(model)
        if expected == "whole":
            assert moved == ["cuda:0"] and not dispatched
            continue
        (device_map,) = dispatched
        used = sorted(set(device_map.values()))
        share = EVALUATION_WEIGHT_SHARE * need / 3
        assert 4 <= len(used) <= 8 and used == list(range(len(used))), device_map  # 3 GPUs' worth, layers whole
        held = {device: 0 for device in used}
        for name, device in device_map.items():
            module = model.get_submodule(name) if name else model
            held[device] += sum(p.numel() * p.element_size() for p in (*module.parameters(), *module.buffers()))
        assert max(held.values()) <= share + 1, (held, share)  # no GPU given more than its room
        assert "is spread over" in capsys.readouterr().err


def test_eval_help_and_errors(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["eval", "--help"])
    assert exit_info.value.code == 0 and "--compare-base" in capsys.readouterr().out
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a", "completion": "b"}\n{"prompt": \n')
    text_only = write_jsonl(tmp_path / "notes.jsonl", [{"text": "no answer here"}])
    no_answer = write_jsonl(tmp_path / "open.jsonl", [{"messages": [{"role": "user", "content": "hi"}]}])
    mixed = write_jsonl(tmp_path / "mixed.jsonl", [{"prompt": "a", "completion": "b"}, {"question": "c"}])
    cases = {
        str(bad): f"{bad}:2: Expecting value",
        text_only: "a `text` row has no answer to score",
        no_answer: "has no assistant answer in text to score against",
        mixed: "mixed.jsonl:2: not a prompt_completion row like the first (KeyError",
        str(tmp_path / "missing.jsonl"): "does not exist",
    }
    for task, message in cases.items():
        assert main(["eval", str(tmp_path), "--tasks", task]) == 2
        assert message in capsys.readouterr().err
    assert main(["eval", str(tmp_path), "--tasks", "my_revrse", "--include-path", lm_eval_yaml_task(tmp_path)]) == 2
    assert "lm-eval knows no task `my_revrse` (did you mean `my_reverse`?)" in capsys.readouterr().err
    assert main(["eval", str(tmp_path), "--tasks", "synthetic", "--limit", "0"]) == 2
    assert "--limit 0: give 1 or more" in capsys.readouterr().err
    assert main(["eval", str(tmp_path), "--tasks", "synthetic", "--include-path", str(tmp_path / "none")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["eval", str(tmp_path), "--tasks", "synthetic"]) == 2  # no model there
    assert "holds no model" in capsys.readouterr().err
    assert not (tmp_path / "eval_harness").exists()


@pytest.fixture(scope="module")
def untrained_run(tmp_path_factory):
    """The `tiny` model saved as a run saves it, untrained: something to load and score where the score does not
    matter (what an evaluation writes, and where)."""
    from finetune import presets

    folder = tmp_path_factory.mktemp("untrained") / "run"
    tokenizer = presets.build_tokenizer()
    presets.build_model(tokenizer, seed=0).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def test_output_is_refused_before_the_model_loads_where_it_would_replace_or_delete(tmp_path, capsys, monkeypatch):
    """`--output RUN.json` made the run its answers folder and a failed scoring deleted the run; `results.json` beside
    the user's own results/ deleted that folder; `RUN/eval_results.json` replaced training's record; a folder ended
    in IsADirectoryError after the whole evaluation. Each is refused by name before any model is loaded."""
    import finetune.train.trained_model

    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded before --output was checked")

    monkeypatch.setattr(finetune.train.trained_model, "load_with_tokenizer", no_load)
    run = tmp_path / "run"
    run.mkdir()
    (run / "model.safetensors").write_text("weights")
    (run / "eval_results.json").write_text("training's before/after")
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "mine.txt").write_text("the user's")
    (tmp_path / "myresults").mkdir()
    cases = {
        f"{run}.json": f"its answers would go in {run}, which already holds other files",
        str(tmp_path / "results.json"): "its answers would go in",
        str(run / "eval_results.json"): "eval_results.json already exists: an evaluation replaces no file",
        str(run / "scores.json"): f"is inside the run {run}: an evaluation writes there only under eval_harness/",
        str(tmp_path / "myresults"): "myresults is a folder: name the results file, e.g.",
        str(tmp_path / "scores.txt"): "name a .json file",
    }
    for output, message in cases.items():
        assert main(["eval", str(run), "--tasks", "synthetic_add", "--output", output]) == 2
        error = capsys.readouterr().err
        assert message in error and len(error.strip().splitlines()) == 1, error
    assert sorted(path.name for path in run.iterdir()) == ["eval_results.json", "model.safetensors"]
    assert (run / "eval_results.json").read_text() == "training's before/after"
    assert (tmp_path / "results" / "mine.txt").read_text() == "the user's"
    assert not any((tmp_path / "myresults").iterdir())


def test_a_failed_evaluation_removes_what_it_wrote_and_nothing_else(untrained_run, tmp_path, capfd, monkeypatch):
    """A bad --compare-base fails after the model was scored: the task files and folders the evaluation made are
    removed, the empty answers folder that was there before stays; from outside a git repository lm-eval's record of
    a commit leaves no `fatal: not a git repository` on the console."""
    monkeypatch.chdir(tmp_path)  # not a git repository
    (tmp_path / "results").mkdir()
    outputs = {"results.json": tmp_path / "results", "new/deeper/results.json": tmp_path / "new"}
    for output in outputs:
        assert main(["eval", str(untrained_run), "--tasks", "synthetic_add", "--limit", "1", "--max-new-tokens", "1",
                     "--compare-base", str(tmp_path / "no_model"), "--output", output]) == 2
    assert (tmp_path / "results").is_dir() and not any((tmp_path / "results").iterdir())  # there before: kept
    assert not (tmp_path / "new").exists()  # made by the evaluation: removed
    assert not (tmp_path / "results.json").exists()
    assert not (untrained_run / "eval_harness").exists()
    error = capfd.readouterr().err
    assert error.count("--compare-base") == 2 and "fatal:" not in error, error


def test_a_task_template_runs_no_code(untrained_run, tmp_path, capsys):
    """lm-eval renders a task's Jinja fields; here in Jinja's sandbox, so a YAML file alone cannot reach `os` through
    a template's globals. The sandbox keeps lm-eval's filters, and lm-eval's own environment comes back after."""
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    data = write_jsonl(tasks / "rows.jsonl", [{"question": "abc", "answer": "cba"}])
    escaped = tmp_path / "escaped"
    (tasks / "payload.yaml").write_text(
        f"task: payload\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\ntest_split: test\n"
        "output_type: generate_until\n"
        f"doc_to_text: \"{{{{ cycler.__init__.__globals__.os.system('touch {escaped}') }}}}{{{{question}}}}\"\n"
        "doc_to_target: '{{answer}}'\ngeneration_kwargs:\n  until: ['x']\n  max_gen_toks: 1\n"
        "metric_list:\n  - metric: exact_match\n    aggregation: mean\n    higher_is_better: true\n"
        "metadata:\n  version: 1.0\n")
    output = tmp_path / "scores.json"
    assert main(["eval", str(untrained_run), "--tasks", "payload", "--include-path", str(tasks), "--output",
                 str(output)]) == 2
    assert not escaped.exists()
    assert "a template of payload reaches outside its data (access to attribute '__init__'" in capsys.readouterr().err
    assert not output.exists() and not (tmp_path / "scores").exists()

    import lm_eval.utils

    from finetune.train.harness import lm_eval_guarded

    original = lm_eval.utils.env
    with lm_eval_guarded():
        assert lm_eval.utils.apply_template("{{ q | regex_replace('b', 'x') }}\n", {"q": "abc"}) == "axc\n"
    assert lm_eval.utils.env is original


def test_task_files_that_run_python_are_named_as_code(tmp_path, capsys):
    """A `!function` in a task file imports Python when lm-eval builds the task: one line names the file before
    anything runs; a task file without one gets no notice."""
    plain = tmp_path / "plain"
    plain.mkdir()
    lm_eval_yaml_task(plain)
    assert main(["eval", str(tmp_path), "--tasks", "my_reverse", "--include-path", str(plain)]) == 2
    assert "note:" not in capsys.readouterr().err
    coded = tmp_path / "coded"
    shutil.copytree(plain, coded)
    yaml = coded / "my_reverse.yaml"
    yaml.write_text(yaml.read_text() + "process_docs: !function helpers.keep\n")
    (coded / "helpers.py").write_text("def keep(dataset):\n    return dataset\n")
    assert main(["eval", str(tmp_path), "--tasks", "my_reverse", "--include-path", str(coded)]) == 2
    error = capsys.readouterr().err.splitlines()
    assert error[0] == f"note: --include-path {coded}: {yaml} runs Python (`!function`): a task file is code, like a " \
        "script; use only task files you trust."
    assert "holds no model" in error[-1]  # the notice came first; nothing was imported or loaded
