"""SFT's loss from TRL's fused LM head (`add_fused_lm_head`, finetune.train.trainer.FinetuneTrainer): the same
losses as the model's own loss over the full logits, on the embedded tiny model and on a hub-shaped bf16 checkpoint
(untied head, grouped-query attention); the effective config names the head and, where a feature needs the full
logits, why."""

import json

import pytest
from hub_fixtures import save_hub_model

import finetune.train.trainer as trainer_module
from finetune import outputs
from finetune.cli import main

RUN = ["--max_steps", "3", "--logging_steps", "1", "--eval_on_start", "false", "--generation_eval_samples", "0",
       "--report_to", "none", "--save_strategy", "no", "--max_eval_samples", "8"]


def losses(output_dir) -> list[float]:
    """Each step's training loss, then each evaluation's loss (evaluation runs through the same head)."""
    history = json.loads((output_dir / "trainer_state.json").read_text())["log_history"]
    return [entry["loss"] for entry in history if "loss" in entry] + \
        [entry["eval_loss"] for entry in history if "eval_loss" in entry]


def loss_head(output_dir) -> dict:
    return outputs.read_record(output_dir, outputs.EFFECTIVE_CONFIG)["values"]["loss_head"]


@pytest.fixture(scope="module")
def hub_model(tmp_path_factory):
    return save_hub_model(tmp_path_factory.mktemp("hub"))


@pytest.mark.parametrize("model", ["tiny", "hub"])
def test_the_fused_head_trains_with_the_losses_of_the_full_logits(model, hub_model, tmp_path, monkeypatch):
    extra = [] if model == "tiny" else ["--model_name_or_path", str(hub_model)]
    fused, full = tmp_path / "fused", tmp_path / "full"
    assert main(["train", "recipes/demo.yaml", "--output_dir", str(fused), *RUN, *extra]) == 0
    with monkeypatch.context() as patched:
        patched.setattr(trainer_module, "full_logits_reason", lambda trainer: "the test's reference run")
        assert main(["train", "recipes/demo.yaml", "--output_dir", str(full), *RUN, *extra]) == 0
    assert loss_head(fused) == {"value": "fused (TRL's add_fused_lm_head: no full logits)", "source": "default"}
    assert loss_head(full) == {"value": "full logits", "source": "the test's reference run"}
    assert len(losses(fused)) == 4  # 3 steps and the final evaluation
    assert losses(fused) == pytest.approx(losses(full), rel=1e-5)


def test_label_smoothing_keeps_the_full_logits_and_says_why(tmp_path):
    assert main(["train", "recipes/demo.yaml", "--output_dir", str(tmp_path), *RUN, "--max_steps", "1",
                 "--label_smoothing_factor", "0.1"]) == 0
    assert loss_head(tmp_path) == {"value": "full logits",
                                   "source": "label smoothing (`label_smoothing_factor`) weighs every logit"}
    report = outputs.read_record(tmp_path, outputs.MEMORY_REPORT)["ranks"][0]["predicted"]["estimate"]["setup"]
    assert report["method"]["logits_held"] and not report["method"]["fused_head"]  # the plan counts them again
