"""Faults and silent cases a user meets (issue: nothing silent, nothing lost): each stops with one line naming the
key, file or fault, or is skipped by name, instead of a traceback or a quiet default."""

import json

import pytest
from support import PROJECT_ROOT

from finetune import outputs
from finetune.checkpoints import (
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
from finetune.recipe import load_recipe_file, parse_recipe

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

    from finetune.args import ModelArguments
    from finetune.models import load_model, load_tokenizer

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
    from finetune.recipe import _check_steps_and_accumulation
    from finetune.scaling import plan_from_recipe

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
