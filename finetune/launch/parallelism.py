"""Accelerate's device mesh: the sizes of its axes beyond plain data parallelism, under the names users know from
axolotl: sharded and replicated data (`dp_shard_size`, `dp_replicate_size`), and every axis on the seam that is a
dimension of that mesh (finetune.axes, `accelerate_size`: their homes under finetune/train/axes/ hold their keys,
checks, run hooks and, for one that takes the engine's place, its layout).

The engines are Transformers' and Accelerate's: a tensor-parallel model is loaded sharded by `from_pretrained(...,
distributed_config=...)` (finetune.train.axes.tensor.layout), and Trainer builds Accelerate's `ParallelismConfig` from
it. This module reads the sizes (from the recipe or from the variables `accelerate launch` exports for a config's
`parallelism_config` section) and resolves them against the launch.
"""

from __future__ import annotations

import math
import os
from typing import Any

from finetune.errors import RecipeError

# The data-parallel sizes of Accelerate's device mesh, ranks that see different batches (recipe key -> the size's name
# in Accelerate's `ParallelismConfig`); every registered axis of that mesh adds its own (finetune.axes,
# `accelerate_size`).
DATA_SIZES = {
    "dp_shard_size": "dp_shard_size",
    "dp_replicate_size": "dp_replicate_size",
}
ACCELERATE_ORDER = ("dp_replicate_size", "dp_shard_size", "cp_size", "sp_size", "tp_size")  # how Accelerate lists them


def accelerate_names() -> dict[str, str]:
    """Every mesh size a recipe may give (its key) -> its name in Accelerate's `ParallelismConfig`: each registered
    mesh axis's, then the data-parallel sizes."""
    from finetune.axes import mesh_axes

    return {**{axis.size_key: axis.accelerate_size for axis in mesh_axes()}, **DATA_SIZES}


def variable(key: str) -> str:
    """The variable `accelerate launch` exports a size in (accelerate/utils/launch.py,
    `prepare_extend_env_parallelism_config`; `ParallelismConfig.__post_init__` reads it back)."""
    return f"PARALLELISM_CONFIG_{accelerate_names()[key].upper()}"


def config_key(key: str) -> str:
    """A size's key in an Accelerate config's `parallelism_config` section."""
    return f"parallelism_config_{accelerate_names()[key]}"


class Parallelism:
    """The size of each axis of Accelerate's device mesh (by recipe key, 1 where not given); their product is the
    world size. Plain data parallelism (DDP, ZeRO, FSDP through Accelerate's own configs) is all 1 here: only a run
    that names an axis gets a mesh from this module. Immutable: `replaced` gives another."""

    __slots__ = ("_sizes", "bf16")

    def __init__(self, bf16: bool = False, **sizes: int):
        known = accelerate_names()
        unknown = sorted(set(sizes) - set(known))
        if unknown:
            raise TypeError(f"no mesh axis {', '.join(unknown)}; known: {', '.join(known)}")
        self._sizes = tuple((key, int(sizes[key])) for key in known if key in sizes and int(sizes[key]) != 1)
        self.bf16 = bf16  # the run's mixed precision: FSDP2 gathers the slices in bf16 (not compared)

    def size(self, key: str) -> int:
        return dict(self._sizes).get(key, 1)

    def replaced(self, bf16: bool | None = None, **sizes: int) -> Parallelism:
        return Parallelism(bf16=self.bf16 if bf16 is None else bf16, **{**self.to_dict(), **sizes})

    def __eq__(self, other) -> bool:
        return isinstance(other, Parallelism) and self._sizes == other._sizes

    def __hash__(self) -> int:
        return hash(self._sizes)

    def __repr__(self) -> str:
        return f"Parallelism({', '.join(f'{key}={size}' for key, size in self._sizes)})"

    @property
    def dp_shard_size(self) -> int:
        return self.size("dp_shard_size")

    @property
    def dp_replicate_size(self) -> int:
        return self.size("dp_replicate_size")

    @property
    def total(self) -> int:
        return math.prod(size for _, size in self._sizes)

    @property
    def data_parallel_size(self) -> int:
        """Ranks that see different batches: the sharded and replicated data axes (the other axes' ranks share one)."""
        return self.dp_shard_size * self.dp_replicate_size

    @property
    def ranks_sharing_a_batch(self) -> int:
        return self.total // self.data_parallel_size

    def engine(self):
        """The layout of the mesh axis that takes the engine's place at these sizes (`Axis.engine_layout`: tensor
        parallelism, which Transformers loads sharded), or None: Accelerate's own engines run the mesh."""
        from finetune.axes import mesh_axes

        return next((layout for layout in (axis.engine_layout(self) for axis in mesh_axes()) if layout is not None),
                    None)

    @property
    def loads_sharded(self) -> bool:
        """Transformers shards the model while loading it (`distributed_config`)."""
        return self.engine() is not None

    @property
    def named(self) -> bool:
        """Whether any axis beyond plain data parallelism is asked for."""
        return any(key not in DATA_SIZES for key, _ in self._sizes)

    def describe(self) -> str:
        """`dp_replicate_size 2 × dp_shard_size 4`: the axes above 1, as the recipe names them."""
        return " × ".join(f"{key} {size}" for key, size in self._sizes) or "no parallelism axis"

    def to_dict(self) -> dict[str, int]:
        """Every size a recipe may give, by its key."""
        return {key: self.size(key) for key in accelerate_names()}

    def by_accelerate_name(self) -> dict[str, int]:
        """The sizes above 1 by their names in Accelerate's `ParallelismConfig` (`tp_size`, `sp_size`, ...)."""
        names = accelerate_names()
        return {names[key]: size for key, size in self._sizes}

    @classmethod
    def from_accelerate_names(cls, sizes: dict[str, Any], source: str) -> Parallelism:
        """From sizes named as Accelerate names them (a shipped strategy's, a prepared `ParallelismConfig`'s)."""
        keys = {name: key for key, name in accelerate_names().items()}
        return cls(**{keys[name]: process_count(keys[name], size, source) or 1 for name, size in sizes.items()
                      if name in keys})

    def beside_the_engine(self) -> tuple:
        """The layouts of the mesh axes on here that a strategy carries beside its engine (sequence parallelism's
        under DeepSpeed), in the registry's order."""
        from finetune.axes import mesh_axes

        return tuple(layout for layout in (axis(axis.arguments(**{axis.size_key: self.size(axis.size_key)})).layout()
                                           for axis in mesh_axes() if self.size(axis.size_key) > 1)
                     if layout is not None)

    def distributed_config(self):
        """Transformers' `DistributedConfig` that loads the model sharded, as the engine's axis builds it."""
        return self.engine().distributed_config(self.bf16)


def requested(training_inputs: dict[str, Any], environ=None) -> tuple[Parallelism, dict[str, str]]:
    """The sizes the recipe names, else those the launch exports (an Accelerate config's `parallelism_config`), and
    where each came from. A size both name differently is a RecipeError naming both."""
    environ = os.environ if environ is None else environ
    from_launch = is_parallelism_launch(environ)
    sizes: dict[str, int] = {}
    sources: dict[str, str] = {}
    for key in accelerate_names():
        launched = process_count(key, environ.get(variable(key)), "the launch's Accelerate config") \
            if from_launch else None
        asked = process_count(key, training_inputs.get(key), "the recipe")
        if asked is not None and launched not in (None, 1) and asked != launched:
            raise RecipeError(f"`{key}: {asked}` in the recipe, but the Accelerate config launched "
                              f"{config_key(key)}: {launched}; give one of them.")
        value = asked if asked is not None else launched
        if value is not None:
            sizes[key] = value
            sources[key] = "recipe" if asked is not None else "Accelerate config"
    return Parallelism(**sizes), sources


def from_accelerate_section(section: dict[str, Any], source: str) -> Parallelism:
    """The sizes of an Accelerate config's `parallelism_config` section (all 1 without one)."""
    return Parallelism(**{key: process_count(key, section.get(config_key(key)), source) or 1
                          for key in accelerate_names()})


def prepared_mesh(config) -> Parallelism:
    """The mesh axes' sizes of the `ParallelismConfig` Accelerate prepared (all 1 for None)."""
    from finetune.axes import mesh_axes

    if config is None:
        return Parallelism()
    return Parallelism(**{axis.size_key: int(getattr(config, axis.accelerate_size, 1) or 1) for axis in mesh_axes()})


def running_mesh(trainer) -> Parallelism:
    """The mesh axes' sizes the run Trainer prepared runs with, each as its axis reads it (`Axis.running_size`)."""
    from finetune.axes import mesh_axes

    return Parallelism(**{axis.size_key: axis.running_size(trainer) for axis in mesh_axes()})


def launched_section(environ=None) -> dict[str, str]:
    """The `parallelism_config` section `accelerate launch` exported to this process (empty when none)."""
    environ = os.environ if environ is None else environ
    if not is_parallelism_launch(environ):
        return {}
    return {config_key(key): environ[variable(key)] for key in accelerate_names() if variable(key) in environ}


def is_parallelism_launch(environ=None) -> bool:
    environ = os.environ if environ is None else environ
    return str(environ.get("ACCELERATE_USE_PARALLELISM_CONFIG", "")).lower() == "true"


def launched(environ=None) -> Parallelism | None:
    """The sizes `accelerate launch` exported for a config's `parallelism_config` section (None without one)."""
    environ = os.environ if environ is None else environ
    if not is_parallelism_launch(environ):
        return None
    return Parallelism(**{key: process_count(key, environ.get(variable(key)), "the launch's Accelerate config") or 1
                          for key in accelerate_names()})


def describe_as_accelerate(parallelism: Parallelism) -> str:
    """`dp_replicate 2 × dp_shard 2`: the sizes above 1 as an Accelerate config names them (`all 1` for none)."""
    names = accelerate_names()
    order = sorted(names, key=lambda key: ACCELERATE_ORDER.index(names[key]) if names[key] in ACCELERATE_ORDER
                   else len(ACCELERATE_ORDER))
    named = [f"{names[key].removesuffix('_size')} {parallelism.size(key)}" for key in order
             if parallelism.size(key) > 1]
    return " × ".join(named) or "all 1"


def process_count(key: str, value, where: str) -> int | None:
    """A size an axis is given (None when not given); anything but a whole number ≥ 1 is refused, naming `key`."""
    if value in (None, ""):
        return None
    try:
        size = int(value)
    except (TypeError, ValueError):
        raise RecipeError(f"`{key}` in {where} must be a whole number of processes, got {value!r}.") from None
    if size < 1 or size != float(value):
        raise RecipeError(f"`{key}` in {where} must be a whole number of processes ≥ 1, got {value!r}.")
    return size


def requested_on(training_inputs: dict[str, Any], on_gpu: bool, world_size: int, model_config=None,
                 environ=None) -> tuple[Parallelism, dict[str, str]]:
    """`requested` and `resolve` for a launch of `world_size` processes: an axis this machine cannot run at all (a
    mesh axis's `refusal_here`: context parallelism without GPUs) is refused first, in one line, whatever else is
    wrong, then a size the model cannot take (`check_size`: TP's heads; `model_config`: a callable giving the
    model's config);
    data-parallel sizes in a recipe that names no other axis are refused (Accelerate's FSDP configs say how plain FSDP
    shards)."""
    from finetune.axes import mesh_axes

    asked, sources = requested(training_inputs, environ)
    for axis in mesh_axes():
        refusal = axis.refusal_here(asked.size(axis.size_key), on_gpu) if asked.size(axis.size_key) > 1 else None
        if refusal:
            raise RecipeError(refusal)
    recipe_data_sizes = [key for key in DATA_SIZES if sources.get(key) == "recipe"]
    if recipe_data_sizes and not asked.named:
        others = [f"`{key}`" for key in accelerate_names() if key not in DATA_SIZES]
        raise RecipeError(f"`{recipe_data_sizes[0]}` shapes the data-parallel ranks beside {', '.join(others[:-1])} "
                          f"or {others[-1]}, and the recipe names none of them; plain FSDP takes its sharding from "
                          "the Accelerate config (fsdp_full_shard.yaml, multinode_fsdp_hybrid_shard.yaml).")
    for axis in mesh_axes():  # a size the model cannot take (TP's heads)
        if asked.size(axis.size_key) > 1 and model_config is not None:
            axis.check_size(asked.size(axis.size_key), model_config())
    return resolve(asked, sources, world_size), sources


def resolve(asked: Parallelism, sources: dict[str, str], world_size: int) -> Parallelism:
    """Fills `dp_shard_size`, when nobody named it, with the ranks the other axes leave, as axolotl does; then the
    product of the axes must be the world size."""
    if not asked.replaced(dp_shard_size=1).named and "dp_shard_size" not in sources:
        return asked  # plain data parallelism: the launch config decides, as it always did
    if "dp_shard_size" not in sources:
        others = asked.total // asked.dp_shard_size
        if world_size % others == 0:
            asked = asked.replaced(dp_shard_size=world_size // others)
    if asked.total != world_size:
        product = " × ".join(f"{key} {size}" for key, size in asked.to_dict().items())
        raise RecipeError(f"{product} = {asked.total}, but the launch has {world_size} process(es): the sizes of the "
                          f"axes multiply to the world size. Change a size, or launch {asked.total} processes.")
    return asked
