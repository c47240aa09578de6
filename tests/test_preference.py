"""Preference data and planning without a launch (finetune.preference, the estimator's `method: dpo`): pair formats
and their errors, the synthetic pairs, the recipe keys, and the reference model's bytes per strategy."""

import json
import random

import pytest
from datasets import Dataset
from support import PROJECT_ROOT, finetune_command, run

from finetune.errors import RecipeError
from finetune.evaluation import summarize_evaluations
from finetune.memory import model_shape
from finetune.memory.estimate import Setup, activation_bytes, estimate
from finetune.preference import (
    check_pairs,
    detect_pair_format,
    load_preference_data,
    synthetic_pair,
    to_pair,
)
from finetune.recipe import read_recipe

USER = {"role": "user", "content": "2+2?"}


def test_each_pair_format_becomes_a_trl_preference_row():
    alpaca = {"instruction": "add", "input": "2+2", "chosen": "4", "rejected": "5"}
    assert detect_pair_format(alpaca) == "alpaca_pairs"
    assert to_pair(alpaca, "alpaca_pairs") == {"prompt": [{"role": "user", "content": "add\n\n2+2"}],
                                               "chosen": [{"role": "assistant", "content": "4"}],
                                               "rejected": [{"role": "assistant", "content": "5"}]}
    sharegpt = {"conversations": [{"from": "human", "value": "2+2?"}], "system": "be brief",
                "chosen": {"from": "gpt", "value": "4"}, "rejected": {"from": "gpt", "value": "5"}}
    assert detect_pair_format(sharegpt) == "sharegpt_pairs"
    row = to_pair(sharegpt, "sharegpt_pairs")
    assert row["prompt"] == [{"role": "system", "content": "be brief"}, USER]
    assert (row["chosen"], row["rejected"]) == ([{"role": "assistant", "content": "4"}],
                                                [{"role": "assistant", "content": "5"}])
    text = {"prompt": "2+2=", "chosen": "4", "rejected": "5"}
    assert detect_pair_format(text) == "pairs" and to_pair(text, "pairs") == text
    # Whole conversations sharing their prompt: TRL's extract_prompt splits them, so no prompt is made up here.
    implicit = {"chosen": [USER, {"role": "assistant", "content": "4"}],
                "rejected": [USER, {"role": "assistant", "content": "5"}]}
    assert to_pair(implicit, "pairs") == implicit


def test_data_that_is_not_pairs_is_refused_naming_its_columns_and_the_formats():
    with pytest.raises(RecipeError, match=r"columns are instruction, output; expected one of: sharegpt_pairs"):
        detect_pair_format(["instruction", "output"])
    with pytest.raises(RecipeError, match="plain-text pairs need a `prompt` column"):
        to_pair({"chosen": "4", "rejected": "5"}, "pairs")


def test_empty_and_equal_answers_are_dropped_and_counted_and_mixed_kinds_are_refused_by_row():
    rows = [{"prompt": "a", "chosen": "b", "rejected": "c"}, {"prompt": "a", "chosen": "", "rejected": "c"},
            {"prompt": "a", "chosen": "b", "rejected": "b"}, {"prompt": "a", "chosen": "d", "rejected": "  "}]
    kept, dropped = check_pairs(Dataset.from_list(rows), "data.jsonl (train)", "drop")
    assert len(kept) == 1 and kept[0]["chosen"] == "b"
    assert dropped == {"empty_answer": 2, "same_answers": 1}
    with pytest.raises(RecipeError, match=r"data.jsonl \(train\) row 1 has an empty chosen answer"):
        check_pairs(Dataset.from_list(rows), "data.jsonl (train)", "error")
    with pytest.raises(RecipeError, match="no preference pair of x is left"):
        check_pairs(Dataset.from_list(rows[1:3]), "x", "drop")
    mixed = [{"prompt": [USER], "chosen": "4", "rejected": "5"}]
    with pytest.raises(RecipeError, match="x row 0: prompt are conversations but chosen, rejected plain text"):
        check_pairs(Dataset.from_list(mixed), "x", "drop")


def test_a_synthetic_pair_prefers_the_right_answer_to_a_plausible_wrong_one():
    rng = random.Random(0)
    for example in ({"task": "reverse", "instruction": "reverse", "input": "abc", "output": "cba"},
                    {"task": "sort", "instruction": "sort", "input": "cab", "output": "abc"},
                    {"task": "add", "instruction": "add", "input": "2+3", "output": "5"}):
        for _ in range(10):
            pair = synthetic_pair(example, rng)
            assert pair["prompt"] == [{"role": "user", "content": f"{example['instruction']}\n\n{example['input']}"}]
            assert pair["chosen"] == [{"role": "assistant", "content": example["output"]}]
            wrong = pair["rejected"][0]["content"]
            assert wrong != example["output"]
            if example["task"] == "add":
                assert int(wrong) - 5 in (1, -1, 10)
            else:  # a typical mistake: the letters as given, or in the wrong order
                assert wrong in (example["input"], example["output"][::-1])
    palindrome = synthetic_pair({"task": "reverse", "instruction": "reverse", "input": "aba", "output": "aba"}, rng)
    assert palindrome["rejected"][0]["content"] in ("baa", "aab")


def test_the_synthetic_dataset_gives_held_out_pairs_and_a_file_of_pairs_loads(tmp_path):
    sections = read_recipe("recipes/demo.yaml", ["--method", "dpo"])
    data = load_preference_data(sections.data, seed=0)
    assert data.summary["sources"][0]["format"] == "synthetic_pairs"
    assert len(data.train) == 6000 and len(data.eval) == 300
    train_prompts = {json.dumps(row["prompt"]) for row in data.train}
    assert not any(json.dumps(row["prompt"]) in train_prompts for row in data.eval)  # held out

    path = tmp_path / "pairs.jsonl"
    rows = [{"instruction": "add", "input": f"{i}+1", "chosen": str(i + 1), "rejected": str(i + 2)} for i in range(5)]
    rows.append({"instruction": "add", "input": "9+1", "chosen": "", "rejected": "11"})
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    sections = read_recipe("recipes/demo.yaml", ["--method", "dpo", "--dataset", str(path), "--eval_split_ratio", "0"])
    data = load_preference_data(sections.data, seed=0)
    assert len(data.train) == 5 and data.eval is None
    assert data.summary["sources"][0]["train"]["dropped"] == {"empty_answer": 1, "same_answers": 0}


@pytest.mark.parametrize(("overrides", "message"), [
    (["--beta", "0.5"], "`beta` configures preference training but `method` is sft"),
    (["--method", "dpo", "--beta", "0"], "`beta` must be positive"),
    (["--method", "dpo", "--dpo_loss_type", "orpo"], "`dpo_loss_type: orpo` is not one of sigmoid, hinge, ipo"),
    (["--method", "dpo", "--dpo_loss_type", "sigmoid", "sft", "--dpo_loss_weights", "1"],
     "`dpo_loss_weights` gives 1 weight"),
    (["--method", "kto"], "argument --method: invalid choice: 'kto'"),
])
def test_preference_keys_are_checked_by_name(overrides, message):
    with pytest.raises(RecipeError, match=message):
        read_recipe("recipes/demo.yaml", overrides)


def test_packing_is_refused_with_dpo():
    sections = read_recipe("recipes/demo.yaml", ["--method", "dpo", "--packing", "true"])
    with pytest.raises(RecipeError, match="`packing` and `padding_free` are for supervised fine-tuning"):
        load_preference_data(sections.data, seed=0)


@pytest.mark.parametrize(("strategy", "stage", "lora", "expected"), [
    ("ddp", 0, 0, 1.0), ("single", 0, 0, 1.0), ("deepspeed", 1, 0, 1.0), ("deepspeed", 2, 0, 1.0),
    ("deepspeed", 3, 0, 0.5), ("fsdp", 0, 0, 0.5), ("ddp", 0, 8, 0.0), ("deepspeed", 3, 8, 0.0),
])
def test_the_reference_model_is_whole_sharded_or_absent_as_trl_prepares_it(strategy, stage, lora, expected):
    shape = model_shape("tiny")
    gpus = 1 if strategy == "single" else 2
    for precision, element in (("bf16", 2), ("fp32", 4)):
        setup = Setup(strategy=strategy, zero_stage=stage, num_gpus=gpus, precision=precision, lora_rank=lora,
                      method="dpo")
        result = estimate(shape, setup)
        assert result.reference_bytes == int(expected * element * shape.num_parameters)
        sft = estimate(shape, Setup(strategy=strategy, zero_stage=stage, num_gpus=gpus, precision=precision,
                                    lora_rank=lora))
        assert sft.reference_bytes == 0
        assert result.total_bytes - sft.total_bytes == result.reference_bytes + result.activations_bytes \
            - sft.activations_bytes
        assert result.to_dict()["per_gpu"]["reference_bytes"] == result.reference_bytes


def test_dpo_activations_are_two_sequences_per_pair_without_full_logits():
    shape = model_shape("tiny")
    dpo = activation_bytes(shape, Setup(micro_batch_size=2, sequence_length=64, method="dpo"))
    sft_two = activation_bytes(shape, Setup(micro_batch_size=4, sequence_length=64))
    logits = 64 * 4 * shape.vocab_size * (2 + 4 + 4)
    assert dpo == sft_two - logits


def test_summary_reports_the_reward_accuracy_and_margin_before_and_after():
    history = [{"step": 0, "eval_loss": 0.69, "eval_rewards/accuracies": 0.0, "eval_rewards/margins": 0.0},
               {"step": 10, "loss": 0.5}]
    final = {"eval_loss": 0.3, "eval_rewards/accuracies": 0.95, "eval_rewards/margins": 2.5}
    summary = summarize_evaluations([*history, {"step": 10, **final}], [], final)
    assert summary["before"] == {"step": 0, "eval_loss": 0.69, "reward_accuracy": 0.0, "reward_margin": 0.0}
    assert summary["after"] == {"step": 10, "eval_loss": 0.3, "reward_accuracy": 0.95, "reward_margin": 2.5}


def test_plan_for_dpo_shows_the_reference_and_launches_with_the_method(tmp_path):
    result = run(finetune_command("plan", "--model", "tiny", "--gpus", "2", "--gpu-memory", "16", "--method", "dpo",
                                  "--json"), cwd=PROJECT_ROOT)
    assert result.returncode == 0, result.output[-2000:]
    plan = json.loads(result.output[result.output.index("{"):])
    rows = {row["name"]: row for row in plan["strategies"]}
    half = 2 * model_shape("tiny").num_parameters  # bf16, the default precision planned
    assert rows["DDP"]["per_gpu"]["reference_bytes"] == half
    assert rows["ZeRO-3"]["per_gpu"]["reference_bytes"] == half // 2
    assert plan["launch_command"].endswith("--method dpo")
    recipe = tmp_path / "dpo.yaml"
    recipe.write_text((PROJECT_ROOT / "recipes/demo.yaml").read_text() + "method: dpo\n")
    result = run(finetune_command("plan", "--recipe", str(recipe), "--gpus", "2", "--gpu-memory", "16", "--json"),
                 cwd=PROJECT_ROOT)
    assert result.returncode == 0, result.output[-2000:]
    plan = json.loads(result.output[result.output.index("{"):])
    assert all(row["setup"]["method"] == "dpo" for row in plan["strategies"])
