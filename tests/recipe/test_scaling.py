import json
import math
import random

import pytest
from support import accelerate_launch_command, assert_succeeded, finetune_command, run

from finetune.errors import RecipeError
from finetune.recipe.batch_plan import (
    BatchPlan,
    plan_batch,
    plan_from_recipe,
    scale_learning_rate,
    warmup_steps_from_tokens,
    write_batch_plan,
)


@pytest.mark.parametrize(
    "target, world, max_micro, expected",
    [(32, 2, 16, (16, 1)), (32, 1, 16, (16, 2)), (32, 4, 16, (8, 1)), (48, 2, 16, (12, 2)), (8, 2, 3, (2, 2)),
     (7, 1, 4, (1, 7))],
)
def test_planner_splits_the_global_batch_exactly(target, world, max_micro, expected):
    micro, accumulation = plan_batch(target, world, max_micro)
    assert (micro, accumulation) == expected
    assert micro * world * accumulation == target and micro <= max_micro


def test_unreachable_target_offers_the_nearest_choices():
    with pytest.raises(RecipeError, match=r"`global_batch_size: 30` cannot be split evenly over 4 processes; "
                                          r"nearest reachable: 28 or 32"):
        plan_batch(30, 4, 8)
    with pytest.raises(RecipeError, match="nearest reachable: 3$|nearest reachable: 3\\.$"):
        plan_batch(1, 3, 8)


@pytest.mark.parametrize("target, world, max_micro, name",
                         [(0, 2, 4, "global_batch_size"), (-8, 2, 4, "global_batch_size"), (8, 0, 4, "world size"),
                          (8, 2, 0, "max_micro_batch_size"), (8.5, 2, 4, "global_batch_size")])
def test_bad_values_are_named(target, world, max_micro, name):
    with pytest.raises(RecipeError, match=f"`{name}` must be a positive whole number"):
        plan_batch(target, world, max_micro)


def test_learning_rate_rules():
    assert scale_learning_rate(1e-4, 32, 64, "linear") == pytest.approx(2e-4)
    assert scale_learning_rate(1e-4, 32, 128, "sqrt") == pytest.approx(2e-4)
    assert scale_learning_rate(1e-4, 32, 128, "none") == 1e-4
    with pytest.raises(RecipeError, match="`lr_scaling: cubic` is not one of none, linear, sqrt"):
        scale_learning_rate(1e-4, 32, 64, "cubic")
    with pytest.raises(RecipeError, match="`base_learning_rate` must be positive"):
        scale_learning_rate(0.0, 32, 64, "linear")
    with pytest.raises(RecipeError, match="`base_batch_size` must be a positive whole number"):
        scale_learning_rate(1e-4, -1, 64, "linear")


def test_warmup_steps_from_tokens():
    assert warmup_steps_from_tokens(1_000_000, 32, 1024) == math.ceil(1_000_000 / 32768)
    with pytest.raises(RecipeError, match="`warmup_tokens`"):
        warmup_steps_from_tokens(0, 32, 1024)


def training(**overrides):
    values = {"per_device_train_batch_size": 16, "gradient_accumulation_steps": 1, "learning_rate": 1e-3}
    return {**values, **overrides}


def test_plan_keeps_global_batch_and_lr_when_the_world_size_changes():
    recipe = training(global_batch_size=64, lr_scaling="linear", base_learning_rate=1e-3, base_batch_size=32)
    plans = [plan_from_recipe(recipe, 512, world) for world in (1, 2, 4)]
    assert [(p.micro_batch_size, p.gradient_accumulation_steps) for p in plans] == [(16, 4), (16, 2), (16, 1)]
    assert {p.global_batch_size for p in plans} == {64}
    assert [p.learning_rate for p in plans] == pytest.approx([2e-3] * 3)


def test_without_a_global_batch_the_recipe_values_stand():
    plan = plan_from_recipe(training(gradient_accumulation_steps=2, warmup_tokens=65536), 64, 2)
    assert (plan.micro_batch_size, plan.gradient_accumulation_steps, plan.global_batch_size) == (16, 2, 64)
    assert plan.learning_rate == 1e-3 and plan.warmup_steps == 16


def test_batch_plan_file_says_when_the_world_size_changed(tmp_path):
    write_batch_plan(BatchPlan(2, 16, 1, 1e-3, "none", 1e-3, 32), tmp_path)
    record = write_batch_plan(BatchPlan(1, 16, 2, 1e-3, "none", 1e-3, 32), tmp_path)
    assert record["note"] == ("world size changed from 2 to 1: micro-batch and accumulation re-planned; "
                              "global batch 32 kept, learning rate 0.001 kept.")
    assert json.loads((tmp_path / "batch_plan.json").read_text()) == record
    record = write_batch_plan(BatchPlan(3, 16, 1, 2e-3, "none", 1e-3, 32), tmp_path)  # no global_batch_size: it moved
    assert record["note"].endswith("global batch changed from 32 to 48, learning rate changed from 0.001 to 0.002.")


# --- real runs: token-weighted normalisation makes the world size irrelevant -----------------------------

LOSS_TOLERANCE = 1e-4  # relative, per logged step; fp32 on CPU, only the reduction order differs
SHORT = ["--max_steps", "4", "--logging_steps", "1", "--eval_on_start", "false", "--generation_eval_samples", "0",
         "--warmup_steps", "0", "--learning_rate", "1e-3", "--max_seq_length", "128"]


@pytest.fixture(scope="module")
def varlen_data(tmp_path_factory):
    """Answers of 1 to 40 tokens: a per-batch mean weighs them very differently from a per-token mean."""
    rng = random.Random(0)
    path = tmp_path_factory.mktemp("data") / "varlen.jsonl"
    rows = []
    for _ in range(64):
        word = "".join(rng.choice("abcdefghij") for _ in range(rng.choice([1, 2, 3, 30, 40])))
        rows.append({"instruction": "reverse", "input": word, "output": word[::-1]})
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def train_run(output_dir, data, config=None, *extra):
    args = ["train", "recipes/demo.yaml", "--train_file", str(data), "--eval_file", str(data), "--output_dir",
            str(output_dir), *SHORT, *extra]
    result = run(accelerate_launch_command(config, *args) if config else finetune_command(*args), timeout=300)
    assert_succeeded(result)
    state = json.loads((output_dir / "trainer_state.json").read_text())
    logs = [entry for entry in state["log_history"] if "loss" in entry]
    return {"loss": [e["loss"] for e in logs], "grad_norm": [e["grad_norm"] for e in logs],
            "plan": json.loads((output_dir / "batch_plan.json").read_text())}


@pytest.fixture(scope="module")
def equivalence_runs(tmp_path_factory, varlen_data):
    """Global batch 8: 1 process × micro 4 × 2 accumulation vs 2 processes × micro 2 × 2 accumulation."""
    runs = {}
    for norm in ("tokens", "micro_batch_mean"):
        common = ["--global_batch_size", "8", "--loss_normalization", norm]
        runs["one", norm] = train_run(tmp_path_factory.mktemp("one"), varlen_data, None, *common,
                                      "--max_micro_batch_size", "4")
        runs["ddp", norm] = train_run(tmp_path_factory.mktemp("ddp"), varlen_data, "accelerate_configs/cpu_ddp.yaml",
                                      *common, "--max_micro_batch_size", "2")
    runs["zero2", "tokens"] = train_run(
        tmp_path_factory.mktemp("zero2"), varlen_data, "accelerate_configs/cpu_deepspeed_zero2.yaml",
        "--global_batch_size", "8", "--max_micro_batch_size", "2")
    return runs


def relative_gap(a, b):
    return max(abs(x - y) / abs(x) for x, y in zip(a, b))




@pytest.mark.distributed
@pytest.mark.parametrize("strategy", ["ddp", "zero2"])
def test_same_global_batch_gives_the_same_losses_on_one_and_two_processes(equivalence_runs, strategy):
    one, two = equivalence_runs["one", "tokens"], equivalence_runs[strategy, "tokens"]
    assert (one["plan"]["micro_batch_size"], one["plan"]["gradient_accumulation_steps"]) == (4, 2)
    plan = two["plan"]
    assert (plan["micro_batch_size"], plan["gradient_accumulation_steps"], plan["world_size"]) == (2, 2, 2)
    assert len(one["loss"]) == len(two["loss"]) == 4
    assert relative_gap(one["loss"], two["loss"]) <= LOSS_TOLERANCE
    assert relative_gap(one["grad_norm"], two["grad_norm"]) <= LOSS_TOLERANCE


@pytest.mark.distributed
def test_control_a_per_batch_mean_breaks_the_equivalence(equivalence_runs):
    one, two = equivalence_runs["one", "micro_batch_mean"], equivalence_runs["ddp", "micro_batch_mean"]
    assert relative_gap(one["loss"], two["loss"]) > 10 * LOSS_TOLERANCE
    assert relative_gap(one["grad_norm"], two["grad_norm"]) > 10 * LOSS_TOLERANCE


@pytest.mark.distributed
def test_cross_rank_token_averaging_first_step(tmp_path, varlen_data):
    """1 process × micro 2 and 2 processes × micro 1 see the same two (very unequal) examples in step one."""
    two = train_run(tmp_path / "run", varlen_data, "accelerate_configs/cpu_ddp.yaml",
                    "--global_batch_size", "2", "--max_micro_batch_size", "1", "--max_steps", "1")
    assert two["plan"] == {**two["plan"], "world_size": 2, "micro_batch_size": 1, "gradient_accumulation_steps": 1,
                           "global_batch_size": 2, "learning_rate": 1e-3}
    one = train_run(tmp_path / "run", varlen_data, None,  # same output_dir: the plan notes the change
                    "--global_batch_size", "2", "--max_micro_batch_size", "2", "--max_steps", "1")
    assert one["loss"][0] == pytest.approx(two["loss"][0], rel=LOSS_TOLERANCE)
    assert one["grad_norm"][0] == pytest.approx(two["grad_norm"][0], rel=LOSS_TOLERANCE)
    assert one["plan"]["note"].startswith("world size changed from 2 to 1")
    assert "global batch 2 kept, learning rate 0.001 kept" in one["plan"]["note"]


def test_a_default_batch_rounds_up_to_the_world_size_and_the_lr_rule_default_is_the_recipes():
    from finetune.recipe.args import FinetuneTrainingArguments
    from finetune.recipe.batch_plan import DEFAULT_LR_SCALING, reachable_global_batch

    assert [reachable_global_batch(32, world) for world in (1, 2, 3, 64)] == [32, 32, 33, 64]
    with pytest.raises(RecipeError, match="world size"):
        reachable_global_batch(32, 0)
    assert FinetuneTrainingArguments.lr_scaling == DEFAULT_LR_SCALING
    assert plan_from_recipe({"per_device_train_batch_size": 2, "gradient_accumulation_steps": 1,
                             "learning_rate": 1e-3}, 64, 2).lr_scaling == DEFAULT_LR_SCALING
