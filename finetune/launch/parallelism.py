"""The parallelism axes beyond plain data parallelism, under the names users know from axolotl: tensor
(`tensor_parallel_size`), sharded and replicated data (`dp_shard_size`, `dp_replicate_size`), sequence
(`sequence_parallel_size`, DeepSpeed Ulysses) and context (`context_parallel_size`, GPUs only).

The engines are Transformers' and Accelerate's: a tensor-parallel model is loaded sharded by `from_pretrained(...,
distributed_config=DistributedConfig(tp_size, fsdp_size, dp_replicate_size))` (the model's own TP plan, FSDP2 over the
other ranks), and Trainer builds Accelerate's `ParallelismConfig` from it; sequence parallelism is Accelerate's
`ParallelismConfig(sp_backend="deepspeed")`. This module reads the sizes (from the recipe or from the variables
`accelerate launch` exports for a config's `parallelism_config` section), checks them against the launch and the
model before any process group starts, and builds those objects.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any

from finetune.errors import RecipeError

# Recipe key -> the variable `accelerate launch` exports for it (accelerate/utils/launch.py,
# `prepare_extend_env_parallelism_config`; `ParallelismConfig.__post_init__` reads them back).
KEYS = {
    "tensor_parallel_size": "PARALLELISM_CONFIG_TP_SIZE",
    "dp_shard_size": "PARALLELISM_CONFIG_DP_SHARD_SIZE",
    "dp_replicate_size": "PARALLELISM_CONFIG_DP_REPLICATE_SIZE",
    "sequence_parallel_size": "PARALLELISM_CONFIG_SP_SIZE",
    "context_parallel_size": "PARALLELISM_CONFIG_CP_SIZE",
}
CONTEXT_PARALLEL_ON_CPU = ("`context_parallel_size` needs GPUs: PyTorch's ring attention (context parallelism) has no "
                           "CPU kernel. On CPU processes split long sequences with `sequence_parallel_size` "
                           "(DeepSpeed Ulysses) instead.")
# Transformers' FSDP2 path re-ties a tied `lm_head` to the embedding after sharding (transformers/distributed/fsdp.py);
# under tensor parallelism the head then computes with a stale copy of the shared weight from the first update on, so
# losses drift from a one-process run (measured: 0.013 at step 2 on the tiny preset, TP 2 × FSDP2 2).
TIED_WITH_TP_AND_FSDP = (
    "tied input and output embeddings (`tie_word_embeddings: true` in the model's config) with "
    "`tensor_parallel_size` {tensor} and `dp_shard_size` {shard}: Transformers' FSDP2 re-tying leaves `lm_head` "
    "computing with a stale copy of the shared weight after the first update, so the run would train a different "
    "model than one process does. Use `dp_shard_size: 1` (tensor parallelism alone, or `dp_replicate_size` for the "
    "other ranks), an untied model, or drop `tensor_parallel_size` for plain FSDP.")


@dataclass(frozen=True)
class Parallelism:
    """The size of each axis; their product is the world size. Plain data parallelism (DDP, ZeRO, FSDP through
    Accelerate's own configs) is all 1 here: only a run that names an axis gets a mesh from this module."""

    tensor_parallel_size: int = 1
    dp_shard_size: int = 1
    dp_replicate_size: int = 1
    sequence_parallel_size: int = 1
    context_parallel_size: int = 1
    bf16: bool = field(default=False, compare=False)  # the run's mixed precision: FSDP2 gathers the slices in bf16

    @property
    def total(self) -> int:
        return math.prod(getattr(self, key) for key in KEYS)

    @property
    def data_parallel_size(self) -> int:
        """Ranks that see different batches: the sharded and replicated data axes (TP, SP and CP ranks share one)."""
        return self.dp_shard_size * self.dp_replicate_size

    @property
    def loads_sharded(self) -> bool:
        """Transformers shards the model while loading it (`DistributedConfig`): tensor parallelism."""
        return self.tensor_parallel_size > 1

    @property
    def named(self) -> bool:
        """Whether any axis beyond plain data parallelism is asked for."""
        return self != Parallelism() and (self.loads_sharded or self.sequence_parallel_size > 1
                                          or self.context_parallel_size > 1)

    def describe(self) -> str:
        """`tensor_parallel_size 2 × dp_shard_size 2`: the axes above 1, as the recipe names them."""
        named = [f"{key} {getattr(self, key)}" for key in KEYS if getattr(self, key) > 1]
        return " × ".join(named) or "no parallelism axis"

    def to_dict(self) -> dict[str, int]:
        return {key: getattr(self, key) for key in KEYS}

    def distributed_config(self):
        """Transformers' `DistributedConfig` that loads the model sharded: its own TP plan over `tensor_parallel_size`
        ranks, FSDP2 over `dp_shard_size`, replicas over `dp_replicate_size`. Under bf16 FSDP2 gathers the slices in
        bf16 and reduces their gradients in fp32 (Transformers' `fsdp_mixed_precision` policy), as Accelerate's FSDP2
        does: without it the fp32 masters would be gathered and reduce-scattered in fp32, twice the bytes. (fp16
        runs keep fp32 gathers: that policy is bf16 only.)"""
        from transformers.distributed import DistributedConfig

        return DistributedConfig(tp_size=self.tensor_parallel_size, fsdp_size=self.dp_shard_size,
                                 dp_replicate_size=self.dp_replicate_size,
                                 fsdp_mixed_precision=self.bf16 and self.dp_shard_size > 1)


    def sequence_parallel_config(self, attention: str | None):
        """Accelerate's `ParallelismConfig` for DeepSpeed Ulysses (ALST) over `sequence_parallel_size` ranks, running
        `attention` (the model's own: Ulysses wraps it) on sequences of any length; None without sequence
        parallelism. The other ranks are plain data parallelism to DeepSpeed (`dp_replicate_size`: Accelerate sizes
        DeepSpeed's batch by it)."""
        if self.sequence_parallel_size <= 1:
            return None
        if attention in ("eager", "flex_attention"):
            raise RecipeError(f"`sequence_parallel_size: {self.sequence_parallel_size}` with `attn_implementation: "
                              f"{attention}`: DeepSpeed Ulysses runs sdpa or flash attention over the whole gathered "
                              "sequence (eager would need a 4D mask the size of the sequence squared); set "
                              "`attn_implementation: sdpa`.")
        from accelerate.parallelism_config import ParallelismConfig
        from accelerate.utils import DeepSpeedSequenceParallelConfig

        return ParallelismConfig(sp_size=self.sequence_parallel_size, sp_backend="deepspeed",
                                 dp_replicate_size=self.data_parallel_size,
                                 sp_handler=DeepSpeedSequenceParallelConfig(sp_seq_length_is_variable=True,
                                                                            sp_attn_implementation=attention))


def prepare_sequence_parallelism(args, parallelism: Parallelism, attention: str | None) -> None:
    """Before Trainer is built: its `parallelism_config` for DeepSpeed Ulysses, and DeepSpeed's communication layer
    over the process group this rank already joined (Ulysses builds its sequence groups there before DeepSpeed's
    engine would set it up)."""
    import deepspeed
    import torch.distributed as dist

    args.parallelism_config = parallelism.sequence_parallel_config(attention)
    if dist.is_initialized():
        deepspeed.init_distributed(dist_backend=dist.get_backend(), auto_mpi_discovery=False)


def requested(training_inputs: dict[str, Any], environ=None) -> tuple[Parallelism, dict[str, str]]:
    """The sizes the recipe names, else those the launch exports (an Accelerate config's `parallelism_config`), and
    where each came from. A size both name differently is a RecipeError naming both."""
    environ = os.environ if environ is None else environ
    from_launch = is_parallelism_launch(environ)
    sizes: dict[str, int] = {}
    sources: dict[str, str] = {}
    for key, variable in KEYS.items():
        launched = process_count(key, environ.get(variable), "the launch's Accelerate config") if from_launch else None
        asked = process_count(key, training_inputs.get(key), "the recipe")
        if asked is not None and launched not in (None, 1) and asked != launched:
            raise RecipeError(f"`{key}: {asked}` in the recipe, but the Accelerate config launched "
                              f"parallelism_config_{_accelerate_name(key)}: {launched}; give one of them.")
        value = asked if asked is not None else launched
        if value is not None:
            sizes[key] = value
            sources[key] = "recipe" if asked is not None else "Accelerate config"
    return Parallelism(**sizes), sources


def from_accelerate_section(section: dict[str, Any], source: str) -> Parallelism:
    """The sizes of an Accelerate config's `parallelism_config` section (all 1 without one)."""
    from finetune.configs.accelerate import PARALLELISM_KEYS

    return Parallelism(**{key: process_count(key, section.get(accelerate), source) or 1
                          for key, accelerate in PARALLELISM_KEYS.items()})


def launched_section(environ=None) -> dict[str, str]:
    """The `parallelism_config` section `accelerate launch` exported to this process (empty when none)."""
    from finetune.configs.accelerate import PARALLELISM_KEYS

    environ = os.environ if environ is None else environ
    if not is_parallelism_launch(environ):
        return {}
    return {PARALLELISM_KEYS[key]: environ[variable] for key, variable in KEYS.items() if variable in environ}


def is_parallelism_launch(environ=None) -> bool:
    environ = os.environ if environ is None else environ
    return str(environ.get("ACCELERATE_USE_PARALLELISM_CONFIG", "")).lower() == "true"


def launched(environ=None) -> Parallelism | None:
    """The sizes `accelerate launch` exported for a config's `parallelism_config` section (None without one)."""
    environ = os.environ if environ is None else environ
    if not is_parallelism_launch(environ):
        return None
    return Parallelism(**{key: process_count(key, environ.get(variable), "the launch's Accelerate config") or 1
                          for key, variable in KEYS.items()})


def describe_as_accelerate(parallelism: Parallelism) -> str:
    """`dp_replicate 2 × dp_shard 2`: the sizes above 1 as an Accelerate config names them (`all 1` for none)."""
    named = [f"{_accelerate_name(key).removesuffix('_size')} {getattr(parallelism, key)}" for key in
             ("dp_replicate_size", "dp_shard_size", "context_parallel_size", "sequence_parallel_size",
              "tensor_parallel_size") if getattr(parallelism, key) > 1]
    return " × ".join(named) or "all 1"


def _accelerate_name(key: str) -> str:
    """The size's name in an Accelerate config's `parallelism_config` section, without its prefix."""
    from finetune.configs.accelerate import PARALLELISM_KEYS

    return PARALLELISM_KEYS[key].removeprefix("parallelism_config_")


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
    """`requested` and `resolve` for a launch of `world_size` processes: context parallelism without GPUs is refused
    first, in one line, whatever else is wrong, then a TP size the model's heads cannot take (`model_config`: a
    callable giving the model's config); data-parallel sizes in a recipe that names no other axis are refused
    (Accelerate's FSDP configs say how plain FSDP shards)."""
    asked, sources = requested(training_inputs, environ)
    if asked.context_parallel_size > 1 and not on_gpu:
        raise RecipeError(CONTEXT_PARALLEL_ON_CPU)
    recipe_data_sizes = [key for key in ("dp_shard_size", "dp_replicate_size") if sources.get(key) == "recipe"]
    if recipe_data_sizes and not asked.named:
        raise RecipeError(f"`{recipe_data_sizes[0]}` shapes the data-parallel ranks beside `tensor_parallel_size`, "
                          "`sequence_parallel_size` or `context_parallel_size`, and the recipe names none of them; "
                          "plain FSDP takes its sharding from the Accelerate config (fsdp_full_shard.yaml, "
                          "multinode_fsdp_hybrid_shard.yaml).")
    if asked.tensor_parallel_size > 1 and model_config is not None:
        check_tensor_parallel_model(asked.tensor_parallel_size, model_config())
    return resolve(asked, sources, world_size), sources


def resolve(asked: Parallelism, sources: dict[str, str], world_size: int) -> Parallelism:
    """Fills `dp_shard_size`, when nobody named it, with the ranks the other axes leave, as axolotl does; then the
    product of the axes must be the world size."""
    if not Parallelism(**{**asked.to_dict(), "dp_shard_size": 1}).named and "dp_shard_size" not in sources:
        return asked  # plain data parallelism: the launch config decides, as it always did
    if "dp_shard_size" not in sources:
        others = asked.total // asked.dp_shard_size
        if world_size % others == 0:
            asked = Parallelism(**{**asked.to_dict(), "dp_shard_size": world_size // others})
    if asked.total != world_size:
        product = " × ".join(f"{key} {getattr(asked, key)}" for key in KEYS)
        raise RecipeError(f"{product} = {asked.total}, but the launch has {world_size} process(es): the sizes of the "
                          f"axes multiply to the world size. Change a size, or launch {asked.total} processes.")
    return asked


def check_tensor_parallel_model(tensor: int, model_config) -> None:
    """A model Transformers can shard: its architecture has a TP plan (`base_model_tp_plan`, which `from_pretrained`
    follows; without one every rank fails while loading) and each rank holds whole heads."""
    if getattr(model_config, "base_model_tp_plan", None) is None:
        raise RecipeError(f"`tensor_parallel_size: {tensor}`: the model's architecture "
                          f"({getattr(model_config, 'model_type', 'unknown')}) has no tensor-parallel plan in "
                          "Transformers (its config's base_model_tp_plan is None): drop `tensor_parallel_size` and "
                          "shard it with ZeRO-3 or FSDP instead.")
    check_heads(tensor, model_config)


def check_heads(tensor: int, model_config) -> None:
    """Each rank of a TP group holds whole attention and key-value heads."""
    heads = getattr(model_config, "num_attention_heads", None)
    kv_heads = getattr(model_config, "num_key_value_heads", None) or heads
    for name, count in (("num_attention_heads", heads), ("num_key_value_heads", kv_heads)):
        if count is not None and count % tensor:
            divisors = [size for size in range(1, count + 1) if count % size == 0]
            raise RecipeError(f"`tensor_parallel_size: {tensor}` does not divide the model's {name} ({count}): "
                              f"each rank holds whole heads. Choose one of {divisors}.")


# Set by finetune.testing.parallelism_on_cpu, the one program under which Accelerate builds a TP mesh on CPU processes.
CPU_MESH_ALLOWED = "FINETUNE_PARALLELISM_ON_CPU"


def check(parallelism: Parallelism, model_config, *, strategy_kind: str, use_lora: bool, on_gpu: bool = True,
          environ=None, compiled: bool = False) -> None:
    """What cannot work, said before any process group: TP that does not divide the heads, tied embeddings under
    TP × FSDP2, axes under an engine that does not run them, TP on CPU processes outside the CPU twin's program
    (context parallelism without GPUs: `requested_on`)."""
    if not parallelism.named:
        return
    environ = os.environ if environ is None else environ
    if parallelism.loads_sharded and not on_gpu and environ.get(CPU_MESH_ALLOWED) != "1":
        raise RecipeError(f"`tensor_parallel_size: {parallelism.tensor_parallel_size}` on CPU processes: Accelerate "
                          "builds a tensor-parallel mesh for GPUs only. Its CPU twin runs under "
                          "`-m finetune.testing.parallelism_on_cpu` (accelerate_configs/cpu_tensor_parallel.yaml), "
                          "as `finetune train RECIPE.yaml --gpus 2 --strategy tensor_parallel` launches it.")
    tensor = parallelism.tensor_parallel_size
    if tensor > 1:
        check_tensor_parallel_model(tensor, model_config)
        if getattr(model_config, "tie_word_embeddings", False) and parallelism.dp_shard_size > 1:
            raise RecipeError(TIED_WITH_TP_AND_FSDP.format(tensor=tensor, shard=parallelism.dp_shard_size))
        if strategy_kind not in ("ddp", "single", "tensor_parallel"):
            raise RecipeError(f"`tensor_parallel_size: {tensor}` under {strategy_kind}: Transformers shards the model "
                              "itself while loading it (tensor parallel, with FSDP2 over `dp_shard_size`), so launch "
                              "it as plain processes (accelerate_configs/tensor_parallel.yaml, or `finetune train "
                              "--gpus N --strategy tensor_parallel`), not under a DeepSpeed or FSDP config.")
        if use_lora:
            raise RecipeError(f"`use_lora` with `tensor_parallel_size: {tensor}`: adapters on tensor-parallel layers "
                              "are not supported here; train LoRA under DDP, ZeRO or FSDP instead.")
        if compiled:  # seen on torch 2.13: dynamo stops in the first forward on every rank
            raise RecipeError(f"`torch_compile: true` with `tensor_parallel_size: {tensor}`: torch.compile cannot "
                              "trace the DTensor weights of Transformers' TP plan (dynamo fails while faking them: "
                              "\"Attempted to set the storage of a tensor ... to a storage on different device "
                              "meta\", the failure of pytorch/pytorch#119071); drop `torch_compile`, or train "
                              "without tensor parallelism.")
    if parallelism.sequence_parallel_size > 1 and strategy_kind != "deepspeed":
        raise RecipeError(f"`sequence_parallel_size: {parallelism.sequence_parallel_size}` runs through DeepSpeed "
                          "Ulysses (ALST): launch it under a DeepSpeed config (accelerate_configs/"
                          "sequence_parallel.yaml), not " + ("plain processes." if strategy_kind in ("ddp", "single")
                                                             else f"{strategy_kind}."))
