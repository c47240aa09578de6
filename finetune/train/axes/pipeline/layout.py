"""A pipeline launch's layout (`PipelineLayout`): how the launch's strategy names it and records it, and the
estimator's terms for its stages (finetune.memory.estimate asks a `Setup`'s axis for them): the parameters each
stage's ranks hold, their activations with the micro-batches the schedule keeps in flight, torch's receive buffers,
and the host RAM each rank takes to load its stage."""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import ClassVar

from finetune.memory.estimate import (
    ModelShape,
    Setup,
    _half_or_fp32,
    _torch_states,
    held_precisions,
    layer_split_parameters,
    layer_weight_cast_bytes,
    lora_target_names,
    saved_outside_layers_bytes,
    saved_per_layer_bytes,
    stage_tensor_parallel,
)
from finetune.train.axes.tensor import KEY as TENSOR_KEY
from finetune.train.axes.tensor.layout import whole_heads

# A step's rows are padded to its longest row rounded up to this many tokens (the multiple Transformers' collators
# pad to for tensor cores), which also bounds how many shapes the loop builds torch's schedule for.
STEP_LENGTH_MULTIPLE = 8


@dataclass(frozen=True)
class PipelineLayout:
    """`stages` consecutive stages of the model's layers (`pipeline_parallel_size`), one a process (a TP group of
    `tensor` processes under PP × TP), run by `schedule` (`pipeline_schedule`), handing the hidden
    states (and their gradients) from stage to stage in `hand_off` (`pipeline_hand_off_dtype`: fp32, or bf16 where
    the run computes in bf16). A launch's `Strategy` and the estimator's `Setup` carry it as their `axis`; it answers
    what they ask of an axis that runs its own loop."""

    stages: int
    schedule: str = "1f1b"
    hand_off: str = "fp32"
    tensor: int = 1
    name: ClassVar[str] = "pipeline"
    splits_tensor_parallelism: ClassVar[bool] = True  # each stage's layers over the mesh's tp ranks (3D)
    runs_its_own_loop: ClassVar[bool] = True  # finetune.train.axes.pipeline.loop
    shards_parameters: ClassVar[bool] = False  # each stage holds its layers whole (a TP group: split as planned)
    shard_degree: ClassVar[int] = 1

    # --- the launch's strategy (finetune.launch.strategies.Strategy)
    def label(self, strategy=None) -> str:
        """`pp2`, or `pp2_tp4` with tensor parallelism inside its stages."""
        return f"pp{self.stages}" + (f"_tp{self.tensor}" if self.tensor > 1 else "")

    def describe(self, strategy=None) -> str:
        return f"pipeline parallel {self.stages}" + (
            f" × tensor parallel {self.tensor} inside each stage" if self.tensor > 1 else "")

    def record(self, strategy=None) -> dict:
        """Its part of the strategy's record (effective_config.json, checkpoint markers)."""
        return {"pipeline_parallel_size": self.stages, **({TENSOR_KEY: self.tensor} if self.tensor > 1 else {})}

    # --- the estimator (finetune.memory.estimate.estimate)
    def matrix_split(self, shape: ModelShape) -> int:
        """A stage's layers are split over its TP group as the model's TP plan splits them."""
        return whole_heads(shape, self.tensor)

    def temporary_bytes(self, shape: ModelShape, setup: Setup, trainable: int) -> float:
        return 0  # torch's receive buffers are counted with the activations (`pipeline_activation_bytes`)

    def model_states(self, shape: ModelShape, setup: Setup) -> tuple:
        """Parameters, gradients, optimizer states and offloaded bytes of `setup.rank`'s stage: its layers in full
        fine-tuning, or under LoRA its base frozen (as loaded) and its layers' adapters trained."""
        if setup.lora_rank:
            return _torch_states(pipeline_stage_adapters(shape, setup),
                                 pipeline_stage_elements(shape, setup) * _half_or_fp32(setup), setup, shard_degree=1)
        return _torch_states(pipeline_stage_elements(shape, setup), 0, setup, shard_degree=1)

    def activations_bytes(self, shape: ModelShape, setup: Setup) -> float:
        return pipeline_activation_bytes(shape, setup)

    def loaded_rank_bytes(self, shape: ModelShape, setup: Setup) -> tuple[int, ...]:
        """Host RAM each global rank takes to load its part, by rank: its stage's on the (dp, pp, tp) mesh, TP
        innermost (`pipeline_loaded_stage_bytes`)."""
        stages = pipeline_loaded_stage_bytes(shape, setup)
        t = self.tensor
        return tuple(stages[rank // t % len(stages)] for rank in range(max(setup.num_gpus, len(stages) * t)))


def pipeline_stage_layers(num_layers: int, stages: int) -> list[range]:
    """Consecutive decoder layers for each pipeline stage, as even as whole layers go (earlier stages take the
    remainder: the last stage also holds the norm, the head and the loss). The split the pipeline loop cuts
    (finetune.train.axes.pipeline.loop) and the estimator counts."""
    base, extra = divmod(num_layers, stages)
    sizes = [base + (1 if stage < extra else 0) for stage in range(stages)]
    starts = [sum(sizes[:stage]) for stage in range(stages)]
    return [range(start, start + size) for start, size in zip(starts, sizes)]


def pipeline_stage_elements(shape: ModelShape, setup: Setup) -> int:
    """Parameters one rank of `setup.rank`'s pipeline stage holds: its layers (`pipeline_stage_layers`), the input
    embedding on the first stage, the final norm and the output head on the last; a tied head is a second copy of the
    embedding there. With tensor parallelism inside the stage (t ranks) each layer's linear matrices
    are split t ways as the model's TP plan splits them (q, k, v, gate, up by output rows, o and down by input
    columns: Megatron-LM's column- and row-parallel layers, Shoeybi et al. 2019), while the norms, the embedding and
    the head stay whole on every rank of the stage."""
    p, stage = setup.axis.stages, setup.rank
    layers = len(pipeline_stage_layers(shape.num_layers, p)[stage])
    embedding = shape.vocab_size * shape.hidden_size
    split = layer_split_parameters(shape)  # a layer's matrices (and column-parallel biases) t ways; its norms whole
    elements = layers * (shape.layer_parameters - split + split // stage_tensor_parallel(shape, setup))
    if stage == 0:
        elements += embedding
    if stage == p - 1:
        blocks = shape.num_layers * shape.layer_parameters
        norm = shape.num_parameters - blocks - embedding * (1 if shape.tied_embeddings else 2)
        elements += norm + embedding
    return elements


def pipeline_stage_adapters(shape: ModelShape, setup: Setup) -> int:
    """LoRA parameters `setup.rank`'s pipeline stage trains: r·(d_in + d_out) for each adapted matrix of its layers
    (`lora_trainable_parameters`' count, by layer; the stages refuse DoRA and `modules_to_save`). A linear's layer is
    the first index in its name (`model.layers.3.mlp.up_proj`)."""
    layers = pipeline_stage_layers(shape.num_layers, setup.axis.stages)[setup.rank]
    targets = lora_target_names(shape, setup.lora_target_modules)
    return sum(setup.lora_rank * (linear.in_features + linear.out_features) for linear in shape.linears
               if linear.in_layers and (targets is None or linear.name.rsplit(".", 1)[-1] in targets)
               and int(re.search(r"\.(\d+)\.", f".{linear.name}.").group(1)) in layers)


def pipeline_loaded_stage_bytes(shape: ModelShape, setup: Setup) -> tuple[int, ...]:
    """Host RAM each pipeline rank takes to load its stage (`fill_from_checkpoint` in
    finetune.train.axes.pipeline.stages), by stage: the model is built on the meta device and cut, then only the stage's
    tensors are read, each cast to its fp32 master as it is read: the stage in fp32 (a rank's TP share of it under
    tensor parallelism) and, at most, the largest tensor as stored (the half dtype under mixed precision) twice beside
    its cast (the file's pages mapped while it is read, and the tensor read whole from them before it is split). Under
    LoRA the frozen base is held as loaded (not cast) and the stage's adapters in fp32 beside it."""
    stored = _half_or_fp32(setup)

    def held(stage: int) -> int:
        elements = pipeline_stage_elements(shape, replace(setup, rank=stage))
        if setup.lora_rank:
            return stored * elements + 4 * pipeline_stage_adapters(shape, replace(setup, rank=stage))
        return 4 * elements

    return tuple(int(held(stage) + 2 * stored * shape.largest_layer_parameters)
                 for stage in range(setup.axis.stages))


def pipeline_activation_bytes(shape: ModelShape, setup: Setup) -> float:
    """A stage's activations at their peak: its share of the layers' saved activations for each micro-batch in
    flight (`pipeline_layer_bytes`), and torch's receive buffers (`pipeline_recv_buffer_bytes`). GPipe runs every
    forward before the first backward (all `gradient_accumulation_steps` micro-batches); 1F1B lets stage s hold
    p − s of them (the first stage the most). The loss's fp32 logits belong to the last stage, one micro-batch at a
    time. A step is `setup.sequence_length` long: the plan's PP row passes `max_seq_length` (the longest a step can be:
    the loop pads each step to its longest row), a run's memory report its longest step."""
    p, stage, m = setup.axis.stages, setup.rank, setup.gradient_accumulation_steps
    in_flight = m if setup.axis.schedule == "gpipe" else min(p - stage, m)
    layers = len(pipeline_stage_layers(shape.num_layers, p)[stage])
    blocks = layers * pipeline_layer_bytes(shape, setup, in_flight)
    if stage == p - 1:
        tokens = setup.micro_batch_size * setup.sequence_length
        blocks += saved_outside_layers_bytes(shape, setup) + (8 * tokens * shape.vocab_size
                                                              if setup.method.logits_held else 0)
    return blocks + pipeline_recv_buffer_bytes(shape, setup)


def pipeline_layer_bytes(shape: ModelShape, setup: Setup, in_flight: int) -> float:
    """One layer's saved bytes with `in_flight` micro-batches' forwards held: the activations once each, the
    half-precision casts of its fp32 weights once. With TP inside the stage both are a rank's (`saved_per_layer_bytes`
    divides the split parts by t as for tensor parallelism alone; the norms' and the linear layers' whole inputs
    stay). The loop runs a step's whole schedule inside one `torch.autocast`
    context, and autocast caches the cast of a leaf weight for the life of its outermost context
    (torch/amp/autocast_mode.py), so every micro-batch's backward reads the same cast (measured on fake tensors at
    Llama-3-8B width: `finetune.memory.saved.measure(..., micro_batches=m)`)."""
    casts = layer_weight_cast_bytes(shape, setup)
    return (saved_per_layer_bytes(shape, setup) - casts) * in_flight + casts


def pipeline_recv_buffer_bytes(shape: ModelShape, setup: Setup) -> int:
    """torch's receive buffers on stage `setup.rank` (each rank of it under TP: the hidden states are whole on every
    rank of a stage, replicated over its TP group): one per micro-batch for the hidden states arriving from the
    stage before (every stage but the first) and one for their gradients arriving from the stage after (every stage
    but the last), allocated for a step's length and kept while steps keep it (torch/distributed/pipelining/stage.py:
    `_create_act_recv_info`, `_create_grad_recv_info`), in the hand-off's dtype (`hand_off_bytes`)."""
    p, stage, m = setup.axis.stages, setup.rank, setup.gradient_accumulation_steps
    directions = (stage > 0) + (stage < p - 1)
    return directions * m * setup.micro_batch_size * setup.sequence_length * shape.hidden_size * \
        hand_off_bytes(setup)


def hand_off_bytes(setup: Setup) -> int:
    """Bytes of one hidden-state element handed between stages: 2 with a bf16 hand-off, else the residual's dtype
    (fp32 under mixed precision over fp32 masters; a LoRA stage's frozen bf16 embedding gives bf16 already)."""
    return 2 if setup.axis.hand_off == "bf16" else held_precisions(setup).residual


def pipeline_bubble_fraction(pipeline_parallel: int, micro_batches: int) -> float:
    """Idle fraction of a GPipe/1F1B schedule: (p − 1) / (m + p − 1) (Huang et al. 2019, "GPipe")."""
    return (pipeline_parallel - 1) / (micro_batches + pipeline_parallel - 1)
