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
        """How many of the launch's processes work on one batch together (the data-parallel size divides by it)."""
        return self.size

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


def runner_of(axes: tuple[Axis, ...]) -> Axis | None:
    """The axis that takes the training steps, or None: Trainer takes them."""
    return next((axis for axis in axes if axis.runs_the_steps), None)
