"""Reward modelling (`method: reward`, TRL's RewardTrainer): from the demo's SFT model, 2 processes under ZeRO-2
raise the held-out pair accuracy (how often the chosen answer scores above the rejected one) from chance; each rank
holds the model states predicted; the scorer exports to a model Transformers loads with the run's scores; what is
not wired up is refused by name."""

import json
from types import SimpleNamespace

import pytest
import torch
from support import CPU_LAUNCHES, assert_succeeded, launch_demo

from finetune import outputs
from finetune.cli import main
from finetune.errors import RecipeError
from finetune.launch.strategies import SHIPPED_BY_NAME
from finetune.train.methods.reward import RewardModelling

# 100 steps of 8 pairs a rank (global batch 16), held-out accuracy on 128 pairs at the start, step 50 and the end
RUN = ["--method", "reward", "--max_steps", "100", "--logging_steps", "50", "--eval_strategy", "steps",
       "--eval_steps", "50", "--eval_on_start", "true", "--per_device_train_batch_size", "8", "--learning_rate", "5e-4",
       "--warmup_steps", "5", "--max_eval_samples", "128", "--save_strategy", "steps", "--save_steps", "50",
       "--report_to", "none"]


@pytest.fixture(scope="module")
def reward_run(trained_demo, tmp_path_factory):
    output_dir = tmp_path_factory.mktemp("reward")
    result = launch_demo(CPU_LAUNCHES["zero2"], output_dir, *RUN, "--model_name_or_path", str(trained_demo))
    return SimpleNamespace(output_dir=output_dir, result=result)


@pytest.mark.distributed
def test_a_reward_model_learns_to_rank_the_held_out_pairs(reward_run):
    assert_succeeded(reward_run.result)
    summary = json.loads((reward_run.output_dir / outputs.EVAL_RESULTS).read_text())
    assert summary["method"] == "reward" and summary["world_size"] == 2
    # measured on 2 processes: 0.485 → 0.67 (step 50) → 0.69, margin 0.009 → 0.48; on another CPU, whose demo run
    # ends elsewhere (add 0.11, reverse 1.0, sort 0.77), 0.575 → 0.66, margin 0.022 → 0.376, the code before and after
    # alike; chance is 0.5 for an untrained head (200 steps at twice the rate reached no more than 0.65: the tiny scorer
    # saturates there)
    before, after = summary["before"], summary["after"]
    assert before["pair_accuracy"] < 0.6 and after["pair_accuracy"] >= max(0.6, before["pair_accuracy"] + 0.05)
    assert after["score_margin"] > before["score_margin"] + 0.2
    report = json.loads((reward_run.output_dir / outputs.MEMORY_REPORT).read_text())["ranks"]
    assert [rank["rank"] for rank in report] == [0, 1]
    for rank in report:  # ZeRO-2: states of the scorer (decoder + one-output head), not of the LM head
        for key in ("params_bytes", "optimizer_bytes"):
            assert abs(rank["measured"][key] - rank["predicted"][key]) <= 1024, (rank["rank"], key)


@pytest.mark.distributed
def test_the_reward_model_exports_and_scores_as_the_run_does(reward_run, tmp_path):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    assert main(["export", str(reward_run.output_dir / "checkpoint-100"), str(tmp_path / "scorer")]) == 0
    config = json.loads((tmp_path / "scorer" / "config.json").read_text())
    assert config["architectures"][0].endswith("ForSequenceClassification") and len(config["id2label"]) == 1
    tokenizer = AutoTokenizer.from_pretrained(reward_run.output_dir)
    batch = tokenizer(["reverse: abc → cba", "reverse: abc → abc"], return_tensors="pt", padding=True)
    scores = {name: AutoModelForSequenceClassification.from_pretrained(path)(**batch).logits.detach()
              for name, path in (("exported", tmp_path / "scorer"), ("final", reward_run.output_dir))}
    assert scores["exported"].shape == (2, 1)
    assert torch.allclose(scores["exported"], scores["final"], atol=1e-5)


def test_what_reward_modelling_does_not_run_yet_is_refused_by_name():
    method = RewardModelling(RewardModelling.arguments())
    lora = SimpleNamespace(lora=SimpleNamespace(use_lora=True), strategy=SHIPPED_BY_NAME["zero2"].strategy)
    with pytest.raises(RecipeError, match="LoRA on a reward model is not wired up"):
        method.prepare_model(lora, None)
    zero3 = SimpleNamespace(lora=SimpleNamespace(use_lora=False), strategy=SHIPPED_BY_NAME["zero3"].strategy)
    with pytest.raises(RecipeError, match="under DeepSpeed ZeRO-3: the scorer is built from the loaded weights"):
        method.prepare_model(zero3, None)
    with pytest.raises(RecipeError, match="`center_rewards_coefficient` must be ≥ 0"):
        RewardModelling.arguments(center_rewards_coefficient=-1)
