"""The parallelism axes a recipe can turn on beside data parallelism, and the questions each one answers (`Axis`).

An axis is one home under finetune/train/axes/, as a method is one under finetune/train/methods/: its own recipe keys
and their checks, how many ranks share one batch, and at run time what it does to the model and, for an axis Trainer
cannot drive, the runner that takes the steps. `finetune.train.run.train` asks the recipe's axes; it names none. The
registry names where each lives and is read when an axis is named: reading a recipe imports an axis's keys and
checks, never its runner. Adding an axis is its home plus one line in `AXES`.
"""

from __future__ import annotations

import importlib
from typing import Any, ClassVar

from finetune.errors import RecipeError

# name → "module:class"; the module is imported when a recipe is read
AXES = {
    "sequence_parallel": "finetune.train.axes.sequence:SequenceParallelism",
    "tensor_parallel": "finetune.train.axes.tensor:TensorParallelism",
    "context_parallel": "finetune.train.axes.context:ContextParallelism",
    "pipeline": "finetune.train.axes.pipeline:PipelineParallelism",
}


class Axis:
    """A parallelism axis: the class says what it is, an instance holds the recipe's settings for it (`settings`, an
    instance of `arguments`), and is on when its size is above 1."""

    name: ClassVar[str]
    description: ClassVar[str]
    """One sentence for the recipe reference."""
    arguments: ClassVar[type]
    """Its recipe keys: a dataclass, documented field by field; `size_key` is one of them."""
    size_key: ClassVar[str]
    """The key giving how many processes the axis spans (a pipeline's: how many stages)."""
    runs_the_steps: ClassVar[bool] = False
    """Whether the axis runs its own loop (`run`), because Trainer cannot drive it."""
    splits_tensor_parallelism: ClassVar[bool] = False
    """Whether `tensor_parallel_size` splits the layers inside this axis's own units (a pipeline's stages) rather than
    through Transformers' sharded loading (finetune.recipe.preflight.check_parallelism's `inside_stages`)."""
    accelerate_size: ClassVar[str | None] = None
    """For a dimension of Accelerate's device mesh, its size's name in `ParallelismConfig` (`sp_size`): its size then
    comes from the recipe or from the `parallelism_config` section a launch exports (`PARALLELISM_CONFIG_SP_SIZE`), and
    is resolved with the other mesh sizes against the world size (finetune.launch.parallelism). None for an axis that
    builds its own mesh (a pipeline)."""
    launched_as: ClassVar[str | None] = None
    """The shipped strategy (finetune.launch.strategies.SHIPPED) `finetune train --gpus N` launches a recipe with this
    axis on as; None: planned as any recipe (the decision tree picks the strategy)."""
    keeps_a_named_engine: ClassVar[bool] = False
    """Whether a recipe's named DeepSpeed strategy (or `deepspeed` config) runs it, rather than `launched_as`."""
    cpu_program: ClassVar[tuple[str, ...] | None] = None
    """The program its self-launch runs on CPU processes instead of `finetune` (a CPU twin lifting a GPU-only
    check: finetune/testing/)."""

    def __init__(self, settings: Any):
        self.settings = settings

    @property
    def size(self) -> int:
        return int(getattr(self.settings, self.size_key) or 1)

    # --- reading the recipe (no runner is imported here)
    def check(self, sections, parallelism, strategy):
        """Refuses what the axis cannot run beside the rest of the recipe (`sections`: finetune.recipe.parse's
        RecipeSections) and the launch, before any process group starts; returns the strategy the launch runs."""
        return strategy

    def ranks_sharing_a_batch(self) -> int:
        """How many of the launch's processes work on one batch together (the data-parallel size divides by it). An
        axis of Accelerate's mesh is counted with the mesh's other sizes (finetune.launch.parallelism)."""
        return 1 if self.accelerate_size else self.size

    @classmethod
    def check_size(cls, size: int, model_config) -> None:
        """Refuses a size the model cannot take (an axis of Accelerate's mesh), before the sizes are resolved against
        the world size."""

    @classmethod
    def refusal_here(cls, size: int, on_gpu: bool) -> str | None:
        """Why a launch cannot run this axis at `size` on this machine at all, said before anything else is checked
        (an axis of Accelerate's mesh); None where it can."""
        return None

    def layout(self):
        """What a strategy and the estimator carry of this axis beside the engine that runs it (an axis of
        Accelerate's mesh: `label`, `describe`, `record`, `activation_share`); None for none."""
        return None

    @classmethod
    def engine_layout(cls, parallelism):
        """The layout of the engine this axis becomes at the mesh's sizes (`parallelism`), where it takes the place of
        DDP, DeepSpeed or FSDP (tensor parallelism: the model loaded sharded); None where it does not."""
        return None

    @classmethod
    def loaded_layout(cls, model):
        """The engine layout read off a loaded model (`engine_layout` as the run got it); None for other models."""
        return None

    @classmethod
    def recorded_layout(cls, record: dict):
        """The engine layout a checkpoint's marker records (`record`: its layout); None to name it by the axis."""
        return None

    @classmethod
    def files_a_resume_needs(cls, marker: dict, needs: list[list[str]]) -> list[list[str]]:
        """What a resume needs of a checkpoint this axis's run saved (finetune.checkpoints.complete): for each need,
        the names of which one must exist; `needs` are the state and RNG files every Trainer checkpoint has."""
        return needs

    @classmethod
    def plan_rows(cls, request, shape, micro_batch_size: int) -> list[dict]:
        """Its rows in `finetune plan`'s axes table (finetune.plan.decision_tree.axis_rows) for `request` on a model
        of `shape`: each with its memory per GPU and what it costs; none where it cannot run."""
        return []

    def plan_launch(self, recipe: str, overrides: list[str], machine, sections) -> dict | None:
        """The plan record of a self-launch (`finetune train --gpus N`, finetune.plan.launch) of a recipe with this
        axis on: its memory per rank against `machine`; None to launch it as the recipe names it, unplanned."""
        return None

    # --- the run (finetune.train.run.train calls these in order)
    def before_loading(self, recipe) -> None:
        """Checks that must hold on every rank before hours of loading (a shared output_dir, ...)."""

    def loads_shapes_only(self, recipe) -> bool:
        """Whether this rank builds the model's shapes only and reads its own tensors later (`prepare_model`)."""
        return False

    def prepare_model(self, recipe, model):
        """What this rank trains: the model as Trainer receives it, or, for an axis with a runner, its part of it."""
        return model

    def prepare_training(self, recipe, model) -> None:
        """Before Trainer is built, with the model loaded: what the axis sets in `recipe.training` (Accelerate's
        `parallelism_config`) or starts (a communication layer)."""

    def collator(self, collator, tokenizer, recipe):
        """The batches Trainer is fed under this axis: `collator`'s, or a wrapper of it."""
        return collator

    def trainer_built(self, trainer) -> None:
        """With Trainer built, before it trains: a loss or gradient fix-up the axis's engine needs
        (`trainer.gradient_excess`, finetune.train.trainer)."""

    @classmethod
    def running_size(cls, trainer) -> int:
        """The axis's size in the run Trainer prepared (an axis of Accelerate's mesh: its `ParallelismConfig`)."""
        mesh = getattr(getattr(trainer, "accelerator", None), "parallelism_config", None)
        return int(getattr(mesh, cls.accelerate_size or "", 1) or 1)

    def run(self, recipe, model, prepared, tokenizer, data, resume: str | None, host_load_bytes: int | None) -> dict:
        """The whole run of this rank (an axis with `runs_the_steps`): train, evaluate, save, write the records a
        Trainer run writes; returns the run summary."""
        raise NotImplementedError


def axis_class(name: str) -> type[Axis]:
    """The axis registered as `name`, imported now."""
    module, _, attribute = AXES[name].partition(":")
    return getattr(importlib.import_module(module), attribute)


def all_axes() -> list[type[Axis]]:
    return [axis_class(name) for name in AXES]


def axis_sections() -> tuple[type, ...]:
    """Every registered axis's keys, all known keys of a recipe."""
    return tuple(axis.arguments for axis in all_axes())


def active_axes(inputs: dict[type, dict[str, Any]], build) -> tuple[Axis, ...]:
    """The recipe's axes that are on (size above 1), their settings built from the parsed `inputs` by `build` (a
    section class and its values → the section). At most one of them may run its own steps."""
    axes = tuple(axis(build(axis.arguments, inputs[axis.arguments])) for axis in all_axes())
    on = tuple(axis for axis in axes if axis.size > 1)
    runners = [axis for axis in on if axis.runs_the_steps]
    if len(runners) > 1:
        names = " and ".join(f"`{axis.size_key}`" for axis in runners)
        raise RecipeError(f"{names} each run their own training loop: keep one of them.")
    return on


def on_the_mesh(axes: tuple[Axis, ...], parallelism) -> tuple[Axis, ...]:
    """`axes` with each axis of Accelerate's mesh at the size resolved for the launch (`parallelism`,
    finetune.launch.parallelism): one the launch's config names and the recipe does not is added, one resolved to 1
    dropped."""
    kept = [axis for axis in axes if not axis.accelerate_size]
    given = {type(axis): axis for axis in axes}
    for cls in mesh_axes():
        size = parallelism.size(cls.size_key)
        if size > 1:
            axis = given.get(cls) or cls(cls.arguments())
            setattr(axis.settings, cls.size_key, size)
            kept.append(axis)
    order = list(AXES)
    return tuple(sorted(kept, key=lambda axis: order.index(axis.name)))


def axes_collator(recipe, tokenizer, collator):
    """`collator` as the recipe's axes feed Trainer with it (`Axis.collator`)."""
    for axis in recipe.axes:
        collator = axis.collator(collator, tokenizer, recipe)
    return collator


def mesh_axes() -> list[type[Axis]]:
    """The registered axes that are dimensions of Accelerate's device mesh (`accelerate_size`)."""
    return [axis for axis in all_axes() if axis.accelerate_size]


def runner_of(axes: tuple[Axis, ...]) -> Axis | None:
    """The axis that takes the training steps, or None: Trainer takes them."""
    return next((axis for axis in axes if axis.runs_the_steps), None)
