"""The losses from TRL's fused LM head (`add_fused_lm_head`): SFT's (finetune.train.trainer.FinetuneTrainer) and the
reference-free pair methods' (CPO and ORPO: finetune.train.methods.reference_free_trainer) equal the full logits'
(`fused_lm_head: false`), on the embedded tiny model and on a hub-shaped bf16 checkpoint (untied head, grouped-query
attention); the effective config names the head and, where a feature needs the full logits, why; the methods whose
trainers have no full-logits path refuse the key."""

import json

import pytest
from hub_fixtures import save_hub_model

from finetune import outputs
from finetune.cli import main
from finetune.errors import RecipeError
from finetune.recipe.parse import parse_recipe

RUN = ["--max_steps", "3", "--logging_steps", "1", "--eval_on_start", "false", "--generation_eval_samples", "0",
       "--report_to", "none", "--save_strategy", "no", "--max_eval_samples", "8"]


def losses(output_dir) -> list[float]:
    """Each step's training loss, then each evaluation's loss (evaluation runs through the same head)."""
    history = json.loads((output_dir / "trainer_state.json").read_text())["log_history"]
    return [entry["loss"] for entry in history if "loss" in entry] + \
        [entry["eval_loss"] for entry in history if "eval_loss" in entry]


def loss_head(output_dir) -> dict:
    return outputs.read_record(output_dir, outputs.EFFECTIVE_CONFIG)["values"]["loss_head"]


def trained_both_ways(tmp_path, extra: list[str]):
    """The same 3 steps through the fused head and from the full logits: each run's head named in its effective
    config, and the same losses (steps and the final evaluation) to 1e-5 relative."""
    fused, full = tmp_path / "fused", tmp_path / "full"
    assert main(["train", "recipes/demo.yaml", "--output_dir", str(fused), *RUN, *extra]) == 0
    assert main(["train", "recipes/demo.yaml", "--output_dir", str(full), *RUN, *extra, "--fused_lm_head",
                 "false"]) == 0
    assert loss_head(fused) == {"value": "fused (TRL's add_fused_lm_head: no full logits)", "source": "default"}
    assert loss_head(full) == {"value": "full logits", "source": "`fused_lm_head: false`"}
    assert len(losses(fused)) == 4  # 3 steps and the final evaluation
    assert losses(fused) == pytest.approx(losses(full), rel=1e-5)
    return fused, full


@pytest.fixture(scope="module")
def hub_model(tmp_path_factory):
    return save_hub_model(tmp_path_factory.mktemp("hub"))


@pytest.mark.parametrize("model", ["tiny", "hub"])
def test_the_fused_head_trains_with_the_losses_of_the_full_logits(model, hub_model, tmp_path):
    extra = [] if model == "tiny" else ["--model_name_or_path", str(hub_model)]
    fused, full = trained_both_ways(tmp_path, extra)
    report = outputs.read_record(full, outputs.MEMORY_REPORT)["ranks"][0]["predicted"]["estimate"]["setup"]
    assert report["method"]["logits_held"] and not report["method"]["fused_head"]  # the plan counts them again


# CPO's default loss (sigmoid) with its NLL term over the answers and summed log-probabilities; ORPO with its NLL over
# the whole chosen sequence and per-token mean log-probabilities. Each logs its preference terms every step.
PAIRS = {"cpo": ["--method", "cpo", "--cpo_alpha", "1"], "orpo": ["--method", "orpo", "--beta", "0.2"]}
PAIR_METRICS = ("rewards/chosen", "rewards/rejected", "logps/chosen", "logps/rejected", "nll_loss")


def logged(output_dir, keys) -> list[float]:
    history = json.loads((output_dir / "trainer_state.json").read_text())["log_history"]
    return [entry[key] for entry in history for key in keys if key in entry]


@pytest.mark.parametrize(("method", "model"), [("cpo", "tiny"), ("cpo", "hub"), ("orpo", "tiny")])
def test_cpo_and_orpo_through_the_fused_head_train_with_the_full_logits_losses(method, model, hub_model, tmp_path):
    extra = [*PAIRS[method], "--per_device_train_batch_size", "4", "--learning_rate", "1e-3", "--warmup_steps", "0",
             *([] if model == "tiny" else ["--model_name_or_path", str(hub_model)])]
    fused, full = trained_both_ways(tmp_path, extra)
    metrics = logged(fused, PAIR_METRICS)
    assert len(metrics) == 3 * len(PAIR_METRICS) and metrics == pytest.approx(logged(full, PAIR_METRICS), rel=1e-5)
    setup = outputs.read_record(fused, outputs.MEMORY_REPORT)["ranks"][0]["predicted"]["estimate"]["setup"]
    assert setup["method"]["fused_head"] and not setup["method"]["logits_held"]


@pytest.mark.parametrize("method", ["dpo", "kto", "grpo", "reward"])
def test_methods_without_a_full_logits_path_refuse_fused_lm_head_false(method, tmp_path):
    with pytest.raises(RecipeError, match=rf"`fused_lm_head: false` with `method: {method}`: its trainer has no "
                                          "full-logits path"):
        parse_recipe("recipes/demo.yaml", ["--method", method, "--fused_lm_head", "false", "--output_dir",
                                           str(tmp_path)])


def test_label_smoothing_keeps_the_full_logits_and_says_why(tmp_path):
    assert main(["train", "recipes/demo.yaml", "--output_dir", str(tmp_path), *RUN, "--max_steps", "1",
                 "--label_smoothing_factor", "0.1"]) == 0
    assert loss_head(tmp_path) == {"value": "full logits",
                                   "source": "label smoothing (`label_smoothing_factor`) weighs every logit"}
    report = outputs.read_record(tmp_path, outputs.MEMORY_REPORT)["ranks"][0]["predicted"]["estimate"]["setup"]
    assert report["method"]["logits_held"] and not report["method"]["fused_head"]  # the plan counts them again


def test_liger_keeps_trls_fused_head_unless_the_recipe_names_its_fused_loss():
    """Liger's patch replaces the model's forward with its own fused loss by default, which would drop TRL's head (and
    its `fused_lm_head=True` call): that kernel is turned off, unless the recipe names it, which then computes the
    loss from the full-logits path's forward."""
    from types import SimpleNamespace

    from finetune.train.trainer import LIGER_LOSS, full_logits_reason, keep_the_fused_head_under_liger

    args = SimpleNamespace(use_liger_kernel=True, liger_kernel_config={"rms_norm": True})
    keep_the_fused_head_under_liger(args)
    assert args.liger_kernel_config == {"rms_norm": True, "fused_linear_cross_entropy": False}
    off = SimpleNamespace(use_liger_kernel=False, liger_kernel_config=None)
    keep_the_fused_head_under_liger(off)
    assert off.liger_kernel_config is None
    named = SimpleNamespace(use_liger_kernel=True, fused_lm_head=True,
                            liger_kernel_config='{"fused_linear_cross_entropy": true}')  # as a command line gives it
    assert full_logits_reason(SimpleNamespace(args=named)) == LIGER_LOSS
