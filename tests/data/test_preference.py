"""Preference data and planning without a launch (finetune.data.pairs, finetune/train/methods/dpo/, the estimator's
terms for `method: dpo`): pair formats and their errors, the synthetic pairs, the recipe keys, and the reference
model's bytes per strategy."""

import json
import random
import re
from dataclasses import replace

import pytest
from datasets import Dataset
from support import PROJECT_ROOT, finetune_command, run

from finetune.data.pairs import (
    check_pairs,
    detect_pair_format,
    load_preference_data,
    synthetic_pair,
    to_pair,
)
from finetune.errors import RecipeError
from finetune.memory import model_shape
from finetune.memory.estimate import MethodTerms, Setup, activation_bytes, estimate
from finetune.recipe.parse import read_recipe
from finetune.train.evaluation import summarize_evaluations
from finetune.train.methods.dpo import DirectPreferenceOptimization

DPO_TERMS = DirectPreferenceOptimization.memory

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
    # `overlong` and `no_answer_tokens` are counted when TRL tokenizes the pairs
    assert data.summary["sources"][0]["train"]["dropped"] == {"empty_answer": 1, "same_answers": 0, "overlong": 0,
                                                              "no_answer_tokens": 0}
    assert data.summary["sources"][0]["plain_text"] is False  # alpaca pairs become conversations

    plain = tmp_path / "plain.jsonl"
    plain.write_text("".join(json.dumps({"prompt": f"{i}+1=", "chosen": str(i + 1), "rejected": str(i)}) + "\n"
                             for i in range(5)))
    sections = read_recipe("recipes/demo.yaml", ["--method", "dpo", "--dataset", str(plain), "--eval_split_ratio", "0"])
    source = load_preference_data(sections.data, seed=0).summary["sources"][0]
    assert source["format"] == "pairs" and source["plain_text"] is True  # what `finetune chat` reads


@pytest.mark.parametrize(("overrides", "message"), [
    (["--beta", "0.5"], "`beta` configures methods dpo, kto, cpo, orpo and grpo, not `method: sft`"),
    (["--method", "dpo", "--beta", "0"], "`beta` must be positive"),
    (["--method", "dpo", "--dpo_loss_type", "orpo"], "`dpo_loss_type: orpo` is not one of sigmoid, hinge, ipo"),
    (["--method", "dpo", "--dpo_loss_type", "sigmoid", "sft", "--dpo_loss_weights", "1"],
     "`dpo_loss_weights` gives 1 weight"),
    (["--method", "kto", "--dpo_loss_type", "ipo"], "`dpo_loss_type` configures `method: dpo` but `method` is kto"),
])
def test_preference_keys_are_checked_by_name(overrides, message):
    with pytest.raises(RecipeError, match=message):
        read_recipe("recipes/demo.yaml", overrides)


def test_packing_is_refused_with_dpo_when_the_recipe_is_read():
    with pytest.raises(RecipeError, match="`packing` and `padding_free` are for supervised fine-tuning"):
        read_recipe("recipes/demo.yaml", ["--method", "dpo", "--packing", "true"])


def test_a_preprocessed_dir_is_refused_with_dpo_when_the_recipe_is_read(tmp_path):
    with pytest.raises(RecipeError, match="TRL's DPOTrainer tokenizes the pairs itself and reads no cache"):
        read_recipe("recipes/demo.yaml", ["--method", "dpo", "--preprocessed_dir", str(tmp_path)])


@pytest.mark.parametrize(("strategy", "stage", "lora", "expected"), [
    ("ddp", 0, 0, 1.0), ("single", 0, 0, 1.0), ("deepspeed", 1, 0, 1.0), ("deepspeed", 2, 0, 1.0),
    ("deepspeed", 3, 0, 0.5), ("fsdp", 0, 0, 0.5), ("ddp", 0, 8, 0.0), ("deepspeed", 3, 8, 0.0),
])
def test_the_reference_model_is_whole_sharded_or_absent_as_trl_prepares_it(strategy, stage, lora, expected):
    shape = model_shape("tiny")
    gpus = 1 if strategy == "single" else 2
    for precision, element in (("bf16", 2), ("fp32", 4)):
        setup = Setup(strategy=strategy, zero_stage=stage, num_gpus=gpus, precision=precision, lora_rank=lora,
                      method=DPO_TERMS)
        result = estimate(shape, setup)
        assert result.reference_bytes == int(expected * element * shape.num_parameters)
        sft = estimate(shape, Setup(strategy=strategy, zero_stage=stage, num_gpus=gpus, precision=precision,
                                    lora_rank=lora))
        assert sft.reference_bytes == 0
        assert result.total_bytes - sft.total_bytes == result.reference_bytes + result.activations_bytes \
            - sft.activations_bytes
        assert result.to_dict()["per_gpu"]["reference_bytes"] == result.reference_bytes


def test_dpo_activations_are_two_sequences_per_pair_through_the_fused_head():
    shape = model_shape("tiny")
    dpo = activation_bytes(shape, Setup(micro_batch_size=2, sequence_length=64, method=DPO_TERMS))
    four = Setup(micro_batch_size=4, sequence_length=64)
    sft_two = activation_bytes(shape, four)
    logits = 64 * 4 * shape.vocab_size * (4 + 8)  # saved fp32 log-probabilities + the two fp32 gradients after them
    no_logits = activation_bytes(shape, replace(four, method=MethodTerms(logits_held=False)))
    assert no_logits == sft_two - logits
    # TRL's fused head, as SFT's: the hidden states it keeps and its one tile of logits, no (tokens × vocab) logits
    assert dpo == activation_bytes(shape, replace(four, method=MethodTerms(logits_held=False, fused_head=True)))
    assert no_logits < dpo < sft_two


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
    assert all(row["setup"]["method"] == {"reference_model": True, "sequences_per_example": 2, "logits_held": False,
                                          "completion_length": 0, "steps_per_generation": None,
                                          "reward_model_parameters": 0, "gathers_for_generation": True,
                                          "fused_head": True}  # TRL's DPO scores through its fused head
               for row in plan["strategies"])
    assert plan["data"]["method"] == "dpo"


# Pairs as TRL's DPOTrainer leaves them after tokenizing, for the length policies: prompt, chosen and rejected token
# counts; `max_seq_length: 10`.
TOKENIZED = [(4, 3, 2), (6, 8, 1), (3, 1, 1)]  # fits; 14 tokens: overlong; fits


def length_policies(overlong_policy="truncate", unlabeled_policy="drop", tokenized=TOKENIZED, split="train",
                    prompt_fills=1):
    """`prompt_fills`: pairs whose prompt alone reached 10 tokens, which TRL dropped."""
    from finetune.data.pairs import SOURCE_COLUMN, apply_pair_length_policies
    from finetune.recipe.args import DataArguments

    rows = [{"prompt": "p", "chosen": "c", "rejected": "r", SOURCE_COLUMN: 0}] * (len(tokenized) + prompt_fills)
    pairs = Dataset.from_list(rows)
    trl_rows = Dataset.from_list([{"prompt_ids": [1] * p, "chosen_ids": [2] * c, "rejected_ids": [3] * r,
                                   SOURCE_COLUMN: 0} for p, c, r in tokenized])
    record = {"rows": len(rows), "pairs": len(rows), "truncated_rows": 0,
              "dropped": {"empty_answer": 0, "same_answers": 0, "overlong": 0, "no_answer_tokens": 0}}
    summary = {"sources": [{"name": "pairs.jsonl", "format": "pairs", "train": None, "eval": None, split: record}]}
    data_args = DataArguments(max_seq_length=10, overlong_policy=overlong_policy, unlabeled_policy=unlabeled_policy)
    kept = apply_pair_length_policies(pairs, trl_rows, data_args, split, summary)
    return kept, summary


def test_pairs_trl_drops_and_truncates_are_counted_in_the_data_summary():
    kept, summary = length_policies()
    record = summary["sources"][0]["train"]
    assert len(kept) == 3 and record["pairs"] == 3 and summary["train_rows"] == 3
    assert record["truncated_rows"] == 1  # TRL's collator keeps the first 10 tokens of the 14-token pair
    assert record["dropped"]["no_answer_tokens"] == 1


def test_overlong_pairs_are_dropped_and_counted_under_overlong_policy_drop():
    kept, summary = length_policies("drop")
    record = summary["sources"][0]["train"]
    assert [len(row["chosen_ids"]) for row in kept] == [3, 1]
    assert record["dropped"]["overlong"] == 2 and record["truncated_rows"] == 0 and record["pairs"] == 2


def test_an_overlong_pair_is_refused_under_overlong_policy_error():
    with pytest.raises(RecipeError, match=r"pairs.jsonl \(train\) have a prompt of `max_seq_length: 10` tokens or "
                                          r"more.*`overlong_policy: error`"):
        length_policies("error")
    with pytest.raises(RecipeError, match=r"a pair of pairs.jsonl \(train\) has 14 tokens .*more than "
                                          r"`max_seq_length: 10` \(`overlong_policy: error`"):
        length_policies("error", prompt_fills=0)


def test_a_pair_left_without_answer_tokens_is_refused_under_unlabeled_policy_error():
    with pytest.raises(RecipeError, match=r"leaving no answer token \(`unlabeled_policy: error`"):
        length_policies(unlabeled_policy="error")


def test_every_pair_dropped_is_refused_naming_the_data_the_count_and_the_key():
    with pytest.raises(RecipeError, match=r"no eval pair of pairs.jsonl is left at `max_seq_length: 10` \(dropped: "
                                          r"2 overlong\): raise `max_seq_length`.*`overlong_policy: truncate`"):
        length_policies("drop", tokenized=TOKENIZED[1:2], split="eval")


def write_pairs(path, long_prompts: int, long_answers: int, short: int):
    """Plain-text pairs for the embedded byte-level tokenizer (a token a character): prompts that fill 48 tokens
    alone, pairs whose long chosen answer passes 48, and pairs that fit."""
    rows = [{"prompt": f"Question {i}: {'x' * 60}?", "chosen": "yes", "rejected": "no"} for i in range(long_prompts)]
    rows += [{"prompt": f"Q{i}: say", "chosen": "a" * 60, "rejected": "bbb"} for i in range(long_answers)]
    rows += [{"prompt": f"Q{i}: 1+1=", "chosen": "2", "rejected": "3"} for i in range(short)]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def dpo_train(pairs, output_dir, *extra):
    return run(finetune_command("train", "recipes/demo.yaml", "--method", "dpo", "--dataset", str(pairs),
                                "--eval_split_ratio", "0", "--max_seq_length", "48", "--max_steps", "2",
                                "--per_device_train_batch_size", "2", "--output_dir", str(output_dir),
                                "--eval_on_start", "false", "--save_strategy", "no", "--report_to", "none",
                                "--disable_tqdm", "true", *extra), cwd=PROJECT_ROOT)


def test_a_dpo_run_counts_the_pairs_trl_drops_and_truncates(tmp_path):
    result = dpo_train(write_pairs(tmp_path / "pairs.jsonl", 4, 3, 5), tmp_path / "run")
    assert result.returncode == 0, result.output[-3000:]
    (source,) = json.loads((tmp_path / "run" / "data_summary.json").read_text())["sources"]
    assert source["train"]["pairs"] == 8 and source["train"]["truncated_rows"] == 3
    assert source["train"]["dropped"]["no_answer_tokens"] == 4
    assert "train 8 pairs (dropped {'no_answer_tokens': 4}) (3 truncated to max_seq_length)" in result.output
    assert json.loads((tmp_path / "run" / "eval_results.json").read_text())["dropped_examples"] == {"train": 4}


def test_a_dpo_run_whose_every_pair_is_dropped_stops_in_one_line(tmp_path):
    result = dpo_train(write_pairs(tmp_path / "pairs.jsonl", 3, 0, 0), tmp_path / "run")
    assert result.returncode == 2, result.output[-3000:]
    assert "Traceback" not in result.output and "num_samples" not in result.output
    assert (f"finetune: error: no train pair of {tmp_path / 'pairs.jsonl'} is left at `max_seq_length: 48` "
            "(dropped: 3 no answer tokens): raise `max_seq_length`") in result.output


def test_plan_prints_a_dpo_recipes_plan_and_its_pairs(tmp_path, capsys):
    from finetune.cli import main

    recipe = tmp_path / "dpo.yaml"  # the shipped DPO recipe, from the embedded model instead of `make demo`'s
    recipe.write_text((PROJECT_ROOT / "recipes/dpo.yaml").read_text().replace("outputs/demo", "tiny"))
    assert main(["plan", "--recipe", str(recipe), "--gpus", "2", "--gpu-memory", "16"]) == 0
    output = capsys.readouterr().out
    assert "Recommended" in output or "recommend" in output.lower()
    assert "Data synthetic (synthetic_pairs): 6,000 training pairs" in output
    assert "max_seq_length 64" in output


def test_preprocess_refuses_a_dpo_recipe_saying_trl_tokenizes_the_pairs(tmp_path, capsys):
    from finetune.cli import main

    assert main(["preprocess", "recipes/demo.yaml", "--method", "dpo", "--output_dir", str(tmp_path)]) == 2
    error = capsys.readouterr().err
    assert "`finetune preprocess` is for supervised fine-tuning" in error and "TRL's DPOTrainer tokenizes" in error
    assert not (tmp_path / "preprocessed").exists()


@pytest.mark.parametrize(("given", "ours"), [
    ({"loss_type": ["sigmoid", "sft"], "loss_weights": [1.0, 0.5]},
     {"dpo_loss_type": ["sigmoid", "sft"], "dpo_loss_weights": [1.0, 0.5]}),
    ({"loss_type": "aot_unpaired"}, {"dpo_loss_type": ["aot_unpaired"]}),
    ({"dpo_loss_type": "ipo"}, {"dpo_loss_type": ["ipo"]}),
])
def test_trls_dpo_loss_keys_become_ours_under_method_dpo_and_are_recorded(tmp_path, given, ours):
    import yaml

    recipe = tmp_path / "dpo.yaml"
    recipe.write_text(yaml.safe_dump({"method": "dpo", **given}))
    sections = read_recipe(str(recipe))
    for key, value in ours.items():
        assert getattr(sections.method.settings, key) == value
        trl_name = key.removeprefix("dpo_")
        assert sections.sources[key] == (f"recipe {recipe} (given as TRL's {trl_name})" if trl_name in given
                                         else f"recipe {recipe}")
    on_the_command_line = read_recipe("recipes/demo.yaml", ["--method", "dpo", "--loss_type", "ipo"])
    assert on_the_command_line.method.settings.dpo_loss_type == ["ipo"]


def test_the_dpo_loss_types_are_those_of_the_installed_trl():
    import inspect
    import re

    from trl import DPOTrainer

    from finetune.train.methods.dpo import trl_dpo_loss_types

    DPO_LOSS_TYPES = trl_dpo_loss_types()

    dispatched = re.findall(r'loss_type == "(\w+)"', inspect.getsource(DPOTrainer._compute_loss))
    assert sorted(DPO_LOSS_TYPES) == sorted(dispatched) and "aot_unpaired" in DPO_LOSS_TYPES


@pytest.mark.parametrize(("overrides", "message"), [
    (["--loss_type", "ipo"], "TRL's `loss_type: ipo` in the command line is not supported: the loss is the answer "
                             "tokens' cross-entropy"),
    (["--loss_weights", "1"], "TRL's `loss_weights: 1` in the command line is DPOConfig's: it needs `method: dpo`, "
                              "where it is our `dpo_loss_weights`"),
    (["--method", "dpo", "--loss_type", "ipo", "--dpo_loss_type", "ipo"], "gives both `dpo_loss_type` and "
                                                                          "`loss_type`"),
])
def test_trls_dpo_loss_keys_are_refused_by_name_under_sft_or_given_twice(overrides, message):
    with pytest.raises(RecipeError, match=re.escape(message)):
        read_recipe("recipes/demo.yaml", overrides)
