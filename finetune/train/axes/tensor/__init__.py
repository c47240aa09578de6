"""Tensor parallelism's home on the axis seam: its key, its checks against the model and the launch, its plan row and
its self-launch, and the engine it runs as (`TensorSplit`, in layout.py: how a strategy names and records it, how it is
read back off a loaded model and a checkpoint, what a resume needs, its memory terms). Transformers applies it while
loading the model (`from_pretrained(..., distributed_config=DistributedConfig(tp_size, fsdp_size,
dp_replicate_size))`: the model's own TP plan, FSDP2 over the other ranks), and Trainer builds Accelerate's
`ParallelismConfig` from it; inside a pipeline's stages the pipeline splits the layers itself
(finetune.train.axes.pipeline.stages)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from finetune.axes import Axis
from finetune.errors import RecipeError

KEY = "tensor_parallel_size"
# Set by finetune.testing.parallelism_on_cpu, the one program under which Accelerate builds a TP mesh on CPU processes.
CPU_MESH_ALLOWED = "FINETUNE_PARALLELISM_ON_CPU"
# Transformers' FSDP2 path re-ties a tied `lm_head` to the embedding after sharding (transformers/distributed/fsdp.py);
# under tensor parallelism the head then computes with a stale copy of the shared weight from the first update on, so
# losses drift from a one-process run (measured: 0.013 at step 2 on the tiny preset, TP 2 × FSDP2 2).
TIED_WITH_TP_AND_FSDP = (
    "tied input and output embeddings (`tie_word_embeddings: true` in the model's config) with "
    "`tensor_parallel_size` {tensor} and `dp_shard_size` {shard}: Transformers' FSDP2 re-tying leaves `lm_head` "
    "computing with a stale copy of the shared weight after the first update, so the run would train a different "
    "model than one process does. Use `dp_shard_size: 1` (tensor parallelism alone, or `dp_replicate_size` for the "
    "other ranks), an untied model, or drop `tensor_parallel_size` for plain FSDP.")


@dataclass
class TensorArguments:
    tensor_parallel_size: int | None = field(
        default=None,
        metadata={"help": "Split each layer's matrices over this many processes (tensor parallelism: the model's own "
                          "TP plan, loaded sharded through Transformers' DistributedConfig); keep it within a node. "
                          "Must divide the attention and key-value heads. Launched as plain processes, not under a "
                          "DeepSpeed or FSDP config. Beside pipeline parallelism it splits each stage's layers "
                          "(PP × TP × DP: a multiple of pipeline × tensor processes; it must divide the MLP width "
                          "too)."},
    )


class TensorParallelism(Axis):
    name = "tensor_parallel"
    description = ("each layer's matrices split over several processes (the model's own TP plan), FSDP2 over the "
                   "ranks it leaves")
    arguments = TensorArguments
    size_key = KEY
    accelerate_size = "tp_size"
    launched_as = "ddp"  # plain processes: Transformers shards the model itself
    cpu_program = ("-m", "finetune.testing.parallelism_on_cpu")

    @classmethod
    def check_size(cls, size: int, model_config) -> None:
        check_tensor_parallel_model(size, model_config)

    def check(self, sections, parallelism, strategy):
        """Inside a pipeline's stages (an axis that `splits_tensor_parallelism`), the stage split; else what cannot
        work with the model loaded sharded, and the strategy becomes tensor parallel."""
        from finetune.launch.strategies import Strategy, is_true
        from finetune.memory.shapes import resolve_config

        config = resolve_config(sections.model.model_name_or_path)
        if any(axis.splits_tensor_parallelism for axis in sections.axes):
            check_stage_split(self.size, config)
            return strategy
        import torch

        training = sections.training_inputs
        check(parallelism, config, strategy_kind=strategy.kind,
              use_lora=sections.lora.use_lora or sections.lora.use_qlora,
              on_gpu=torch.cuda.is_available() and not is_true(training.get("use_cpu")),
              compiled=is_true(training.get("torch_compile")))
        if strategy.kind != self.name:
            source = "the recipe" if self.size_key in sections.sources else (strategy.source or "the launch")
            strategy = Strategy.of_axis(self.engine_layout(parallelism), source, strategy.nodes)
        return strategy

    # --- the engine it runs as (finetune.launch.strategies, finetune.checkpoints.complete)
    @classmethod
    def engine_layout(cls, parallelism):
        from finetune.train.axes.tensor.layout import TensorSplit

        size = parallelism.size(cls.size_key)
        return TensorSplit(size, parallelism.dp_shard_size, parallelism.dp_replicate_size) if size > 1 else None

    @classmethod
    def loaded_layout(cls, model):
        from finetune.train.axes.tensor.layout import TensorSplit

        return TensorSplit.of_model(model)

    @classmethod
    def recorded_layout(cls, record: dict):
        from finetune.train.axes.tensor.layout import TensorSplit

        return TensorSplit.from_record(record)

    @classmethod
    def files_a_resume_needs(cls, marker: dict, needs: list[list[str]]) -> list[list[str]]:
        """The gathered weights, the slices a resume loads (finetune.checkpoints.sharded_state) and the scheduler."""
        from finetune.checkpoints.sharded_state import STATE_FOLDER

        return [*needs, ["model.safetensors", "model.safetensors.index.json"], [f"{STATE_FOLDER}/.metadata"],
                ["scheduler.pt"]]

    def plan_launch(self, recipe: str, overrides: list[str], machine, sections) -> dict | None:
        """A model Transformers cannot shard fails on every rank: refused before the launch, which then goes as the
        recipe names it (plain processes)."""
        from finetune.memory.shapes import resolve_config

        check_tensor_parallel_model(self.size, resolve_config(sections.model.model_name_or_path))
        return None

    @classmethod
    def plan_rows(cls, request, shape, micro_batch_size: int) -> list[dict]:
        """TP × FSDP2: each layer's matrices split over a node's GPUs, FSDP2 over the rest; the split layers'
        activations ÷ t; per layer and micro-batch, 2 all-reduces of the hidden states forward and 2 backward (NVLink
        only). Full fine-tuning only (LoRA is refused here)."""
        from finetune.plan.decision_tree import _axis_row, _size, head_split, hidden_states_bytes

        if request.gpus < 2 or request.lora_rank or request.qlora:
            return []
        hidden = hidden_states_bytes(request, shape, micro_batch_size)
        tensor = head_split(request, shape)
        if tensor < 2:
            return []
        shard = request.gpus // tensor
        from finetune.train.axes.tensor.layout import TensorSplit

        options = {"strategy": cls.name, "axis": TensorSplit(tensor, shard)}
        name = f"TP {tensor}" + (f" × FSDP2 {shard}" if shard > 1 else "")
        return [_axis_row(request, shape, micro_batch_size, name, cls.name, options,
                          {f"--{cls.size_key}": tensor, "--dp_shard_size": shard}, "accelerate_configs/ddp.yaml",
                          shard, f"all-reduce per layer and micro-batch: 4 × {_size(hidden)} (NVLink)",
                          f"TP {tensor} splits each layer's matrices within a node: the split layers' activations ÷ "
                          f"{tensor}, states over all {request.gpus} GPUs")]


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


def check_stage_split(tensor: int, model_config) -> None:
    """A pipeline stage's layers split over `tensor` ranks as the model's TP plan says (`base_model_tp_plan`): whole
    attention and key-value heads on each rank, and the MLP's width cut evenly."""
    check_tensor_parallel_model(tensor, model_config)
    width = getattr(model_config, "intermediate_size", None)
    if width is not None and width % tensor:
        raise RecipeError(f"`tensor_parallel_size: {tensor}` does not divide the model's MLP width "
                          f"(intermediate_size {width}): each rank holds an equal slice of it. Choose a size "
                          f"that divides {width}.")


def check(parallelism, model_config, *, strategy_kind: str, use_lora: bool, on_gpu: bool = True, environ=None,
          compiled: bool = False) -> None:
    """What cannot work with the model loaded sharded, said before any process group: TP that does not divide the
    heads, tied embeddings under TP × FSDP2, an engine that does not run it, LoRA, torch.compile, and CPU processes
    outside the CPU twin's program."""
    tensor = parallelism.size(TensorParallelism.size_key)
    if tensor <= 1:
        return
    environ = os.environ if environ is None else environ
    if not on_gpu and environ.get(CPU_MESH_ALLOWED) != "1":
        raise RecipeError(f"`tensor_parallel_size: {tensor}` on CPU processes: Accelerate builds a tensor-parallel "
                          "mesh for GPUs only. Its CPU twin runs under `-m finetune.testing.parallelism_on_cpu` "
                          "(accelerate_configs/cpu_tensor_parallel.yaml), as `finetune train RECIPE.yaml --gpus 2 "
                          "--strategy tensor_parallel` launches it.")
    check_tensor_parallel_model(tensor, model_config)
    if getattr(model_config, "tie_word_embeddings", False) and parallelism.dp_shard_size > 1:
        raise RecipeError(TIED_WITH_TP_AND_FSDP.format(tensor=tensor, shard=parallelism.dp_shard_size))
    if strategy_kind not in ("ddp", "single", "tensor_parallel"):
        raise RecipeError(f"`tensor_parallel_size: {tensor}` under {strategy_kind}: Transformers shards the model "
                          "itself while loading it (tensor parallel, with FSDP2 over `dp_shard_size`), so launch it "
                          "as plain processes (accelerate_configs/tensor_parallel.yaml, or `finetune train --gpus N "
                          "--strategy tensor_parallel`), not under a DeepSpeed or FSDP config.")
    if use_lora:
        raise RecipeError(f"`use_lora` with `tensor_parallel_size: {tensor}`: adapters on tensor-parallel layers are "
                          "not supported here; train LoRA under DDP, ZeRO or FSDP instead.")
    if compiled:  # seen on torch 2.13: dynamo stops in the first forward on every rank
        raise RecipeError(f"`torch_compile: true` with `tensor_parallel_size: {tensor}`: torch.compile cannot trace "
                          "the DTensor weights of Transformers' TP plan (dynamo fails while faking them: \"Attempted "
                          "to set the storage of a tensor ... to a storage on different device meta\", the failure "
                          "of pytorch/pytorch#119071); drop `torch_compile`, or train without tensor parallelism.")
