"""Faults and silent cases a user meets (issue: nothing silent, nothing lost): each stops with one line naming the
key, file or fault, or is skipped by name, instead of a traceback or a quiet default."""

import json

import pytest
from support import PROJECT_ROOT

from finetune import outputs
from finetune.checkpoints.complete import (
    COMPLETE_MARKER,
    is_complete,
    mark_complete,
    newest_complete_checkpoint,
    rotate_complete_checkpoints,
    why_incomplete,
)
from finetune.data.tokenize import IGNORE_INDEX, encode_conversation
from finetune.errors import RecipeError
from finetune.presets import build_tokenizer
from finetune.recipe.parse import load_recipe_file, parse_recipe, read_recipe

DEMO = PROJECT_ROOT / "recipes" / "demo.yaml"


def test_a_key_given_twice_in_a_recipe_is_refused_with_both_lines(tmp_path):
    recipe = tmp_path / "twice.yaml"
    recipe.write_text("model_name_or_path: tiny\nlearning_rate: 1e-3\nmax_steps: 5\nlearning_rate: 2e-3\n")
    with pytest.raises(RecipeError, match=r"key `learning_rate` is given twice \(lines 2 and 4\); keep one"):
        load_recipe_file(recipe)


@pytest.mark.parametrize("text", ["", "# only a comment\n"])
def test_an_empty_recipe_is_refused_rather_than_trained_on_defaults(tmp_path, text):
    recipe = tmp_path / "empty.yaml"
    recipe.write_text(text)
    with pytest.raises(RecipeError, match=r"recipe `.*empty\.yaml` is empty: it would train on every default"):
        parse_recipe(recipe, [])


def test_max_steps_zero_is_refused():
    with pytest.raises(RecipeError, match=r"`max_steps: 0` trains nothing"):
        parse_recipe(DEMO, ["--max_steps", "0"])


def test_accumulation_on_the_command_line_that_contradicts_the_global_batch_is_refused_naming_both():
    with pytest.raises(RecipeError, match=r"`gradient_accumulation_steps: 8` \(command line\) contradicts "
                                          r"`global_batch_size: 32`, planned as 16 × 1 process\(es\) × 2: drop one"):
        parse_recipe(DEMO, ["--global_batch_size", "32", "--gradient_accumulation_steps", "8"])
    recipe = parse_recipe(DEMO, ["--global_batch_size", "32", "--gradient_accumulation_steps", "2"])  # agrees
    assert recipe.training.gradient_accumulation_steps == 2


def test_accumulation_from_the_recipe_file_that_the_global_batch_replans_is_a_named_warning(capsys):
    recipe = parse_recipe(DEMO, ["--global_batch_size", "32"])  # demo.yaml: gradient_accumulation_steps: 1
    assert recipe.training.gradient_accumulation_steps == 2
    assert "warning: `gradient_accumulation_steps: 1` (recipe" in capsys.readouterr().out


def test_answers_that_are_all_empty_are_not_learned():
    tokenizer = build_tokenizer()
    _, labels = encode_conversation([{"role": "user", "content": "reverse abc"},
                                     {"role": "assistant", "content": ""}], tokenizer)
    assert all(label == IGNORE_INDEX for label in labels)  # dropped as unlabeled by the data policy


def test_answers_that_are_all_empty_leave_nothing_to_train_and_stop_naming_the_data(tmp_path):
    from finetune.data import load_raw_data, prepare_datasets

    data = tmp_path / "empty_answers.jsonl"
    data.write_text("".join(json.dumps({"instruction": f"say {i}", "output": ""}) + "\n" for i in range(4)))
    recipe = parse_recipe(DEMO, ["--train_file", str(data), "--output_dir", str(tmp_path / "out")])
    with pytest.raises(RecipeError, match=r"no training example .* is left after the data policies "
                                          r"\(\{'no_answer_tokens': 4\}\)"):
        prepare_datasets(load_raw_data(recipe.data), build_tokenizer(), recipe.data, recipe.training)


def checkpoint(output_dir, step: int, marker: str | None) -> object:
    folder = output_dir / f"checkpoint-{step}"
    folder.mkdir(parents=True)
    (folder / "trainer_state.json").write_text("{}")
    if marker is not None:
        (folder / COMPLETE_MARKER).write_text(marker)
    return folder


@pytest.mark.parametrize("damaged", ['{"step": 6, "strat', "", "[6]", "\xff\xfe"])
def test_a_damaged_marker_is_skipped_like_an_incomplete_checkpoint_naming_the_file(tmp_path, damaged):
    earlier = checkpoint(tmp_path, 3, json.dumps({"step": 3}))
    newest = checkpoint(tmp_path, 6, damaged)
    assert is_complete(earlier) and not is_complete(newest)
    assert newest_complete_checkpoint(tmp_path) == (earlier, [newest])
    assert why_incomplete(newest) == f"its marker {newest / COMPLETE_MARKER} is damaged (not the record a finished " \
                                     "save writes)"
    assert rotate_complete_checkpoints(tmp_path, 1) == []  # the damaged one is not counted, nor deleted
    assert newest.is_dir() and earlier.is_dir()


def test_markers_and_records_are_written_atomically(tmp_path, monkeypatch):
    folder = checkpoint(tmp_path, 3, None)
    mark_complete(folder, 3, {"strategy": "ddp"}, {})
    assert is_complete(folder) and [p.name for p in folder.iterdir() if p.name.endswith(".tmp")] == []
    outputs.write_record(tmp_path, "record.json", {"old": True})

    def fail(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("os.replace", fail)  # a write that fails leaves the previous record whole, and no temp file
    with pytest.raises(OSError):
        outputs.write_record(tmp_path, "record.json", {"new": True})
    assert json.loads((tmp_path / "record.json").read_text()) == {"old": True}
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []


@pytest.mark.parametrize("text, message", [
    ("learning_rate: [1, 2]\n", r"`learning_rate` in recipe `.*` is a list \(\[1, 2\]\); it takes one float\."),
    ("bf16: {a: 1}\n", r"`bf16` in recipe `.*` is a mapping .*; it takes one true/false\."),
])
def test_a_structure_where_one_value_belongs_names_the_key(tmp_path, text, message):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("model_name_or_path: tiny\n" + text)
    with pytest.raises(RecipeError, match=message):
        parse_recipe(recipe, [])


@pytest.mark.parametrize("override, message", [
    (["--per_device_train_batch_size", "0"], r"^`per_device_train_batch_size` must be a positive whole number, got 0"),
    (["--learning_rate", "-1"], r"^`learning_rate` must be positive, got -1\.0"),
])
def test_batch_errors_name_the_key_the_user_set(override, message):
    with pytest.raises(RecipeError, match=message):
        parse_recipe(DEMO, override)


def test_an_output_dir_that_is_a_file_or_unwritable_stops_before_any_work(tmp_path, monkeypatch):
    a_file = tmp_path / "notes.txt"
    a_file.write_text("x")
    for output_dir in (a_file, a_file / "run"):
        with pytest.raises(RecipeError, match=rf"`output_dir: {output_dir}`: {a_file} is a file, not a directory"):
            parse_recipe(DEMO, ["--output_dir", str(output_dir)])
    monkeypatch.setattr("os.access", lambda path, mode: False)  # a read-only place (root may write anywhere here)
    with pytest.raises(RecipeError, match=r"is not writable by this user; choose a writable output_dir"):
        parse_recipe(DEMO, ["--output_dir", str(tmp_path / "run")])


def test_custom_model_code_without_trust_remote_code_is_refused_in_one_line(hub_model_dir, tmp_path):
    import shutil

    from finetune.models.loading import load_model, load_tokenizer
    from finetune.recipe.args import ModelArguments

    custom = shutil.copytree(hub_model_dir, tmp_path / "custom")
    config = json.loads((custom / "config.json").read_text())
    config.update(model_type="x_custom", auto_map={"AutoConfig": "configuration_x.XConfig",
                                                   "AutoModelForCausalLM": "modeling_x.XForCausalLM"})
    (custom / "config.json").write_text(json.dumps(config))
    with pytest.raises(RecipeError, match=rf"^`{custom}` ships its own model code, which runs only with "
                                          r"`trust_remote_code: true`"):
        model_args = ModelArguments(model_name_or_path=str(custom))
        load_model(model_args, load_tokenizer(model_args))


def test_a_global_batch_that_follows_the_process_count_is_a_warning_with_the_numbers(capsys):
    from finetune.recipe.batch_plan import plan_from_recipe
    from finetune.recipe.parse import _check_steps_and_accumulation

    demo = {"per_device_train_batch_size": 16, "gradient_accumulation_steps": 1, "learning_rate": 2e-3}
    _check_steps_and_accumulation(demo, {}, plan_from_recipe(demo, 64, world_size=3))
    assert ("warning: the global batch is 48 sequences (16 per device × 3 processes × 1 accumulation) and follows the "
            "process count (16 on 1 process, 64 on 4); set `global_batch_size: 48`") in capsys.readouterr().out
    for training, world_size in (({**demo, "global_batch_size": 48}, 3), (demo, 1)):  # held, or nothing to follow
        _check_steps_and_accumulation(training, {}, plan_from_recipe(training, 64, world_size=world_size))
        assert "follows the process count" not in capsys.readouterr().out


def test_a_deepspeed_json_with_a_syntax_error_is_named_with_its_line(tmp_path):
    broken = tmp_path / "zero2.json"
    broken.write_text('{"zero_optimization": {"stage": 2,}}')
    with pytest.raises(RecipeError, match=rf"the DeepSpeed config `{broken}` is not valid JSON: .*line 1 column 35"):
        parse_recipe(DEMO, ["--deepspeed", str(broken)])


def test_warmup_longer_than_the_run_is_a_named_warning_with_the_numbers(capsys):
    parse_recipe(DEMO, ["--max_steps", "20"])  # demo.yaml: warmup_steps: 30
    out = capsys.readouterr().out
    assert ("warning: the warmup (30 steps, `warmup_steps: 30`) is as long as the run or longer (20 steps): the "
            "learning rate never reaches `learning_rate: 0.002`") in out
    parse_recipe(DEMO, ["--max_steps", "20", "--warmup_steps", "0.5"])  # a fraction: 10 of 20 steps
    assert "never reaches" not in capsys.readouterr().out


def test_warmup_longer_than_an_epoch_run_is_named_when_the_steps_are_known(capsys):
    from types import SimpleNamespace

    from finetune.train.effective import warn_about_warmup

    args = SimpleNamespace(warmup_steps=30, learning_rate=2e-3, max_steps=-1)
    warn_about_warmup(args, SimpleNamespace(max_steps=12, is_world_process_zero=True))
    assert "the warmup (30 steps, `warmup_steps: 30`) is as long as the run or longer (12 steps" in \
        capsys.readouterr().out


@pytest.mark.parametrize("launcher, recipe", [("fp16", "bf16"), ("bf16", "fp16")])
def test_an_accelerate_mixed_precision_that_contradicts_the_recipe_is_refused_naming_both(monkeypatch, launcher,
                                                                                           recipe):
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", launcher)
    with pytest.raises(RecipeError, match=rf"the Accelerate config's `mixed_precision: {launcher}` contradicts the "
                                          rf"recipe's `{recipe}: true` \(command line\)"):
        parse_recipe(DEMO, [f"--{recipe}", "true"])
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", recipe)  # agreeing, or the launcher alone: as before
    assert parse_recipe(DEMO, [f"--{recipe}", "true"]).training.mixed_precision == recipe
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", launcher)
    assert parse_recipe(DEMO, []).training.mixed_precision == launcher


def one_line_file(tmp_path, name: str, data: bytes):
    path = tmp_path / name
    path.write_bytes(data)
    return path


def test_an_eval_strategy_without_an_eval_split_is_refused_naming_the_key(tmp_path):
    from finetune.train.run import train

    data = one_line_file(tmp_path, "train.jsonl", b"".join(
        json.dumps({"instruction": f"say {i}", "output": str(i)}).encode() + b"\n" for i in range(8)))
    recipe = parse_recipe(DEMO, ["--train_file", str(data), "--eval_strategy", "epoch", "--max_steps", "1",
                                 "--output_dir", str(tmp_path / "out")])
    with pytest.raises(RecipeError, match=r"^`eval_strategy: epoch` evaluates, but the data have no eval split: give "
                                          r"`eval_file` or `eval_split_ratio`, or set `eval_strategy: no`"):
        train(recipe)


def test_a_null_where_a_value_belongs_keeps_the_default_and_says_so(tmp_path, capsys):
    """YAML's null (`key:` with nothing after it) is "unset", as TRL, axolotl and LLaMA-Factory configs write it."""
    recipe = tmp_path / "null.yaml"
    recipe.write_text("model_name_or_path: tiny\ntorch_dtype: null\nlearning_rate:\n")
    sections = read_recipe(recipe, [])
    assert sections.model.torch_dtype == "auto" and sections.training_inputs["learning_rate"] == 5e-05
    note = capsys.readouterr().out
    assert "`torch_dtype: null` (unset: the default, auto)" in note and "`learning_rate: null` (unset" in note

def test_non_utf8_bytes_in_the_recipe_are_named_with_their_line(tmp_path):
    recipe = one_line_file(tmp_path, "latin1.yaml", b"model_name_or_path: tiny\nmax_steps: 2\n# caf\xe9\n")
    with pytest.raises(RecipeError, match=rf"^recipe `{recipe}` is not UTF-8 text \(byte 0xe9 on line 3\): save it as "
                                          "UTF-8"):
        parse_recipe(recipe, [])


def load_data(tmp_path, data, *overrides):
    from finetune.data import load_raw_data, prepare_datasets

    recipe = parse_recipe(DEMO, ["--train_file", str(data), "--output_dir", str(tmp_path / "out"), *overrides])
    return prepare_datasets(load_raw_data(recipe.data), build_tokenizer(), recipe.data, recipe.training)


def test_non_utf8_bytes_in_a_data_line_are_named_with_the_file_and_line(tmp_path):
    data = one_line_file(tmp_path, "latin1.jsonl", b'{"instruction": "say a", "output": "a"}\n'
                                                   b'{"instruction": "say \xff", "output": "x"}\n')
    with pytest.raises(RecipeError, match=rf"^{data}:2: not UTF-8 text \(byte 0xff\); save the file as UTF-8"):
        load_data(tmp_path, data)


def test_a_conversation_that_opens_with_the_assistant_is_named(tmp_path):
    data = one_line_file(tmp_path, "chat.jsonl", json.dumps({"messages": [
        {"role": "assistant", "content": "hello"}, {"role": "user", "content": "x"},
        {"role": "assistant", "content": "y"}]}).encode() + b"\n")
    with pytest.raises(RecipeError, match=r"^train example 1: the conversation opens with an assistant turn; it must "
                                          r"open with a user turn \(after an optional system turn\)"):
        load_data(tmp_path, data)


def test_an_unknown_role_is_named_not_reported_as_missing_answer_tokens(tmp_path):
    data = one_line_file(tmp_path, "chat.jsonl", json.dumps({"messages": [
        {"role": "user", "content": "hi"}, {"role": "robot", "content": "y"}]}).encode() + b"\n")
    with pytest.raises(RecipeError, match=r"^train example 1: a message has `role: robot`; expected one of system, "
                                          r"developer, user, assistant, tool"):
        load_data(tmp_path, data)


def test_a_one_row_dataset_cannot_be_split_for_eval_and_says_so(tmp_path):
    data = one_line_file(tmp_path, "one.jsonl", b'{"instruction": "a", "output": "b"}\n')
    with pytest.raises(RecipeError, match=rf"^`eval_split_ratio: 0.2` cannot split the 1 example\(s\) of {data} into a "
                                          r"train and an eval part"):
        load_data(tmp_path, data, "--eval_split_ratio", "0.2")


@pytest.mark.parametrize("content", [b"", b"\n\n"])
def test_an_empty_data_file_is_named_as_empty(tmp_path, content):
    data = one_line_file(tmp_path, "empty.jsonl", content)
    with pytest.raises(RecipeError, match=rf"^`train_file: {data}` is empty: it holds no examples"):
        load_data(tmp_path, data)


@pytest.mark.parametrize("path", ["./no/such/model", "~/no-such-model", "/no/such/model", "runs/qwen/final"])
def test_a_local_model_path_that_does_not_exist_is_named_as_a_missing_directory(path):
    from finetune.models.loading import load_tokenizer
    from finetune.recipe.args import ModelArguments

    with pytest.raises(RecipeError, match=rf"^`model_name_or_path: {path}`: no such directory"):
        load_tokenizer(ModelArguments(model_name_or_path=path))


def refused_write(kind: str) -> BaseException:
    import errno

    from safetensors import SafetensorError

    return {"permissions": PermissionError(errno.EACCES, "Permission denied"),
            "immutable": PermissionError(errno.EPERM, "Operation not permitted"),
            "read-only": OSError(errno.EROFS, "Read-only file system"),
            "safetensors": SafetensorError("Error while serializing: I/O error: Permission denied (os error 13)")}[kind]


@pytest.mark.parametrize("kind, reason", [
    ("permissions", "permission denied"), ("immutable", "operation not permitted"),
    ("read-only", "read-only file system"), ("safetensors", "permission denied"),
])
def test_a_folder_that_refuses_a_save_is_one_line_naming_it_and_the_previous_checkpoint_stays(tmp_path, kind, reason):
    from finetune.checkpoints.disk import saving_within_free_space

    kept = checkpoint(tmp_path, 2, None)
    mark_complete(kept, 2, {"strategy": "ddp", "world_size": 1}, {})
    folder = tmp_path / "checkpoint-4"
    with pytest.raises(RecipeError, match=rf"^cannot save checkpoint in {folder}: {reason} \(the folder or its file "
                                          rf"system stopped accepting files\).* the newest complete checkpoint, "
                                          rf"{kept}, is untouched") as stopped:
        with saving_within_free_space(folder, needed_bytes=0):
            folder.mkdir()
            raise refused_write(kind)
    assert stopped.value.__suppress_context__ and not folder.exists()
    assert is_complete(kept) and (kept / "trainer_state.json").read_text() == "{}"


def test_a_refused_write_outside_a_save_is_one_line_naming_the_file(monkeypatch, capsys):
    import errno

    from finetune.cli import main

    def refusing(*args):
        raise PermissionError(errno.EACCES, "Permission denied", "/runs/out/eval_results.json")

    monkeypatch.setattr("finetune.train.run.train_command", refusing)
    assert main(["train", str(DEMO)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("finetune: error: the file system refused /runs/out/eval_results.json: permission denied")
    assert len(err.strip().splitlines()) == 1


@pytest.fixture
def unwritable_folder():
    """Makes a folder refuse new files, as `chmod a-w` does for a user; root ignores modes, so there the folder is made
    immutable (`chattr +i`, EPERM). Restored afterwards, so that the test's folder can be removed."""
    import os
    import subprocess

    made = []

    def make(folder):
        folder.mkdir(parents=True)
        if os.geteuid() != 0:
            folder.chmod(0o555)
        elif subprocess.run(["chattr", "+i", str(folder)], capture_output=True).returncode != 0:
            pytest.skip("running as root where `chattr +i` is unavailable: no way to make a folder refuse files")
        made.append(folder)
        return folder

    yield make
    for folder in made:
        if os.geteuid() == 0:
            subprocess.run(["chattr", "-i", str(folder)], check=False)
        folder.chmod(0o755)


def test_an_output_folder_that_stops_accepting_files_mid_run_stops_in_one_line_keeping_the_checkpoint(
        tmp_path, unwritable_folder):
    from support import DEMO_SHORT_RUN, finetune_command, run

    output_dir = tmp_path / "run"
    refusing = unwritable_folder(output_dir / "checkpoint-4")  # checkpoint-2 saves, checkpoint-4 cannot
    result = run(finetune_command("train", "recipes/demo.yaml", "--output_dir", str(output_dir), *DEMO_SHORT_RUN,
                                  "--max_steps", "6", "--save_strategy", "steps", "--save_steps", "2",
                                  "--disable_tqdm", "true"), timeout=240)
    assert result.returncode == 2, result.output[-3000:]
    errors = [line for line in result.output.splitlines() if line.startswith("finetune: error:")]
    assert len(errors) == 1 and errors[0].startswith(f"finetune: error: cannot save checkpoint in {refusing}: ")
    assert "Traceback" not in result.output and "PermissionError" not in result.output
    previous = output_dir / "checkpoint-2"
    assert is_complete(previous) and f"the newest complete checkpoint, {previous}, is untouched" in errors[0]


@pytest.mark.distributed
@pytest.mark.launcher
def test_a_refusal_in_a_launched_rank_is_the_last_line_the_launcher_prints(tmp_path):
    """Accelerate's launcher re-raises torch.distributed.elastic's ChildFailedError with a traceback of its own; the
    rank leaves its one line in elastic's reply file, so the launcher's closing summary quotes it."""
    from support import CPU_LAUNCHES, launch_demo

    result = launch_demo(CPU_LAUNCHES["ddp"], tmp_path / "run", "--learning_rat", "1e-3", timeout=240)
    refusal = "finetune: error: unknown option `--learning_rat` (did you mean `learning_rate`?)."
    assert result.returncode != 0 and refusal in result.output
    lines = [line.strip() for line in result.output.splitlines() if line.strip() and set(line.strip()) != {"="}]
    assert lines[-1] == f"traceback : {refusal}", result.output[-3000:]
    assert "To enable traceback see" not in result.output
