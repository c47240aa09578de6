from pathlib import Path

import pytest
from support import PROJECT_ROOT

from finetune.errors import RecipeError
from finetune.recipe.parse import parse_recipe

RECIPES = sorted((PROJECT_ROOT / "recipes").glob("*.yaml"))


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "recipe.yaml"
    path.write_text(text)
    return path


@pytest.mark.parametrize("recipe", RECIPES, ids=[path.stem for path in RECIPES])
def test_every_shipped_recipe_parses(recipe, tmp_path):
    parsed = parse_recipe(recipe, ["--output_dir", str(tmp_path)])
    assert parsed.training.max_steps > 0


def test_yaml_values_land_in_their_sections_and_overrides_win(tmp_path):
    recipe = write(tmp_path, "model_name_or_path: tiny\nlearning_rate: 0.002\nmax_seq_length: 48\nuse_lora: true\n")
    parsed = parse_recipe(recipe, ["--learning_rate", "5e-4", "--output_dir", str(tmp_path)])
    assert parsed.model.model_name_or_path == "tiny"
    assert parsed.data.max_seq_length == 48
    assert parsed.lora.use_lora is True
    assert parsed.training.learning_rate == 5e-4
    assert parsed.training.use_cpu is True  # no accelerator here: Trainer must be told


def test_unknown_key_is_named_with_a_suggestion(tmp_path):
    with pytest.raises(RecipeError, match=r"unknown key `learning_rat`.*did you mean `learning_rate`"):
        parse_recipe(write(tmp_path, "learning_rat: 0.1\n"))


def test_unknown_command_line_option_is_named(tmp_path):
    with pytest.raises(RecipeError, match=r"unknown option `--max_stepz`.*max_steps"):
        parse_recipe(write(tmp_path, "max_steps: 3\n"), ["--max_stepz", "4"])


@pytest.mark.parametrize(
    "text, message",
    [
        ("learning_rate: abc\n", r"learning_rate.*invalid float value: 'abc'"),
        ("max_steps: 1.5\n", r"max_steps.*invalid int value"),
        ("lr_scheduler_type: sideways\n", r"`lr_scheduler_type: sideways`: sideways is not a valid SchedulerType"),
        ("torch_dtype: float64\n", r"torch_dtype: float64"),
        ("max_seq_length: 0\n", r"max_seq_length"),
        ("train_file: no/such/file.jsonl\n", r"train_file: no/such/file.jsonl` does not exist"),
    ],
)
def test_invalid_values_stop_with_the_key_named(tmp_path, text, message):
    with pytest.raises(RecipeError, match=message):
        parse_recipe(write(tmp_path, text))


def test_recipe_file_problems_are_user_errors(tmp_path):
    with pytest.raises(RecipeError, match="does not exist"):
        parse_recipe(tmp_path / "missing.yaml")
    with pytest.raises(RecipeError, match="not valid YAML"):
        parse_recipe(write(tmp_path, "a: [1,\n"))
    with pytest.raises(RecipeError, match="must be a mapping"):
        parse_recipe(write(tmp_path, "- 1\n- 2\n"))


def test_generation_scoring_is_on_for_the_synthetic_tasks_and_off_for_other_data_unless_asked(tmp_path):
    from finetune.recipe.args import SYNTHETIC_GENERATION_SAMPLES, DataArguments

    data = tmp_path / "mine.jsonl"
    data.write_text('{"instruction": "hi", "output": "hello"}\n')
    assert DataArguments().generation_eval_samples == SYNTHETIC_GENERATION_SAMPLES == 300
    assert DataArguments(train_file=str(data)).generation_eval_samples == 0
    assert DataArguments(dataset="HuggingFaceH4/ultrachat_200k").generation_eval_samples == 0
    assert DataArguments(dataset="synthetic", eval_file=str(data)).generation_eval_samples == 0
    assert DataArguments(train_file=str(data), generation_eval_samples=20).generation_eval_samples == 20


def test_evaluation_before_training_is_trainers_default_off_and_the_demo_asks_for_it(tmp_path):
    recipe = tmp_path / "mine.yaml"
    recipe.write_text("model_name_or_path: tiny\nmax_steps: 5\n")
    assert parse_recipe(recipe, []).training.eval_on_start is False
    assert parse_recipe(PROJECT_ROOT / "recipes" / "demo.yaml", []).training.eval_on_start is True


def test_report_to_takes_several_trackers_and_names_one_it_cannot_use(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")  # logged in or offline, and MLflow's store usable (test_tracking.py)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "mlruns").as_uri())
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")

    def report_to(*words):
        return parse_recipe("recipes/demo.yaml", ["--report_to", *words, "--output_dir", str(tmp_path)]).training \
            .report_to

    assert report_to("wandb", "mlflow") == report_to("wandb,mlflow") == ["wandb", "mlflow"]
    assert report_to("none") == []
    with pytest.raises(RecipeError, match=r"`report_to: mlflw` is not a tracker Trainer knows \(did you mean `mlflow`"):
        report_to("wandb,mlflw")
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *rest: None if name == "wandb" else
                        find_spec(name, *rest))
    with pytest.raises(RecipeError, match=r"needs the wandb package, which is not installed: pip install wandb"):
        report_to("wandb")
