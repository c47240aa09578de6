"""The parallelism-axis seam (finetune.axes): an axis added as its own home plus one registry line is read from
the recipe with its own keys and checks, documented, and trains through `train()` unchanged, whether it prepares the
model Trainer trains or runs the steps in its own loop; two axes that each run their own loop are refused."""

import json
from dataclasses import dataclass, field

import pytest
import torch

from finetune import axes, outputs
from finetune.axes import Axis
from finetune.errors import RecipeError
from finetune.recipe import parse_recipe
from finetune.recipe.parse import RecipeParser

DEMO = "recipes/demo.yaml"
COMMON = ["--max_steps", "4", "--logging_steps", "1", "--eval_on_start", "false", "--generation_eval_samples", "0",
          "--max_eval_samples", "4", "--report_to", "none", "--disable_tqdm", "true", "--learning_rate", "1e-3",
          "--warmup_steps", "0"]


@dataclass
class ToyLoopArguments:
    toy_loop_size: int | None = field(default=None, metadata={"help": "Toy: take the steps in the toy's own loop."})
    toy_loop_learning_rate: float = field(default=0.01, metadata={"help": "Toy: its loop's Adam rate."})


class ToyLoop(Axis):
    """An axis Trainer cannot drive: plain Adam in its own loop, over the method's data and collator."""

    name = "toy_loop"
    description = "the steps taken in a loop of the toy's own (a test of the seam)"
    arguments = ToyLoopArguments
    size_key = "toy_loop_size"
    runs_the_steps = True

    def ranks_sharing_a_batch(self) -> int:
        return 1  # each process its own batches

    def check(self, sections, parallelism, strategy):
        if sections.lora.use_lora:
            raise RecipeError("`toy_loop_size` with LoRA: the toy loop trains every weight; drop `use_lora`.")
        return strategy

    def prepare_model(self, recipe, model):
        self.before = {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}
        return model

    def run(self, recipe, model, prepared, tokenizer, data, resume, host_load_bytes):
        from torch.utils.data import DataLoader

        from finetune.data.collate import data_collator

        args = recipe.training
        loader = DataLoader(data.train.select_columns(["input_ids", "labels"]),
                            batch_size=args.per_device_train_batch_size, collate_fn=data_collator(tokenizer))
        optimizer = torch.optim.Adam(prepared.parameters(), lr=self.settings.toy_loop_learning_rate)
        losses = []
        for _, batch in zip(range(args.max_steps), loader, strict=False):
            loss = prepared(**batch).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        summary = {"method": recipe.method.name, "runner": self.name, "losses": losses}
        outputs.write_record(args.output_dir, outputs.EVAL_RESULTS, summary)
        return summary


@dataclass
class ToyFrozenArguments:
    toy_frozen_size: int | None = field(default=None, metadata={"help": "Toy: freeze the input embedding."})


class ToyFrozenEmbedding(Axis):
    """An axis Trainer drives: it only prepares the model Trainer is given (its input embedding frozen)."""

    name = "toy_frozen"
    description = "the input embedding frozen before Trainer trains (a test of the seam)"
    arguments = ToyFrozenArguments
    size_key = "toy_frozen_size"

    def ranks_sharing_a_batch(self) -> int:
        return 1

    def prepare_model(self, recipe, model):
        embedding = model.get_input_embeddings().weight
        embedding.requires_grad_(False)
        self.embedding = embedding.detach().clone()
        self.before = {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}
        self.calls = ["prepare_model"]
        return model

    def prepare_training(self, recipe, model):
        self.calls.append("prepare_training")

    def collator(self, collator, tokenizer, recipe):
        self.calls.append("collator")
        self.batches = 0

        def counted(features):
            self.batches += 1
            return collator(features)

        return counted

    def trainer_built(self, trainer):
        self.calls.append("trainer_built")
        self.trainer = trainer
        trainer.gradient_excess = lambda trainer: 2  # its engine would apply the gradient twice


@pytest.fixture
def toys_registered(monkeypatch):
    monkeypatch.setitem(axes.AXES, "toy_loop", f"{__name__}:ToyLoop")
    monkeypatch.setitem(axes.AXES, "toy_frozen", f"{__name__}:ToyFrozenEmbedding")


def test_an_axis_with_its_own_loop_trains_through_the_seam_without_touching_train(toys_registered, tmp_path):
    from finetune.train.run import train

    recipe = parse_recipe(DEMO, ["--toy_loop_size", "2", "--toy_loop_learning_rate", "0.02", "--output_dir",
                                 str(tmp_path), *COMMON])
    assert [type(axis) for axis in recipe.axes] == [ToyLoop] and recipe.runner is recipe.axes[0]
    assert recipe.runner.settings.toy_loop_learning_rate == 0.02
    summary = train(recipe)
    assert summary["runner"] == "toy_loop" and len(summary["losses"]) == 4  # its loop took every step
    assert summary["losses"][-1] < summary["losses"][0] - 0.5  # and trained
    assert json.loads((tmp_path / outputs.EVAL_RESULTS).read_text())["runner"] == "toy_loop"
    assert not (tmp_path / "trainer_state.json").exists()  # Trainer took no step
    assert (tmp_path / outputs.DATA_SUMMARY).is_file()  # the story around the loop is train()'s own


def test_an_axis_that_prepares_the_model_trains_under_trainer_through_the_seam(toys_registered, tmp_path):
    from finetune.train.run import train

    recipe = parse_recipe(DEMO, ["--toy_frozen_size", "2", "--output_dir", str(tmp_path), *COMMON])
    assert [type(axis) for axis in recipe.axes] == [ToyFrozenEmbedding] and recipe.runner is None
    summary = train(recipe)
    axis = recipe.axes[0]
    losses = [entry["loss"] for entry in json.loads((tmp_path / "trainer_state.json").read_text())["log_history"]
              if "loss" in entry]
    assert len(losses) == 4 and summary["train_loss"] > 0  # Trainer took the steps
    from transformers import AutoModelForCausalLM

    saved = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert torch.equal(saved.get_input_embeddings().weight, axis.embedding)  # the axis's preparation held
    changed = [name for name, tensor in saved.state_dict().items() if name in axis.before
               and not torch.equal(tensor, axis.before[name])]
    assert any("layers.0" in name for name in changed)  # while the rest trained
    # its run hooks, in train()'s order: the batches Trainer trained on came through its collator, and the gradient
    # fix-up it set was read at the first step
    assert axis.calls == ["prepare_model", "prepare_training", "collator", "trainer_built"]
    assert axis.batches >= 4 and axis.trainer._gradient_excess == 2


def test_an_axis_of_accelerates_mesh_is_its_home_and_one_registry_line(monkeypatch):
    """A mesh axis (`accelerate_size`) registered in one line is a size of the mesh: read from the recipe or from the
    variable `accelerate launch` exports for it, resolved with the others against the world size, put on the recipe's
    axes when the launch alone names it, carried beside the engine by its layout; finetune.launch.parallelism is not
    touched."""
    from finetune.axes import on_the_mesh
    from finetune.launch.parallelism import Parallelism, describe_as_accelerate, requested, resolve, variable

    monkeypatch.setitem(axes.AXES, "toy_mesh", f"{__name__}:ToyMesh")
    mesh = Parallelism(toy_mesh_size=2, dp_shard_size=2)
    assert (mesh.total, mesh.ranks_sharing_a_batch, mesh.named) == (4, 2, True)
    assert variable("toy_mesh_size") == "PARALLELISM_CONFIG_TOY_SIZE"
    assert describe_as_accelerate(mesh) == "dp_shard 2 × toy 2"
    assert mesh.beside_the_engine() == (ToyShare(2),)
    launched = {"ACCELERATE_USE_PARALLELISM_CONFIG": "true", "PARALLELISM_CONFIG_TOY_SIZE": "2"}
    asked, sources = requested({}, launched)
    assert asked == Parallelism(toy_mesh_size=2) and sources == {"toy_mesh_size": "Accelerate config"}
    resolved = resolve(asked, sources, world_size=4)
    assert resolved == mesh  # the ranks it leaves are sharded data parallelism
    on = on_the_mesh((), resolved)
    assert [type(axis) for axis in on] == [ToyMesh] and on[0].size == 2
    with pytest.raises(RecipeError, match="`toy_mesh_size: 4` in the recipe, but the Accelerate config launched "
                                          "parallelism_config_toy_size: 2"):
        requested({"toy_mesh_size": 4}, launched)
    with pytest.raises(RecipeError, match="multiply to the world size"):
        resolve(Parallelism(toy_mesh_size=3), {"toy_mesh_size": "recipe", "dp_shard_size": "recipe"}, 4)


@dataclass
class ToyMeshArguments:
    toy_mesh_size: int | None = field(default=None, metadata={"help": "Toy: a dimension of Accelerate's mesh."})


@dataclass(frozen=True)
class ToyShare:
    toy_mesh_size: int


class ToyMesh(Axis):
    name = "toy_mesh"
    description = "a dimension of Accelerate's mesh (a test of the seam)"
    arguments = ToyMeshArguments
    size_key = "toy_mesh_size"
    accelerate_size = "toy_size"

    def layout(self):
        return ToyShare(self.size)


def test_an_axis_keys_are_known_documented_and_checked(toys_registered):
    assert {"toy_loop_size", "toy_loop_learning_rate", "toy_frozen_size"} <= RecipeParser().known_keys()
    from finetune.recipe.docs import recipe_reference

    reference = recipe_reference()
    assert "### `toy_loop_size`" in reference
    assert "| `toy_loop_learning_rate` | `0.01` | Toy: its loop's Adam rate. |" in reference
    assert parse_recipe(DEMO, ["--toy_loop_learning_rate", "0.1"]).axes == ()  # off: its size is not above 1
    with pytest.raises(RecipeError, match=r"^`toy_loop_size` with LoRA: the toy loop trains every weight"):
        parse_recipe(DEMO, ["--toy_loop_size", "2", "--use_lora", "true"])


def test_two_axes_that_each_run_their_own_loop_are_refused(toys_registered, monkeypatch):
    monkeypatch.setattr(ToyFrozenEmbedding, "runs_the_steps", True)
    with pytest.raises(RecipeError, match=r"^`toy_loop_size` and `toy_frozen_size` each run their own training loop: "
                                          r"keep one of them\.$"):
        parse_recipe(DEMO, ["--toy_loop_size", "2", "--toy_frozen_size", "2"])


def test_an_axis_keys_are_recorded_with_the_recipe_a_checkpoint_compares_on_resume(toys_registered, tmp_path):
    from finetune.checkpoints.complete import recipe_values

    recipe = parse_recipe(DEMO, ["--toy_loop_size", "2", "--toy_loop_learning_rate", "0.02", "--output_dir",
                                 str(tmp_path), *COMMON])
    values = recipe_values(recipe)
    assert values["toy_loop_size"] == "2" and values["toy_loop_learning_rate"] == "0.02"
