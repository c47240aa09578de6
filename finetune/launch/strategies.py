"""The strategy model: what runs (one process, DDP, a DeepSpeed ZeRO stage and its offloads, FSDP and its sharding,
over how many nodes), and the one table of the strategies this toolkit ships.

A `Strategy` is read here and nowhere else: from a DeepSpeed JSON, from an Accelerate YAML (a `deepspeed_config_file`
or DeepSpeed/FSDP keys written inline, the form `accelerate config` writes), from the environment a launcher hands
a process, and from what Trainer prepared. `SHIPPED` lists every shipped strategy with its files; the config
writer, the planner, the estimator's defaults, the bench and the tests read it.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field, replace
from functools import cached_property
from pathlib import Path
from typing import Any

import yaml

from finetune.axes import AXES, axis_class
from finetune.configs.accelerate import FSDP_SHARDING as GENERATED_FSDP_SHARDING
from finetune.configs.accelerate import STRATEGIES, accelerate_config, deepspeed_section_as_json
from finetune.configs.deepspeed import NVME_PATH_PLACEHOLDER, deepspeed_config
from finetune.errors import RecipeError
from finetune.launch.commands import Launch

# Where the optimizer steps the model's own tensors, so `pure_bf16` means what it says (DeepSpeed keeps fp32 masters of
# its own, Accelerate's FSDP path upcasts trainable parameters).
PURE_BF16_KINDS = ("single", "ddp")
FSDP_SHARDING = (*GENERATED_FSDP_SHARDING, "no_shard")  # what the shipped configs write, and FSDP1's no_shard
# FSDP1's ShardingStrategy, by name or by its number in Accelerate configs (1 = FULL_SHARD ...).
_FSDP1_SHARDING = ("full_shard", "shard_grad_op", "no_shard", "hybrid_shard", "hybrid_shard_zero2")


@dataclass(frozen=True)
class Strategy:
    """What a launch runs. `kind` is single, ddp, deepspeed or fsdp (the generator's names), or the name of an axis
    that takes the engine's place (finetune.axes), whose layout is `axis`; the other fields apply to their kind."""

    kind: str = "single"
    zero_stage: int | None = None            # DeepSpeed
    offload_optimizer: str | None = None     # DeepSpeed: "cpu" or "nvme"
    offload_param: str | None = None         # DeepSpeed ZeRO-3: "cpu" or "nvme"
    fsdp_sharding: str | None = None         # FSDP: full_shard, shard_grad_op, hybrid_shard, no_shard
    fsdp_version: int | None = None          # FSDP: 1 or 2
    nodes: int = 1
    # the axes of Accelerate's mesh that run beside the engine (sequence parallelism under DeepSpeed: its layout,
    # finetune.train.axes.sequence), each naming, describing and recording itself; a recipe may name them under any
    # DeepSpeed config, so they are not part of which engine ran
    beside: tuple = field(default=(), compare=False)
    # an axis that takes the engine's place on plain processes: one that runs its own loop (a pipeline:
    # finetune.train.axes.pipeline) or that Transformers loads sharded (tensor parallelism:
    # finetune.train.axes.tensor). Its layout names, describes and records it (`label`, `describe`, `record`), says
    # whether it `shards_parameters`, and sizes it for the estimator
    axis: Any = None
    # DeepSpeed's bucket settings the estimator counts: elements, or None for "auto" (Trainer fills hidden²).
    reduce_bucket_size: int | None = field(default=None, compare=False)
    overlap_comm: bool = field(default=False, compare=False)
    # ZeRO++ hpZ: ranks a secondary copy of the weights is split over (the GPUs of a node); "auto": the launch's
    hpz_partition_size: int | str | None = field(default=None, compare=False)
    source: str | None = field(default=None, compare=False)  # where it was read: a file, inline keys, the engine

    @classmethod
    def from_deepspeed(cls, config: dict[str, Any], source: str | None = None, nodes: int = 1) -> Strategy:
        zero = config.get("zero_optimization") or {}
        bucket = zero.get("reduce_bucket_size", DEEPSPEED_DEFAULT_REDUCE_BUCKET_SIZE)
        return cls("deepspeed", zero_stage=int(zero.get("stage", 0)),
                   offload_optimizer=_offload_device(zero.get("offload_optimizer")),
                   offload_param=_offload_device(zero.get("offload_param")), nodes=nodes,
                   reduce_bucket_size=int(bucket) if isinstance(bucket, (int, float)) else None,
                   overlap_comm=bool(zero.get("overlap_comm", False)),
                   hpz_partition_size=_hpz(zero.get("zero_hpz_partition_size")), source=source)

    @classmethod
    def of_axis(cls, layout, source: str | None = None, nodes: int = 1) -> Strategy:
        """The strategy of an axis in the engine's place, from its layout."""
        return cls(layout.name, axis=layout, nodes=nodes, source=source)

    @classmethod
    def from_accelerate(cls, config: dict[str, Any], source: str = "Accelerate config") -> Strategy:
        """From an Accelerate config as `accelerate launch --config_file` reads it."""
        return read_accelerate(config, source)[0]

    def for_world_size(self, world_size: int) -> Strategy:
        """DDP over one process is one process: the same strategy for every check."""
        if self.kind == "ddp" and world_size == 1:
            return Strategy("single", nodes=self.nodes, source=self.source)
        return self

    def runs_as(self, other: Strategy) -> bool:
        """The same strategy, whatever the node count or where each was read (the fields compared are the
        dataclass's own)."""
        return replace(self, nodes=other.nodes) == other

    @property
    def shards_parameters(self) -> bool:
        """Whether parameters are split over ranks at rest: ZeRO-3, and FSDP but `no_shard` (shard-grad-op too: it
        gathers them for forward and backward only)."""
        if self.kind == "deepspeed":
            return self.zero_stage == 3
        if self.axis is not None:
            return self.axis.shards_parameters
        return self.kind == "fsdp" and self.fsdp_sharding != "no_shard"

    @property
    def label(self) -> str:
        """A short name: `ddp`, `deepspeed_zero3+offload_optimizer=cpu`, `fsdp_full_shard`, `tp2_fsdp2`."""
        if self.kind == "deepspeed":
            offloads = [f"{key}={value}" for key, value in
                        (("offload_optimizer", self.offload_optimizer), ("offload_param", self.offload_param)) if value]
            return "+".join([f"deepspeed_zero{self.zero_stage}", *offloads, *(axis.label() for axis in self.beside)])
        if self.axis is not None:  # `pp2_tp2`, `tp2_fsdp2`
            return self.axis.label(self)
        return f"fsdp_{self.fsdp_sharding}" if self.kind == "fsdp" else self.kind

    def describe(self) -> str:
        """How messages name it: `DeepSpeed ZeRO-2`, `FSDP full_shard`, `tensor parallel 2 × FSDP2 2`, `DDP or one
        process`."""
        if self.kind == "deepspeed":
            return " × ".join([f"DeepSpeed ZeRO-{self.zero_stage}", *(axis.describe() for axis in self.beside)])
        if self.axis is not None:
            return self.axis.describe(self)
        if self.kind not in STRATEGIES:  # an axis in the engine's place, as a checkpoint's marker names it (no layout)
            return self.kind
        return f"FSDP {self.fsdp_sharding}" if self.kind == "fsdp" else "DDP or one process"

    def to_dict(self) -> dict[str, Any]:
        """The record in `effective_config.json` and checkpoint markers."""
        record: dict[str, Any] = {"strategy": self.kind}
        if self.kind == "deepspeed":
            record.update(zero_stage=self.zero_stage, offload_optimizer=self.offload_optimizer,
                          offload_param=self.offload_param)
            for axis in self.beside:
                record.update(axis.record())
        if self.kind == "fsdp":
            record.update(fsdp_sharding=self.fsdp_sharding, fsdp_version=self.fsdp_version)
        if self.axis is not None:
            record.update(self.axis.record(self))
        if self.source is not None:
            record["source"] = self.source
        return record

    def estimator_options(self) -> dict[str, Any]:
        """The strategy fields of the estimator's `Setup` (finetune.memory.estimate)."""
        options: dict[str, Any] = {"strategy": self.kind}
        if self.kind == "deepspeed":
            options.update(zero_stage=self.zero_stage, offload_optimizer=self.offload_optimizer,
                           offload_param=self.offload_param, reduce_bucket_size=self.reduce_bucket_size,
                           overlap_comm=self.overlap_comm, hpz_partition_size=self.hpz_partition_size,
                           beside=self.beside)
        if self.kind == "fsdp":
            options["fsdp_sharding"] = self.fsdp_sharding
        if self.axis is not None:
            options["axis"] = self.axis
        return options


# DeepSpeed's own default when a config sets no reduce_bucket_size (deepspeed/runtime/zero/config.py,
# `DeepSpeedZeroConfig.reduce_bucket_size`; a test reads it there).
DEEPSPEED_DEFAULT_REDUCE_BUCKET_SIZE = 500_000_000


def _hpz(value) -> int | str | None:
    """ZeRO++'s hpZ group size as a config gives it: a number of ranks (1: no secondary copy), or "auto"."""
    if value == "auto":
        return "auto"
    return int(value) if isinstance(value, (int, float)) and value > 1 else None


def _offload_device(section) -> str | None:
    device = (section or {}).get("device") if isinstance(section, dict) else getattr(section, "device", None)
    device = getattr(device, "value", device)  # an enum in DeepSpeed's config objects, a str in JSON
    return None if device in (None, "none") else str(device)


def is_true(value) -> bool:
    """A flag as YAML, argparse or an environment variable spells it."""
    return str(value).lower() in ("true", "1", "yes")


def fsdp_fills_from_rank_zero(environ=None) -> bool:
    """The launch is FSDP2 with `fsdp_cpu_ram_efficient_loading` (as its launcher exports it): Accelerate fills every
    rank's shards from global rank 0's weights when Trainer prepares the model, so no other rank needs them
    (finetune.models.loading.sharded_from_rank_zero; the estimator's `sharded_loading`)."""
    environ = os.environ if environ is None else environ
    return (is_true(environ.get("ACCELERATE_USE_FSDP")) and environ.get("FSDP_VERSION") == "2"
            and is_true(environ.get("FSDP_CPU_RAM_EFFICIENT_LOADING")))


def read_deepspeed_file(path: str | Path) -> dict[str, Any]:
    """A DeepSpeed JSON (relative paths from where the launch runs); a missing or invalid file is a RecipeError."""
    try:
        config = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise RecipeError(f"DeepSpeed config `{path}` does not exist (relative to {Path.cwd()}).") from None
    except json.JSONDecodeError as error:
        raise RecipeError(f"the DeepSpeed config `{path}` is not valid JSON: {error}") from None
    if not isinstance(config, dict):
        raise RecipeError(f"the DeepSpeed config `{path}` must be a JSON object, got {type(config).__name__}.")
    return config


def read_accelerate(config: dict[str, Any], source: str = "Accelerate config") -> tuple[Strategy, dict | None]:
    """The strategy of an Accelerate config and, under DeepSpeed, the DeepSpeed config it runs: its
    `deepspeed_config_file`, or the one Accelerate builds from inline keys (`zero_stage`, `offload_*_device`, ...)."""
    kind = str(config.get("distributed_type", "NO")).upper()
    nodes = int(config.get("num_machines", 1) or 1)
    if kind == "DEEPSPEED":
        section = config.get("deepspeed_config") or {}
        path = section.get("deepspeed_config_file")
        if path not in (None, "", "none"):
            deepspeed, where = read_deepspeed_file(path), f"DeepSpeed JSON {path}"
        else:
            deepspeed, where = deepspeed_section_as_json(section), f"{source} (inline deepspeed_config)"
        from finetune.launch.parallelism import from_accelerate_section

        beside = from_accelerate_section(config.get("parallelism_config") or {}, source).beside_the_engine()
        return replace(Strategy.from_deepspeed(deepspeed, where, nodes), beside=beside), deepspeed
    if kind == "FSDP":
        return _fsdp_strategy(config.get("fsdp_config") or {}, config.get("parallelism_config") or {}, nodes,
                              source), None
    if kind == "NO" or kind.startswith("MULTI_"):
        from finetune.launch.parallelism import from_accelerate_section

        engine = from_accelerate_section(config.get("parallelism_config") or {}, source).engine()
        if engine is not None:
            return Strategy.of_axis(engine, source, nodes), None
        return Strategy("single" if kind == "NO" else "ddp", nodes=nodes, source=source), None
    raise RecipeError(f"{source}: distributed_type {kind} is not one this toolkit runs; use NO, MULTI_GPU, "
                      "DEEPSPEED or FSDP.")


def _fsdp_strategy(section: dict, parallelism: dict, nodes: int, source: str) -> Strategy:
    """FSDP2 says `fsdp_reshard_after_forward` (true: full shard, false: shard-grad-op) and hybrid sharding through
    a replicate size; FSDP1 names a ShardingStrategy (in `fsdp_sharding_strategy` or, in newer Accelerate,
    `fsdp_reshard_after_forward`)."""
    version = int(section.get("fsdp_version", 1) or 1)
    reshard = section.get("fsdp_reshard_after_forward", section.get("fsdp_sharding_strategy", True))
    if isinstance(reshard, bool) or str(reshard).lower() in ("true", "false"):
        sharding = "full_shard" if is_true(reshard) else "shard_grad_op"
    elif str(reshard).isdigit() and 1 <= int(reshard) <= len(_FSDP1_SHARDING):
        sharding = _FSDP1_SHARDING[int(reshard) - 1]
    else:
        sharding = str(reshard).rsplit(".", 1)[-1].lower()
    if int(parallelism.get("parallelism_config_dp_replicate_size", 1) or 1) > 1 or sharding == "hybrid_shard_zero2":
        sharding = "hybrid_shard"
    if sharding not in FSDP_SHARDING:
        raise RecipeError(f"{source}: FSDP sharding `{reshard}` is not one of {', '.join(FSDP_SHARDING)}.")
    return Strategy("fsdp", fsdp_sharding=sharding, fsdp_version=version, nodes=nodes, source=source)


def read_config_file(path: str | Path) -> tuple[Strategy, dict | None]:
    """The strategy of a DeepSpeed JSON or an Accelerate YAML file, with the DeepSpeed config it runs (or None)."""
    path = Path(path)
    if path.suffix == ".json":
        config = read_deepspeed_file(path)
        return Strategy.from_deepspeed(config, f"DeepSpeed JSON {path}"), config
    if not path.is_file():
        raise RecipeError(f"Accelerate config `{path}` does not exist.")
    try:
        config = yaml.safe_load(path.read_text())
    except yaml.YAMLError as error:
        raise RecipeError(f"Accelerate config `{path}` is not valid YAML: {error}") from None
    if not isinstance(config, dict):
        raise RecipeError(f"Accelerate config `{path}` must be a mapping.")
    return read_accelerate(config, f"Accelerate config {path}")


# The variables `accelerate launch` hands each process (accelerate/utils/launch.py), as the config keys they carry.
_DEEPSPEED_ENV = {
    "ACCELERATE_DEEPSPEED_CONFIG_FILE": "deepspeed_config_file",
    "ACCELERATE_DEEPSPEED_ZERO_STAGE": "zero_stage",
    "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE": "offload_optimizer_device",
    "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE": "offload_param_device",
    "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_NVME_PATH": "offload_optimizer_nvme_path",
    "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_NVME_PATH": "offload_param_nvme_path",
    "ACCELERATE_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL": "zero3_save_16bit_model",
    "ACCELERATE_GRADIENT_ACCUMULATION_STEPS": "gradient_accumulation_steps",
    "ACCELERATE_GRADIENT_CLIPPING": "gradient_clipping",
}
_FSDP_ENV = {
    "FSDP_VERSION": "fsdp_version",
    "FSDP_RESHARD_AFTER_FORWARD": "fsdp_reshard_after_forward",
    "FSDP_SHARDING_STRATEGY": "fsdp_sharding_strategy",
}


def launched_strategy(deepspeed=None, environ=None) -> tuple[Strategy, dict | None]:
    """What this process was asked to run: Trainer's `deepspeed` argument (a path or a dict) when given, else what
    the launcher handed it (`accelerate launch` variables; a plain `torchrun` means DDP). With the DeepSpeed config."""
    environ = os.environ if environ is None else environ
    world_size = int(environ.get("WORLD_SIZE", "1"))
    nodes = max(1, world_size // int(environ.get("LOCAL_WORLD_SIZE", world_size) or 1))
    if isinstance(deepspeed, dict):
        return Strategy.from_deepspeed(deepspeed, "the recipe's deepspeed dict", nodes), deepspeed
    if deepspeed:
        config = read_deepspeed_file(deepspeed)
        return Strategy.from_deepspeed(config, f"DeepSpeed JSON {deepspeed}", nodes), config
    config: dict[str, Any] = {"num_machines": nodes, "distributed_type": "MULTI_GPU" if world_size > 1 else "NO"}
    if is_true(environ.get("ACCELERATE_USE_DEEPSPEED")):
        config["distributed_type"] = "DEEPSPEED"
        config["deepspeed_config"] = {key: environ[name] for name, key in _DEEPSPEED_ENV.items() if name in environ}
    elif is_true(environ.get("ACCELERATE_USE_FSDP")):
        config["distributed_type"] = "FSDP"
        config["fsdp_config"] = {key: environ[name] for name, key in _FSDP_ENV.items() if name in environ}
        replicate = environ.get("PARALLELISM_CONFIG_DP_REPLICATE_SIZE")
        if replicate:
            config["parallelism_config"] = {"parallelism_config_dp_replicate_size": replicate}
    elif world_size > 1:
        from finetune.launch.parallelism import launched_section

        config["parallelism_config"] = launched_section(environ)
    if "ACCELERATE_MIXED_PRECISION" in environ:  # set by `accelerate launch` for every process
        source = "Accelerate config"
    else:
        source = "the launcher" if "WORLD_SIZE" in environ else "a single process"
    return read_accelerate(config, source)


def prepared_strategy(state, world_size: int, nodes: int = 1) -> Strategy:
    """The strategy Accelerate prepared (`AcceleratorState`), with the DeepSpeed config as Trainer filled it."""
    from accelerate.utils import DistributedType

    if state.distributed_type == DistributedType.DEEPSPEED:
        strategy = Strategy.from_deepspeed(state.deepspeed_plugin.deepspeed_config, "Accelerate's DeepSpeed plugin",
                                           nodes)
        from finetune.launch.parallelism import prepared_mesh

        return replace(strategy, beside=prepared_mesh(getattr(state, "parallelism_config", None)).beside_the_engine())
    if state.distributed_type == DistributedType.FSDP:
        plugin = state.fsdp_plugin
        reshard = getattr(plugin, "reshard_after_forward", None)
        section = {"fsdp_version": getattr(plugin, "fsdp_version", 1),
                   "fsdp_reshard_after_forward": reshard if reshard is not None
                   else getattr(plugin, "sharding_strategy", "full_shard")}
        # FSDP2 hybrid sharding is Accelerate's device mesh: replicate across (dp_replicate) × shard within (dp_shard)
        # (a mesh without a shard dimension is Accelerate's plain data parallelism, not hybrid sharding)
        mesh = getattr(state, "parallelism_config", None)
        hybrid = mesh is not None and (mesh.dp_shard_size or 1) > 1 and (mesh.dp_replicate_size or 1) > 1
        parallelism = {"parallelism_config_dp_replicate_size": mesh.dp_replicate_size if hybrid else 1}
        return _fsdp_strategy(section, parallelism, nodes, "Accelerate's FSDP plugin")
    return Strategy("ddp", nodes=nodes).for_world_size(world_size)


def running_strategy(trainer) -> Strategy:
    """The strategy Trainer really prepared, read from the wrapped model (the engine), not from the configs."""
    import torch

    wrapped = trainer.model_wrapped
    sharded = loaded_sharded(trainer.model)
    if sharded is not None:
        return sharded
    if trainer.is_deepspeed_enabled and hasattr(wrapped, "zero_optimization_stage"):
        from finetune.launch.parallelism import running_mesh

        return Strategy("deepspeed", zero_stage=wrapped.zero_optimization_stage(),
                        offload_optimizer=_offload_device(wrapped.zero_offload_optimizer()),
                        offload_param=_offload_device(wrapped.zero_offload_param()), source="the DeepSpeed engine",
                        beside=running_mesh(trainer).beside_the_engine())
    if trainer.is_fsdp_enabled and _is_fsdp_sharded(trainer.model):
        state = trainer.accelerator.state
        return prepared_strategy(state, trainer.args.world_size)
    if isinstance(wrapped, torch.nn.parallel.DistributedDataParallel):
        return Strategy("ddp", source="DistributedDataParallel")
    return Strategy("single", source="an unwrapped model")


def loaded_sharded(model) -> Strategy | None:
    """The strategy of a model Transformers loaded sharded (`DistributedConfig`), read off the model by the mesh axis
    that loads it so (`Axis.loaded_layout`); None for any other model."""
    from finetune.axes import mesh_axes

    for axis in mesh_axes():
        layout = axis.loaded_layout(model)
        if layout is not None:
            return Strategy.of_axis(layout, "the model Transformers loaded sharded")
    return None


def _is_fsdp_sharded(model) -> bool:
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters()) or any(
        type(m).__name__.startswith(("FullyShardedDataParallel", "FSDP")) for m in model.modules()
    )


@dataclass(frozen=True)
class ShippedStrategy:
    """One row of the shipped table: a strategy, the generator options that write its files, and where it goes."""

    name: str                                  # deepspeed_configs/<name>.json for DeepSpeed rows
    label: str                                 # how `finetune plan` names it
    kind: str
    accelerate_file: str | None = None         # the one-node GPU launch config, when one ships
    deepspeed: dict | None = None              # deepspeed_config(**options)
    fsdp_sharding: str | None = None
    decision_tree: bool = False                # a candidate of `finetune plan` on several GPUs
    cross_node: tuple[float, float] | None = None  # values through each node's link per (parameter, trained one)
    multinode_file: str | None = None          # the 2-node launch config, when one ships
    cpu: bool = False                          # runs on 2 CPU processes (tests, bench --cpu)
    parallelism: dict | None = None            # the mesh's sizes by Accelerate's names (`tp_size`; `sp_size` beside
                                               # ZeRO): its config's `parallelism_config` section
    deepspeed_name: str | None = None          # another row's DeepSpeed JSON, shared (default: this row's name)

    @property
    def deepspeed_file(self) -> str | None:
        return f"deepspeed_configs/{self.deepspeed_name or self.name}.json" if self.deepspeed is not None else None

    def deepspeed_json(self) -> dict | None:
        return None if self.deepspeed is None else deepspeed_config(**self.deepspeed)

    def accelerate_options(self, multinode: bool = False) -> dict[str, Any]:
        """Arguments of `accelerate_config` for this strategy: one node of GPUs, or the 2-node example."""
        if multinode:
            return {**self.accelerate_options(), **MULTINODE_EXAMPLE}
        if self.kind == "deepspeed":
            return {"strategy": "deepspeed", "deepspeed_config_file": self.deepspeed_file,
                    "zero3_init": self.deepspeed_json()["zero_optimization"]["stage"] == 3,
                    **({"parallelism": self.parallelism} if self.parallelism else {})}
        if self.kind == "fsdp":
            return {"strategy": "fsdp", "fsdp_sharding": self.fsdp_sharding}
        if self.parallelism:  # an axis of the mesh in the engine's place: plain processes, as many as the mesh
            return {"strategy": self.kind, "parallelism": self.parallelism,
                    "num_processes": math.prod(self.parallelism.values())}
        return {"strategy": self.kind, **({"num_processes": 1} if self.kind == "single" else {})}

    @cached_property
    def strategy(self) -> Strategy:
        """Read back from the generated config, so that the table, the files and the estimator cannot disagree."""
        if self.deepspeed is not None:
            from finetune.launch.parallelism import Parallelism

            strategy = Strategy.from_deepspeed(self.deepspeed_json(), f"DeepSpeed JSON {self.deepspeed_file}")
            mesh = Parallelism.from_accelerate_names(self.parallelism or {}, f"shipped strategy {self.name}")
            return replace(strategy, beside=mesh.beside_the_engine())
        multinode = self.accelerate_file is None  # hybrid sharding exists across nodes only
        config = accelerate_config(**self.accelerate_options(multinode))
        return Strategy.from_accelerate(config, self.accelerate_file or self.multinode_file)

    def launch(self, cpu: bool) -> Launch:
        """What runs it on GPUs, or on 2 CPU processes (FSDP there through `finetune.testing.fsdp_on_cpu`)."""
        if cpu:
            if not self.cpu:
                raise RecipeError(f"{self.label} does not run on CPU processes.")
            if self.kind == "ddp":
                return Launch("accelerate_configs/cpu_ddp.yaml")
            if self.kind in AXES:  # an axis in the engine's place: its CPU twin's program
                return Launch(f"accelerate_configs/cpu_{self.name}.yaml", program=axis_class(self.kind).cpu_program)
            if self.kind == "fsdp":
                suffix = "" if self.fsdp_sharding == "full_shard" else f"_{self.fsdp_sharding}"
                return Launch(f"accelerate_configs/cpu_fsdp{suffix}.yaml",
                              program=("-m", "finetune.testing.fsdp_on_cpu"))
            if self.parallelism:  # DeepSpeed runs on CPU processes as on GPUs: the GPU config itself
                return Launch(self.accelerate_file)
            return Launch("accelerate_configs/cpu_deepspeed_zero2.yaml", self.deepspeed_file)
        if self.accelerate_file is not None:
            return Launch(self.accelerate_file)
        if self.deepspeed_file is not None:
            return Launch("accelerate_configs/deepspeed_zero2.yaml", self.deepspeed_file)
        return Launch(self.multinode_file)


# In the decision tree's order: the first candidate that fits is what `finetune plan` recommends. Cross-node volumes:
# gradients are all-reduced (reduce-scatter + all-gather: 2 per trained parameter); ZeRO-3 / FSDP full shard gather
# every parameter in forward and in backward (2) and reduce-scatter the gradients (1); ZeRO++ (Wang et al. 2023):
# int8 forward gather (0.5), backward gather inside the node (hpZ: 0), int4 gradients (0.25); FSDP hybrid shard
# gathers parameters inside the node, so only the gradient all-reduce crosses nodes.
_ALL_REDUCE, _GATHER_EVERYTHING = (0.0, 2.0), (2.0, 1.0)
MULTINODE_EXAMPLE = {"num_processes": 4, "num_machines": 2}  # the shipped multinode files: 2 nodes × 2 GPUs
SHIPPED = (
    ShippedStrategy("single", "single GPU", "single", accelerate_file="accelerate_configs/single_gpu.yaml"),
    ShippedStrategy("ddp", "DDP", "ddp", accelerate_file="accelerate_configs/ddp.yaml", decision_tree=True,
                    cross_node=_ALL_REDUCE, cpu=True),
    ShippedStrategy("zero0", "ZeRO-0", "deepspeed", deepspeed=dict(stage=0), cpu=True),
    ShippedStrategy("zero1", "ZeRO-1", "deepspeed", accelerate_file="accelerate_configs/deepspeed_zero1.yaml",
                    deepspeed=dict(stage=1), decision_tree=True, cross_node=_ALL_REDUCE, cpu=True),
    ShippedStrategy("zero2", "ZeRO-2", "deepspeed", accelerate_file="accelerate_configs/deepspeed_zero2.yaml",
                    deepspeed=dict(stage=2), decision_tree=True, cross_node=_ALL_REDUCE,
                    multinode_file="accelerate_configs/multinode_deepspeed_zero2.yaml", cpu=True),
    ShippedStrategy("fsdp_shard_grad_op", "FSDP shard-grad-op", "fsdp", fsdp_sharding="shard_grad_op",
                    accelerate_file="accelerate_configs/fsdp_shard_grad_op.yaml", decision_tree=True, cpu=True),
    ShippedStrategy("zero3", "ZeRO-3", "deepspeed", accelerate_file="accelerate_configs/deepspeed_zero3.yaml",
                    deepspeed=dict(stage=3), decision_tree=True, cross_node=_GATHER_EVERYTHING, cpu=True),
    ShippedStrategy("fsdp_full_shard", "FSDP full-shard", "fsdp", fsdp_sharding="full_shard",
                    accelerate_file="accelerate_configs/fsdp_full_shard.yaml", decision_tree=True,
                    cross_node=_GATHER_EVERYTHING, multinode_file="accelerate_configs/multinode_fsdp_full_shard.yaml",
                    cpu=True),
    ShippedStrategy("zero2_offload", "ZeRO-2 + CPU offload", "deepspeed",
                    accelerate_file="accelerate_configs/deepspeed_zero2_offload.yaml",
                    deepspeed=dict(stage=2, offload_optimizer="cpu"), decision_tree=True, cpu=True),
    ShippedStrategy("zero3_offload", "ZeRO-3 + CPU offload", "deepspeed",
                    accelerate_file="accelerate_configs/deepspeed_zero3_offload.yaml",
                    deepspeed=dict(stage=3, offload_optimizer="cpu", offload_param="cpu"), decision_tree=True,
                    cpu=True),
    # The NVMe path is a placeholder the user sets; the async-I/O op it needs is not built on CPU machines.
    ShippedStrategy("zero3_nvme", "ZeRO-3 + NVMe offload", "deepspeed",
                    accelerate_file="accelerate_configs/deepspeed_zero3_nvme.yaml",
                    deepspeed=dict(stage=3, offload_optimizer="nvme", offload_param="nvme",
                                   nvme_path=NVME_PATH_PLACEHOLDER),
                    decision_tree=True),
    # ZeRO++ with a per-node weight copy (hpZ over the GPUs of a node, "auto": filled from the launch by `finetune
    # train`); its quantization kernels need CUDA.
    ShippedStrategy("zero3_zeropp", "ZeRO-3 + ZeRO++", "deepspeed",
                    deepspeed=dict(stage=3, zeropp_hpz_partition_size="auto"),
                    cross_node=(0.5, 0.25), multinode_file="accelerate_configs/multinode_deepspeed_zero3_zeropp.yaml"),
    # Tensor parallelism (the model's own TP plan, loaded sharded by Transformers) within a node; with FSDP2 over
    # the ranks it leaves. Launched as plain processes; CPU twins through finetune.testing.parallelism_on_cpu.
    ShippedStrategy("tensor_parallel", "TP", "tensor_parallel",
                    accelerate_file="accelerate_configs/tensor_parallel.yaml", parallelism=dict(tp_size=2),
                    cpu=True),
    ShippedStrategy("tensor_parallel_fsdp", "TP × FSDP2", "tensor_parallel",
                    accelerate_file="accelerate_configs/tensor_parallel_fsdp.yaml",
                    parallelism=dict(tp_size=2, dp_shard_size=2), cpu=True),
    # Sequence parallelism (DeepSpeed Ulysses / ALST) beside ZeRO-3, for long sequences: each sequence split over 2
    # ranks. DeepSpeed runs on CPU processes as it is, so this config is its own CPU twin.
    ShippedStrategy("sequence_parallel", "SP × ZeRO-3", "deepspeed",
                    accelerate_file="accelerate_configs/sequence_parallel.yaml", deepspeed=dict(stage=3),
                    deepspeed_name="zero3", parallelism=dict(sp_size=2), cpu=True),
    ShippedStrategy("fsdp_hybrid_shard", "FSDP hybrid-shard", "fsdp", fsdp_sharding="hybrid_shard",
                    cross_node=_ALL_REDUCE, multinode_file="accelerate_configs/multinode_fsdp_hybrid_shard.yaml"),
)
SHIPPED_BY_NAME = {row.name: row for row in SHIPPED}


def shipped(name: str) -> ShippedStrategy:
    """The shipped strategy called `name`; an unknown name is a RecipeError with the choices."""
    from finetune.errors import did_you_mean

    if name not in SHIPPED_BY_NAME:
        raise RecipeError(f"no shipped strategy `{name}`{did_you_mean(name, SHIPPED_BY_NAME)}; "
                          f"choose from {', '.join(SHIPPED_BY_NAME)}.")
    return SHIPPED_BY_NAME[name]
