"""The training-method seam (finetune.recipe.methods): a method added as its own file plus one registry line trains
through `train()` unchanged, its keys are parsed and documented, and a key of another method is refused naming it."""

import json
from dataclasses import dataclass, field

import pytest
from transformers import TrainerCallback

from finetune.errors import RecipeError
from finetune.recipe import methods, parse_recipe
from finetune.recipe.parse import RecipeParser
from finetune.train.methods.sft import SupervisedFineTuning
from finetune.train.trainer import FinetuneTrainer

DEMO = "recipes/demo.yaml"


@dataclass
class ToyArguments:
    toy_loss_scale: float = field(default=1.0, metadata={"help": "Toy: the SFT loss times this."})


class ScaledLossTrainer(FinetuneTrainer):
    def __init__(self, *args, loss_scale: float, **kwargs):
        super().__init__(*args, **kwargs)
        self.loss_scale = loss_scale

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        if return_outputs:
            return loss[0] * self.loss_scale, loss[1]
        return loss * self.loss_scale


class StepCounter(TrainerCallback):
    def __init__(self):
        self.steps = 0

    def on_step_end(self, args, state, control, **kwargs):
        self.steps += 1


class ToyMethod(SupervisedFineTuning):
    """SFT with a scaled loss: its own key, its own trainer and callback, through the seam alone."""

    name = "toy"
    description = "supervised fine-tuning with a scaled loss (a test of the seam)"
    arguments = ToyArguments

    def callbacks(self, recipe, tokenizer, data) -> list:
        self.counter = StepCounter()
        return [*super().callbacks(recipe, tokenizer, data), self.counter]

    def trainer_class(self) -> type:
        return ScaledLossTrainer

    def trainer_options(self) -> dict:
        return {"loss_scale": self.settings.toy_loss_scale}


@pytest.fixture
def toy_registered(monkeypatch):
    monkeypatch.setitem(methods.METHODS, "toy", f"{__name__}:ToyMethod")


def test_a_toy_method_trains_through_the_seam_without_touching_train(toy_registered, tmp_path):
    from finetune.train.run import train

    common = ["--max_steps", "3", "--logging_steps", "1", "--eval_on_start", "false", "--generation_eval_samples",
              "2", "--max_eval_samples", "4", "--weight_decay", "0", "--report_to", "none", "--disable_tqdm", "true"]
    losses = {}
    for scale in ("0", "1"):
        output_dir = tmp_path / f"scale{scale}"
        recipe = parse_recipe(DEMO, ["--method", "toy", "--toy_loss_scale", scale, "--output_dir", str(output_dir),
                                     *common])
        assert isinstance(recipe.method, ToyMethod) and recipe.method.settings.toy_loss_scale == float(scale)
        summary = train(recipe)
        assert summary["method"] == "toy" and recipe.method.counter.steps == 3  # its own callback ran
        assert json.loads((output_dir / "eval_results.json").read_text())["method"] == "toy"
        assert "exact_match" in json.dumps(summary)  # SFT's generation scoring, inherited
        losses[scale] = summary["train_loss"]
    assert losses["0"] == 0.0 and losses["1"] > 1.0  # the toy's loss is what trained


def test_a_methods_keys_are_known_documented_and_refused_under_another_method(toy_registered):
    assert "toy_loss_scale" in RecipeParser().known_keys()
    with pytest.raises(RecipeError, match=r"^`toy_loss_scale` configures `method: toy` but `method` is sft: set "
                                          r"`method: toy` \(or drop `toy_loss_scale`\)"):
        parse_recipe(DEMO, ["--toy_loss_scale", "0.5"])
    from finetune.recipe.docs import recipe_reference

    reference = recipe_reference()
    assert "### `method: toy`" in reference and "| `toy_loss_scale` | `1.0` | Toy: the SFT loss times this. |" in \
        reference


def test_a_key_several_methods_use_names_them_all_under_another_method():
    """dpo.yaml's `beta: 0.1` under `--method reward` (which has no beta): every method using it is named, not the
    one whose default happens to differ (GRPO's 0)."""
    with pytest.raises(RecipeError, match=r"^`beta` configures methods dpo, kto, cpo, orpo and grpo, not `method: "
                                          r"reward`, which has no use for it: drop `beta`, or set `method` to one of "
                                          r"those\.$"):
        parse_recipe("recipes/dpo.yaml", ["--method", "reward"])


def test_an_unregistered_method_is_refused_with_the_closest_name():
    with pytest.raises(RecipeError, match=r"^`method: sftt` is not one of sft, dpo, reward, .*"
                                          r"\(did you mean `sft`\?\)"):
        parse_recipe(DEMO, ["--method", "sftt"])


def test_the_method_is_read_once_from_the_command_line_over_the_file(tmp_path):
    recipe = tmp_path / "dpo.yaml"
    recipe.write_text("method: dpo\n")
    assert parse_recipe(recipe, []).method.name == "dpo"
    assert parse_recipe(recipe, ["--method", "sft"]).method.name == "sft"
    assert parse_recipe(recipe, ["--method=sft"]).method.name == "sft"
