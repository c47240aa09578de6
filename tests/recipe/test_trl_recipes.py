"""Recipes as TRL and the alignment-handbook write them (finetune.recipe.aliases): every renamed key lands on ours
with its
value and says so, keys that ask for what finetune does anyway are noted, the others are refused naming the fix, and
a handbook-style recipe trains the demo model unchanged under `finetune train --config`."""

import json

import pytest
from support import PROJECT_ROOT, assert_succeeded, finetune_command, run

from finetune.cli import build_parser
from finetune.commands.train import recipe_and_overrides
from finetune.errors import RecipeError
from finetune.recipe.aliases import TRL_KEYS, TRL_KEYS_BY_NAME
from finetune.recipe.parse import RecipeParser, parse_recipe, read_recipe

DEMO = PROJECT_ROOT / "recipes" / "demo.yaml"
TRL_RECIPE = PROJECT_ROOT / "tests" / "fixtures" / "trl_sft_recipe.yaml"
TRL_KTO_RECIPE = PROJECT_ROOT / "tests" / "fixtures" / "trl_kto_recipe.yaml"
TRL_CPO_RECIPE = PROJECT_ROOT / "tests" / "fixtures" / "trl_cpo_recipe.yaml"

# A value for each renamed key, as a recipe file and as the command line give it, and what our key then holds.
RENAMED = {
    "max_length": ("48", 48),
    "dtype": ("bfloat16", "bfloat16"),
    "use_peft": ("true", True),
    "load_in_4bit": ("false", False),
    "lora_modules_to_save": (None, None),  # needs use_lora: tested apart
    "dataset_name": ("synthetic", "synthetic"),
    "dataset_train_split": ("train_sft", "train_sft"),
    "dataset_streaming": ("true", True),
    "dataset_test_split": ("test_sft", "test_sft"),
    "chat_template_path": (None, None),  # needs a template file: tested with the chat template (tests/data)
    "test_split_size": ("0.1", 0.1),
    "warmup_ratio": ("0.1", 0.1),
    "evaluation_strategy": ("steps", "steps"),
}


def section_value(sections, key):
    if key in sections.training_inputs:
        return sections.training_inputs[key]
    return next(getattr(section, key) for section in (sections.model, sections.data, sections.lora)
                if hasattr(section, key))


def test_the_table_names_every_key_once_and_each_renamed_key_lands_on_a_key_of_ours():
    assert len(TRL_KEYS_BY_NAME) == len(TRL_KEYS)
    known = RecipeParser().known_keys()
    for key in TRL_KEYS:
        assert key.name not in known, f"{key.name} is our own key: it needs no alias"
        assert key.ours is None or key.ours in known
        assert key.ours or key.why, f"{key.name}: a key that is not renamed says what finetune does instead"
    assert set(RENAMED) == {key.name for key in TRL_KEYS if key.ours}


@pytest.mark.parametrize("name", [name for name, (value, _) in RENAMED.items() if value is not None])
@pytest.mark.parametrize("where", ["file", "command line"])
def test_a_renamed_key_lands_on_ours_with_its_value_and_its_source_names_it(tmp_path, name, where):
    text, expected = RENAMED[name]
    ours = TRL_KEYS_BY_NAME[name].ours
    if where == "file":
        recipe = tmp_path / "trl.yaml"
        recipe.write_text(f"model_name_or_path: tiny\n{name}: {text}\n")
        sections = read_recipe(recipe, [])
    else:
        sections = read_recipe(DEMO, [f"--{name}", text])
    assert section_value(sections, ours) == expected
    assert f"given as {'Transformers 4' if name in ('warmup_ratio', 'evaluation_strategy') else 'TRL'}'s {name}" \
        in sections.sources[ours]


def test_use_peft_alone_on_the_command_line_means_true_and_lora_target_modules_may_be_one_string(tmp_path):
    assert read_recipe(DEMO, ["--use_peft"]).lora.use_lora is True
    assert read_recipe(DEMO, ["--use_peft", "--lora_r", "4"]).lora.lora_r == 4
    recipe = tmp_path / "trl.yaml"
    recipe.write_text("use_peft: true\nlora_target_modules: all-linear\nlora_modules_to_save: [lm_head]\n")
    lora = read_recipe(recipe, []).lora
    assert lora.lora_target_modules == ["all-linear"] and lora.modules_to_save == ["lm_head"]


def test_a_warmup_ratio_becomes_the_fraction_transformers_5_reads_and_one_or_more_is_refused(tmp_path):
    recipe = parse_recipe(DEMO, ["--warmup_ratio", "0.2", "--max_steps", "50"])
    assert recipe.training.get_warmup_steps(50) == 10
    with pytest.raises(RecipeError, match=r"`warmup_ratio: 1.5` in the command line: a fraction of the training steps "
                                          r"must be in \[0, 1\).*give a count of steps as `warmup_steps`"):
        read_recipe(DEMO, ["--warmup_ratio", "1.5"])


def test_a_key_that_asks_for_what_finetune_does_anyway_is_noted_and_another_value_is_refused(tmp_path, capsys):
    read_recipe(DEMO, ["--assistant_only_loss", "true", "--shuffle_dataset", "false", "--overwrite_output_dir", "true"])
    note = capsys.readouterr().out
    assert "accepted and ignored" in note
    assert "`assistant_only_loss: true` (finetune learns only the assistant turns" in note
    assert "`shuffle_dataset: false`" in note and "`overwrite_output_dir: true` (finetune never deletes" in note
    with pytest.raises(RecipeError, match=r"TRL's `assistant_only_loss: false` in the command line is not supported: "
                                          r"finetune learns only the assistant turns.*one `text`"):
        read_recipe(DEMO, ["--assistant_only_loss", "false"])
    recipe = tmp_path / "trl.yaml"
    recipe.write_text("dataset_text_field: content\n")
    with pytest.raises(RecipeError, match=r"TRL's `dataset_text_field: content` in recipe .* rename your column"):
        read_recipe(recipe, [])


def test_a_key_given_under_both_names_is_refused(tmp_path):
    with pytest.raises(RecipeError, match=r"gives both `max_seq_length` and `max_length` \(TRL's max_length, our "
                                          r"`max_seq_length`\); keep one"):
        read_recipe(DEMO, ["--max_length", "32", "--max_seq_length", "64"])
    recipe = tmp_path / "both.yaml"
    recipe.write_text("use_peft: true\nuse_lora: true\n")
    with pytest.raises(RecipeError, match="gives both `use_lora` and `use_peft`"):
        read_recipe(recipe, [])


@pytest.mark.parametrize("argv, recipe, overrides", [
    (["train", "recipes/demo.yaml", "--max_steps", "2"], "recipes/demo.yaml", ["--max_steps", "2"]),
    (["train", "--config", "recipes/demo.yaml", "--max_length", "32"], "recipes/demo.yaml", ["--max_length", "32"]),
])
def test_the_recipe_is_positional_or_given_with_config_as_trl_takes_it(argv, recipe, overrides):
    assert recipe_and_overrides(build_parser().parse_args(argv)) == (recipe, overrides)


@pytest.mark.parametrize("argv, message", [
    (["train", "--config"], "`--config` needs a recipe file"),
    (["train", "--config", "--max_steps", "2"], "`--config` needs a recipe file"),
    (["train", "recipes/demo.yaml", "--config", "other.yaml"], "the recipe is given twice"),
    (["train", "--config", "a.yaml", "--config", "b.yaml"], r"`--config` is given twice \(`a.yaml` and `b.yaml`\)"),
    (["train"], "`finetune train` needs a recipe"),
])
def test_a_missing_or_doubled_recipe_is_one_line_with_the_fix(argv, message):
    with pytest.raises(RecipeError, match=message):
        recipe_and_overrides(build_parser().parse_args(argv))


def test_a_handbook_style_trl_recipe_trains_the_demo_model_unchanged(tmp_path):
    result = run(finetune_command("train", "--config", str(TRL_RECIPE), "--output_dir", str(tmp_path),
                                  "--max_steps", "2"), timeout=300)
    assert_succeeded(result)
    assert "keys that change nothing here, accepted and ignored: `model_revision: main`" in result.output
    values = json.loads((tmp_path / "effective_config.json").read_text())["values"]
    for ours, theirs in [("max_seq_length", "max_length"), ("use_lora", "use_peft"), ("torch_dtype", "dtype"),
                         ("dataset", "dataset_name"), ("warmup_steps", "warmup_ratio")]:
        assert f"'s {theirs})" in values[ours]["source"], ours
    assert values["max_seq_length"]["value"] == 128 and values["use_lora"]["value"] is True
    losses = [entry["loss"] for entry in json.loads((tmp_path / "trainer_state.json").read_text())["log_history"]
              if "loss" in entry]
    assert len(losses) == 2 and all(0 < loss < 10 for loss in losses)
    assert (tmp_path / "adapter_config.json").is_file()  # use_peft trained LoRA adapters


def test_a_trl_kto_recipe_loads_as_it_is_with_its_keys_in_trls_config(tmp_path, capsys):
    """`trl kto --config` names its trainer by the subcommand: here `--method kto`, the file unchanged."""
    recipe = parse_recipe(TRL_KTO_RECIPE, ["--method", "kto", "--output_dir", str(tmp_path)])
    args = recipe.training
    assert recipe.method.name == "kto" and recipe.method.settings.kto_loss_type == "kto"
    assert (args.loss_type, args.beta, args.desirable_weight, args.undesirable_weight) == ("kto", 0.1, 1.0, 1.33)
    assert args.max_length == recipe.data.max_seq_length == 64 and args.train_sampling_strategy == "sequential"
    assert recipe.model.torch_dtype == "bfloat16" and recipe.data.dataset_split == "train"
    assert recipe.foreign_keys["renamed"]["loss_type"] == "kto_loss_type"
    assert "accepted and ignored: `model_revision: main`" in capsys.readouterr().out


def test_a_trl_simpo_recipe_loads_as_it_is_with_its_keys_in_trls_config(tmp_path, capsys):
    recipe = parse_recipe(TRL_CPO_RECIPE, ["--method", "cpo", "--output_dir", str(tmp_path)])
    args = recipe.training
    assert recipe.method.name == "cpo" and recipe.method.settings.cpo_loss_type == "simpo"
    assert (args.loss_type, args.cpo_alpha, args.beta, args.simpo_gamma, args.label_smoothing) == \
        ("simpo", 0.0, 2.0, 0.5, 0.0)
    assert args.max_length == 64 and type(args).__name__ == "FinetuneCPOConfig"
    assert recipe.foreign_keys["renamed"]["loss_type"] == "cpo_loss_type"
    assert "`max_completion_length: 32` (TRL reads it for encoder-decoder models only" in capsys.readouterr().out



def test_a_trl_grpo_recipe_loads_as_it_is_with_its_keys_in_trls_config(tmp_path, capsys):
    recipe = parse_recipe(PROJECT_ROOT / "tests" / "fixtures" / "trl_grpo_recipe.yaml",
                          ["--method", "grpo", "--output_dir", str(tmp_path)])
    args, settings = recipe.training, recipe.method.settings
    assert recipe.method.name == "grpo" and settings.reward_funcs == ["think_format_reward", "exact_match"]
    assert (args.loss_type, args.beta, args.num_generations, args.max_completion_length, args.temperature,
            args.scale_rewards) == ("dr_grpo", 0.04, 4, 16, 0.9, "batch")
    assert type(args).__name__ == "FinetuneGRPOConfig" and recipe.data.max_seq_length == 64
    assert recipe.method.terms().reference_model  # beta > 0: a reference copy, planned and measured
    assert recipe.foreign_keys["renamed"]["loss_type"] == "grpo_loss_type"
    out = capsys.readouterr().out
    assert "`max_prompt_length: 32`" in out and "`vllm_mode: colocate`" in out and "`log_completions: true`" in out
    with pytest.raises(RecipeError, match="vLLM generation is not wired up yet"):
        read_recipe(PROJECT_ROOT / "tests" / "fixtures" / "trl_grpo_recipe.yaml",
                    ["--method", "grpo", "--use_vllm", "true"])
    with pytest.raises(RecipeError, match="casts the policy to bf16 in place every round"):
        read_recipe(PROJECT_ROOT / "tests" / "fixtures" / "trl_grpo_recipe.yaml",
                    ["--method", "grpo", "--use_transformers_continuous_batching", "true"])
