"""Predicted memory per GPU (and per host under offload) for a model shape and a training setup.

Model states follow what DeepSpeed and Trainer really allocate, measured on real runs by
`MemoryReportCallback` (tests/memory/test_memory_distributed.py), which is not always the ZeRO paper's count:

- DeepSpeed casts the model to the half dtype and keeps an fp32 master copy; at the optimizer step a rank
  holds its gradient partition in the model dtype and an fp32 copy of it (`stage_1_and_2.py::step`,
  `stage3.py::_prepare_fp32_grad_for_sub_group`). With Ψ trainable parameters, N ranks and Adam:
  ZeRO-1/2 = 2Ψ + (2 + 4 + 4 + 8)Ψ/N, ZeRO-3 = (2 + 2 + 4 + 4 + 8)Ψ/N. This is DeepSpeed's own
  18 bytes/param (`estimate_zero2_model_states_mem_needs`), not the paper's 12 (arXiv 1910.02054).
  At the step DeepSpeed's ZeRO-1 holds gradients just as ZeRO-2 does (measured: same bytes per rank); ZeRO-3 makes
  the fp32 copy one `sub_group_size` group at a time, so it holds 4·min(sub_group_size, Ψ/N).
- The step is not always the peak: under gradient accumulation ZeRO-1 keeps the full gradients in the model dtype
  between micro-steps (it reduces only at the boundary), ZeRO-2/3 only their partition
  (`grads_between_micro_steps_bytes`; measured in tests/memory/test_memory_peaks.py).
- Loading comes before sharding: unless only global rank 0 reads the checkpoint (ZeRO-3, FSDP2 with
  `fsdp_cpu_ram_efficient_loading`) every local rank materialises the whole model in host RAM
  (`host_load_bytes_per_node`, `host_load_bytes_of_rank`).
- In fp32, DeepSpeed still clones the fp32 partition for the optimizer (4Ψ/N more than the paper's 16Ψ).
- Without DeepSpeed (single GPU, DDP, FSDP), Trainer's mixed precision is autocast: weights, gradients
  and Adam states stay fp32 (4 + 4 + 8 = 16 bytes/param), because the toolkit holds trainable parameters in fp32
  whatever the checkpoint's dtype (`finetune.models.loading.trainable_dtype`; Trainer alone would train a bf16
  checkpoint
  in pure bf16); frozen weights stay in the loaded dtype. DDP adds its gradient buckets (4Ψ, a copy of
  the gradients, `gradient_as_bucket_view=False`). `pure_bf16` holds all three in bf16: torch's AdamW keeps its
  moments in the parameter's dtype (`torch/optim/adamw.py`, `zeros_like(p)`), so 2 + 2 + 4 = 8 bytes/param.

A training method adds its own terms (`MethodTerms`, declared by each method in finetune/train/methods/): a
preference method's frozen reference model (`reference_model_bytes`), two sequences per example (a chosen and a
rejected answer), logits it never holds whole; an online RL method's generation round (`generation_bytes`: the KV
cache of every completion a rank generates at once, at the prompt and completion length) and its frozen reward
models (`reward_models_bytes`).

Activations are counted tensor by tensor as autograd saves them for today's decoder block (RMSNorm, gated MLP,
grouped-query attention, LoRA adapters with their dropout) under the dtypes each strategy holds, and checked against
`finetune.memory.saved`, which measures those bytes at real widths; plus the loss's fp32 log-probabilities and the
transient of its backward. Liger Kernel's fused kernels (`FusedKernels`) change those terms by what their autograd
functions keep, counted from Liger's code: they do not run on a CPU, so that count is not measured.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from finetune.configs.deepspeed import BUCKET_SIZE, partition_elements
from finetune.errors import RecipeError
from finetune.launch.strategies import FSDP_SHARDING, PURE_BF16_KINDS, STRATEGIES
from finetune.memory.shapes import ModelShape

PRECISIONS = ("fp32", "bf16", "fp16")


def precision_of(mixed_precision: str) -> str:
    """The estimator's name for Accelerate's and Transformers' mixed precision (`args.mixed_precision`: no, bf16,
    fp16)."""
    return "fp32" if mixed_precision == "no" else mixed_precision


@dataclass(frozen=True)
class MethodTerms:
    """What a training method adds to the memory of plain supervised fine-tuning (its method file declares them)."""

    reference_model: bool = False      # a frozen copy of the starting model beside the policy (none under LoRA)
    sequences_per_example: int = 1     # sequences in one forward per example (a pair: chosen and rejected)
    logits_held: bool = True           # the (batch, sequence, vocab) logits are held for the loss
    completion_length: int = 0         # online RL: new tokens the policy generates per completion (0: no generation)
    steps_per_generation: int | None = None  # micro-batches one generation round feeds (None: an optimizer step's)
    reward_model_parameters: int = 0   # frozen reward models beside the policy (scorers of the completions)
    gathers_for_generation: bool = True  # ZeRO-3: the whole policy gathered onto every GPU for a round (TRL's
                                         # `ds3_gather_for_generation`, on by default)
    fused_head: bool = False           # TRL's fused LM head scores the tokens in tiles (trl/trainer/utils.py
                                       # `add_fused_lm_head`): no logits, and no cast of the head's weight, is kept

    @property
    def generates(self) -> bool:
        return self.completion_length > 0


# Liger Kernel's defaults for the decoders the estimator models (Llama, Mistral, Mixtral, Qwen2/3, Phi-3, OLMo-2:
# liger_kernel/transformers/monkey_patch.py `apply_liger_kernel_to_llama` and its siblings, Liger 0.8.5). Trainer
# passes `liger_kernel_config` over them (`_apply_liger_kernel_to_instance(model, **liger_kernel_config)`).
LIGER_DEFAULTS = {"rope": True, "rms_norm": True, "swiglu": True, "cross_entropy": False,
                  "fused_linear_cross_entropy": True}


def liger_config_given(liger_kernel_config) -> dict:
    """Trainer's `liger_kernel_config` as a dict: given as one in a recipe, or as its JSON text on a command line."""
    import json

    config = liger_kernel_config or {}
    return json.loads(config) if isinstance(config, str) else dict(config)


@dataclass(frozen=True)
class FusedKernels:
    """Which of Liger Kernel's fused kernels are patched into the model (Trainer's `use_liger_kernel`, with
    `liger_kernel_config`); all off: PyTorch's and Transformers' own modules. Counted from Liger's code
    (`saved_per_layer_bytes`, `saved_outside_layers_bytes`, `loss_transient_bytes`), not measured: Liger's kernels
    are Triton and do not run on the CPU."""

    rope: bool = False                        # LigerRopeFunction: rotates q and k in place, keeps the shared cos, sin
    rms_norm: bool = False                    # LigerRMSNormFunction: keeps the input and the fp32 1/rms of each row
    swiglu: bool = False                      # LigerSiLUMulFunction: keeps gate and up outputs, recomputes silu
    cross_entropy: bool = False               # LigerCrossEntropyFunction: writes the gradient into the fp32 logits
    fused_linear_cross_entropy: bool = False  # LigerFusedLinearCrossEntropyFunction: head and loss in chunks, their
                                              # gradients computed in the forward and kept for the backward

    @classmethod
    def from_trainer_arguments(cls, use_liger_kernel, liger_kernel_config=None) -> FusedKernels:
        """The kernels Trainer applies for these arguments: none without `use_liger_kernel`, else Liger's defaults
        with `liger_kernel_config` (a dict, or its JSON text as given on a command line) over them. Keys Liger's
        patch for the model does not take are dropped, as Liger drops them."""
        from finetune.launch.strategies import is_true

        if not is_true(use_liger_kernel):
            return cls()
        config = liger_config_given(liger_kernel_config)
        asked = {**LIGER_DEFAULTS, **{key: is_true(value) for key, value in config.items() if key in LIGER_DEFAULTS}}
        return cls(**asked)

    @property
    def names(self) -> tuple[str, ...]:
        """The kernels on, by their `liger_kernel_config` keys."""
        return tuple(key for key in LIGER_DEFAULTS if getattr(self, key))


# Bytes of optimizer state per trainable parameter, besides any master copy.
OPTIMIZER_STATE_BYTES = {
    "adamw": 8,        # momentum + variance, fp32
    "adamw_8bit": 2,   # bitsandbytes: both moments in 8 bits (block-wise constants are negligible)
    "sgd": 0,          # Trainer's "sgd" has no momentum
}
# QLoRA: NF4 weights (0.5 byte) + one 8-bit absmax per 64 weights + one fp32 constant per 256 of those
# (double quantization, Dettmers et al. 2023, "QLoRA").
NF4_BYTES_PER_PARAMETER = 0.5 + 1 / 64 + 4 / (64 * 256)
GiB = 1024**3
DEEPSPEED_SUB_GROUP_SIZE = 1_000_000_000  # deepspeed/runtime/zero/config.py: `sub_group_size: int = pp_int(1e9)`


@dataclass(frozen=True)
class Setup:
    """How a model is trained. Field names follow Trainer, DeepSpeed and Accelerate."""

    strategy: str = "ddp"
    num_gpus: int = 1
    gpus_per_node: int | None = None          # default: all GPUs on one node
    zero_stage: int = 0                       # DeepSpeed only
    offload_optimizer: str | None = None      # "cpu" or "nvme" (DeepSpeed)
    offload_param: str | None = None          # "cpu" or "nvme" (DeepSpeed ZeRO-3)
    fsdp_sharding: str = "full_shard"
    beside: tuple = ()                        # axes of Accelerate's mesh beside the engine (finetune.axes):
                                              # their layouts, each giving the share of a sequence a GPU computes
                                              # (`activation_share`: Ulysses' 1/sp); ZeRO still shards over every GPU
    axis: Any = None                          # an axis that takes the engine's place (finetune.axes): its
                                              # layout (a pipeline's stages, `rank`'s among them; the model loaded
                                              # tensor-parallel), which answers for its model states, activations,
                                              # buffers and loading; `strategy` is its name
    rank: int = 0                             # the global rank predicted, where ranks hold unequal shares (TP)
    precision: str = "bf16"                   # "fp32", or mixed "bf16"/"fp16"
    pure_bf16: bool = False                   # trainable weights, gradients and Adam states in bf16 (no fp32 master)
    optimizer: str = "adamw"
    lora_rank: int = 0                        # 0: full fine-tuning
    lora_target_modules: tuple[str, ...] | None = None  # None or ("all-linear",): every linear layer in the blocks;
                                              # ("attention",): those inside attention modules
    dora: bool = False                        # DoRA: a trained magnitude per output feature of each adapted layer
    lora_modules_to_save: tuple[str, ...] | None = None  # modules trained in full beside the adapters (a copy each)
    qlora: bool = False                       # 4-bit NF4 base weights (needs lora_rank)
    lora_dropout: float = 0.0                 # dropout on the adapters' input: each keeps a copy and a mask
    micro_batch_size: int = 1
    sequence_length: int = 2048
    gradient_checkpointing: bool = False
    attention: str = "sdpa"                   # "sdpa"/"flash_attention_2" (no s² scores) or "eager"
    packed: bool = False                      # rows of several examples told apart by restarting position ids
    reduce_bucket_size: int | None = None     # DeepSpeed, elements; None: the shipped configs' (BUCKET_SIZE; ZeRO-3
                                              # "auto", which Trainer fills with hidden²)
    overlap_comm: bool = True
    trainable_parameters: int | None = None   # exact count from a live model; otherwise derived from LoRA
    gradient_accumulation_steps: int = 1      # micro-batches per optimizer step (Trainer's name)
    sub_group_size: int | None = None         # DeepSpeed ZeRO-3, elements; None: DeepSpeed's default (1e9)
    sharded_loading: bool = True              # ZeRO-3 and FSDP: only global rank 0 reads the checkpoint (ZeRO-3
                                              # always under `finetune train`; FSDP2 with
                                              # `fsdp_cpu_ram_efficient_loading`, as shipped)
    hpz_partition_size: int | str | None = None  # ZeRO++ hpZ: a secondary weight copy split over this many GPUs;
                                              # "auto": the GPUs of one node, as `finetune train` fills it
    method: MethodTerms = field(default_factory=MethodTerms)  # what the training method adds (reference, pairs)
    peft: bool = False                        # a live model with peft adapters (its lora_rank need not be known):
                                              # a reference model is then the policy with its adapters disabled
    kernels: FusedKernels = field(default_factory=FusedKernels)  # Liger's fused kernels patched into the model
    vision_tower_frozen: bool = True          # a vision-language model's tower keeps its weights (and saves no
                                              # activations: nothing before it trains); `freeze_vision_tower`
    projector_frozen: bool = False            # its projector keeps its weights (`freeze_projector`)
    image_tokens: int = 0                     # image tokens in one micro-batch (all its rows'); each stands for
                                              # `patches_per_token` patches the tower computes

    @property
    def applied_kernels(self) -> FusedKernels:
        """The fused kernels the forward really runs: Trainer applies Liger's at the start of `train`, which the
        own loop of an axis never calls (a pipeline's: finetune.train.axes.pipeline.loop), so it runs PyTorch's
        own."""
        return FusedKernels() if self.axis is not None and self.axis.runs_its_own_loop else self.kernels

    @property
    def liger_loss(self) -> str | None:
        """Which of Liger's losses computes this run's loss: `fused_linear_cross_entropy`, `cross_entropy`, or None.
        Either replaces only a loss computed from the model's full logits (the model's forward given labels):
        TRL's trainers turn Liger's fused one off for their own fused heads and log-probabilities
        (trl/trainer/sft_trainer.py and its other trainers: `"fused_linear_cross_entropy": False`)."""
        kernels = self.applied_kernels
        if not self.method.logits_held:
            return None
        if kernels.fused_linear_cross_entropy:
            return "fused_linear_cross_entropy"
        return "cross_entropy" if kernels.cross_entropy else None

    @property
    def nodes(self) -> int:
        return max(1, self.num_gpus // (self.gpus_per_node or self.num_gpus))

    @property
    def hpz_group(self) -> int:
        """GPUs ZeRO++'s secondary weight copy is split over (1: no copy)."""
        if self.strategy != "deepspeed" or self.zero_stage != 3 or self.hpz_partition_size in (None, 1):
            return 1
        if self.hpz_partition_size == "auto":
            return self.gpus_per_node or self.num_gpus
        return int(self.hpz_partition_size)

    @property
    def shard_degree(self) -> int:
        """Ranks a model state is split over."""
        if self.strategy == "deepspeed" and self.zero_stage > 0:
            return self.num_gpus
        if self.axis is not None:
            return self.axis.shard_degree
        if self.strategy == "fsdp" and self.fsdp_sharding == "hybrid_shard":
            return self.gpus_per_node or self.num_gpus  # shard within a node, replicate across nodes
        if self.strategy == "fsdp" and self.fsdp_sharding != "no_shard":
            return self.num_gpus
        return 1

    def check(self) -> None:
        kinds = (*STRATEGIES, self.axis.name) if self.axis is not None else STRATEGIES
        choices = {"strategy": (self.strategy, kinds), "precision": (self.precision, PRECISIONS),
                   "optimizer": (self.optimizer, tuple(OPTIMIZER_STATE_BYTES)),
                   "fsdp_sharding": (self.fsdp_sharding, FSDP_SHARDING)}
        for key, (value, allowed) in choices.items():
            if value not in allowed:
                raise RecipeError(f"`{key}: {value}` is not one of {', '.join(allowed)}.")
        if self.zero_stage not in (0, 1, 2, 3):
            raise RecipeError(f"`zero_stage: {self.zero_stage}` must be 0, 1, 2 or 3.")
        if min(self.num_gpus, self.micro_batch_size, self.sequence_length, self.gradient_accumulation_steps) < 1:
            raise RecipeError("num_gpus, micro_batch_size, sequence_length and gradient_accumulation_steps must be "
                              "positive.")
        if self.sub_group_size is not None and self.sub_group_size < 1:
            raise RecipeError(f"`sub_group_size: {self.sub_group_size}` must be a positive number of elements.")
        if self.strategy == "single" and self.num_gpus != 1:
            raise RecipeError("strategy `single` runs on one GPU; use ddp, deepspeed or fsdp for more.")
        if (self.offload_optimizer or self.offload_param) and self.strategy != "deepspeed":
            raise RecipeError("offload is modelled for DeepSpeed only (strategy: deepspeed).")
        if self.offload_param and self.zero_stage != 3:
            raise RecipeError("offload_param needs ZeRO stage 3: only stage 3 partitions parameters.")
        if self.pure_bf16 and (self.strategy not in PURE_BF16_KINDS or self.precision == "fp16"):
            raise RecipeError("pure_bf16 is modelled for one process and DDP without fp16 (finetune.recipe.preflight).")
        if self.qlora and not self.lora_rank:
            raise RecipeError("QLoRA trains LoRA adapters on a 4-bit base: set lora_rank too.")
        if self.kernels.cross_entropy and self.kernels.fused_linear_cross_entropy:
            raise RecipeError("Liger's `cross_entropy` and `fused_linear_cross_entropy` cannot both be on "
                              "(liger_kernel_config): the fused one already computes the loss.")


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per GPU; `offloaded` is per rank on the offload device (host RAM or NVMe)."""

    setup: Setup
    num_parameters: int
    trainable_parameters: int
    params_bytes: int
    grads_bytes: int
    optimizer_bytes: int
    activations_bytes: int
    temporary_bytes: int
    offloaded: dict = field(default_factory=dict)
    grads_between_micro_steps_bytes: int = 0  # on the GPU between two micro-steps of one accumulation window
    loaded_model_bytes: int = 0               # the whole model as a rank that loads it holds it (host RAM)
    loaded_rank_bytes: tuple = ()             # an axis whose ranks load unequal parts (a pipeline's stages): what
                                              # each global rank loads (host RAM), by rank
    reference_bytes: int = 0                  # a preference method's frozen reference model on this GPU
    generation_bytes: int = 0                 # online RL: one generation round's KV cache and logits on this GPU
    reward_models_bytes: int = 0              # online RL: its frozen reward models on this GPU

    @property
    def model_states_bytes(self) -> int:
        """Parameters, gradients and optimizer states held at the optimizer step."""
        return self.params_bytes + self.grads_bytes + self.optimizer_bytes

    @property
    def grads_peak_bytes(self) -> int:
        """Gradients at their peak: at the step, or between micro-steps where accumulation holds more."""
        return max(self.grads_bytes, self.grads_between_micro_steps_bytes)

    @property
    def total_bytes(self) -> int:
        """Predicted peak allocated on one GPU: every part counted as live at once, gradients at their peak (an
        upper bound: in practice activations shrink as gradients appear)."""
        return (self.params_bytes + self.grads_peak_bytes + self.optimizer_bytes + self.reference_bytes
                + self.reward_models_bytes + max(self.activations_bytes + self.temporary_bytes, self.generation_bytes))

    @property
    def host_load_bytes_per_node(self) -> int:
        """Host RAM the busiest node needs while the model loads, before sharding."""
        if self.loaded_rank_bytes:  # each rank its own part (a pipeline's stage): the node's ranks together
            per_node, ranks = self.setup.gpus_per_node or self.setup.num_gpus, self.loaded_rank_bytes
            return max(sum(ranks[start:start + per_node]) for start in range(0, len(ranks), per_node))
        return int(host_load_bytes_per_node(self.loaded_model_bytes, self.setup))

    def host_load_bytes_of_rank(self, rank: int, device_is_host: bool = False) -> int:
        if self.loaded_rank_bytes:
            return self.loaded_rank_bytes[rank % len(self.loaded_rank_bytes)]
        return int(host_load_bytes_of_rank(self.loaded_model_bytes, self.setup, rank, device_is_host))

    @property
    def host_bytes_per_node(self) -> int:
        """Host RAM (or NVMe) one node's ranks fill with offloaded states, without pinned-buffer slack."""
        return sum(self.offloaded.values()) * (self.setup.gpus_per_node or self.setup.num_gpus)

    def fits(self, gpu_memory_bytes: float, headroom: float = 0.9) -> bool:
        """Fits when the prediction stays under `headroom` of the GPU (the rest: CUDA context, fragmentation)."""
        return self.total_bytes <= headroom * gpu_memory_bytes

    def to_dict(self) -> dict:
        return {
            "setup": asdict(self.setup),
            "num_parameters": self.num_parameters,
            "trainable_parameters": self.trainable_parameters,
            "per_gpu": {"params_bytes": self.params_bytes, "grads_bytes": self.grads_bytes,
                        "grads_between_micro_steps_bytes": self.grads_between_micro_steps_bytes,
                        "grads_peak_bytes": self.grads_peak_bytes,
                        "optimizer_bytes": self.optimizer_bytes, "activations_bytes": self.activations_bytes,
                        "temporary_bytes": self.temporary_bytes, "reference_bytes": self.reference_bytes,
                        "generation_bytes": self.generation_bytes, "reward_models_bytes": self.reward_models_bytes,
                        "total_bytes": self.total_bytes},
            "offloaded_per_rank": dict(self.offloaded),
            "host_bytes_per_node": self.host_bytes_per_node,
            "host_load_bytes_per_node": self.host_load_bytes_per_node,
        }


def estimate(shape: ModelShape, setup: Setup) -> MemoryEstimate:
    setup.check()
    if setup.lora_rank:  # the whole base is frozen; adapters come on top of it
        trainable = setup.trainable_parameters or lora_trainable_parameters(shape, setup) + vision_trained(shape, setup)
        frozen = shape.num_parameters
    else:
        trainable = setup.trainable_parameters or shape.num_parameters - vision_frozen(shape, setup)
        frozen = shape.num_parameters - trainable
    quantized = shape.block_linear_parameters if setup.qlora else 0
    # QLoRA: what is not quantized (embeddings, norms, head) is fp32 where peft's k-bit preparation upcasts it
    unquantized = 4 if setup.qlora and held_precisions(setup).residual == 4 else _half_or_fp32(setup)
    frozen_bytes = (frozen - quantized) * unquantized + quantized * NF4_BYTES_PER_PARAMETER

    if setup.strategy == "deepspeed":
        params, grads, optimizer, offloaded = _deepspeed_states(trainable, frozen_bytes, setup,
                                                                shape.largest_layer_parameters)
    elif setup.axis is not None:  # what `setup.rank` holds of the model (a pipeline's stage, its TP slices)
        params, grads, optimizer, offloaded = setup.axis.model_states(shape, setup)
    else:
        params, grads, optimizer, offloaded = _torch_states(trainable, frozen_bytes, setup)
    return MemoryEstimate(
        setup=setup,
        num_parameters=frozen + trainable,
        trainable_parameters=trainable,
        params_bytes=int(params),
        grads_bytes=int(grads),
        optimizer_bytes=int(optimizer),
        activations_bytes=int((setup.axis.activations_bytes(shape, setup) if setup.axis is not None
                               else activation_bytes(shape, sequence_share(setup)))
                              + vision_activation_bytes(shape, setup)),
        temporary_bytes=int(temporary_bytes(shape, setup, trainable)),
        offloaded={key: int(value) for key, value in offloaded.items() if value},
        grads_between_micro_steps_bytes=int(grads_between_micro_steps(trainable, grads, setup)),
        loaded_model_bytes=int(loaded_model_bytes(trainable, frozen_bytes, setup) + reference_load_bytes(shape, setup)),
        loaded_rank_bytes=setup.axis.loaded_rank_bytes(shape, setup) if setup.axis is not None else (),
        reference_bytes=int(reference_model_bytes(shape, setup)),
        generation_bytes=int(generation_bytes(shape, setup)),
        reward_models_bytes=int(frozen_model_bytes(setup.method.reward_model_parameters, setup)),
    )


def layer_weight_cast_bytes(shape: ModelShape, setup: Setup) -> float:
    """The half-precision copies autocast makes of one block's fp32 trainable weights (full fine-tuning under mixed
    precision: c bytes per weight), kept for the backward; none where the weights are already in the compute dtype,
    under LoRA (a frozen base), or with gradient checkpointing (recomputed)."""
    precision = held_precisions(setup)
    if setup.lora_rank or setup.peft or setup.gradient_checkpointing or precision.weights == precision.compute:
        return 0
    casts = precision.compute * sum(linear.in_features * linear.out_features for _, linear in _block_linears(shape))
    return casts / stage_tensor_parallel(shape, setup)  # under TP each rank casts its own slices


def layer_split_parameters(shape: ModelShape) -> int:
    """One decoder layer's parameters a TP plan splits: its linear matrices and the biases of its column-parallel
    projections, which torch's `ColwiseParallel` shards with the matrix's rows (Qwen2's q, k and v biases). A shape
    records no biases: they are what a layer holds beyond its matrices and its two norms, taken as split when they
    are exactly q, k and v's outputs; anything else there (Qwen3's per-head q and k norms) stays whole."""
    linears = dict(_block_linears(shape))
    matrices = shape.block_linear_parameters // shape.num_layers
    projections = sum(linears[name].out_features for name in ("q_proj", "k_proj", "v_proj") if name in linears)
    beyond = shape.layer_parameters - matrices - 2 * shape.hidden_size
    return matrices + (projections if projections and beyond == projections else 0)


def stage_tensor_parallel(shape: ModelShape, setup: Setup) -> int:
    """The ways a decoder layer's matrices are split on one GPU: as the axis in the engine's place splits them
    (tensor parallelism, alone or inside a pipeline's stages), else 1."""
    return setup.axis.matrix_split(shape) if setup.axis is not None else 1


def sequence_share(setup: Setup) -> Setup:
    """The sequence one GPU computes activations for: its share under each axis beside the engine
    (`Setup.beside`)."""
    for axis in setup.beside:
        setup = axis.activation_share(setup)
    return setup


def reference_model_bytes(shape: ModelShape, setup: Setup) -> float:
    """A preference method's frozen reference model on one GPU, as TRL prepares it (trl/models/utils.py): none under
    LoRA (the reference is the policy with its adapters disabled); under DeepSpeed an inference engine of the whole
    model in the half dtype, ZeRO-3 partitioned like the policy (`prepare_deepspeed`: stage 3 kept, any other stage
    run as 0); under FSDP sharded like the policy (`prepare_fsdp`); under DDP or one GPU a whole copy in the loaded
    dtype."""
    if not setup.method.reference_model or setup.lora_rank or setup.peft:
        return 0
    return frozen_model_bytes(shape.num_parameters, setup)


def reference_load_bytes(shape: ModelShape, setup: Setup) -> float:
    """Host RAM a rank that loads the model also takes for a preference method's reference, loaded after the policy
    and as it was (finetune.train.methods.trl_trainers `load_reference`): the whole model as loaded, frozen, so not
    cast; under sharded loading on global rank 0 only (`host_load_bytes_of_rank`)."""
    if not setup.method.reference_model or setup.lora_rank or setup.peft:
        return 0
    return shape.num_parameters * _half_or_fp32(setup)


def frozen_model_bytes(parameters: int, setup: Setup) -> float:
    """A frozen model beside the policy (a reference, a reward model) on one GPU, as TRL prepares one: under
    DeepSpeed an inference engine in the half dtype, ZeRO-3 partitioned; under FSDP sharded like the policy; else
    whole."""
    model = parameters * _half_or_fp32(setup)
    if setup.strategy == "deepspeed":
        return model / setup.num_gpus if setup.zero_stage == 3 else model
    return model / setup.shard_degree


def generated_at_once(setup: Setup) -> int:
    """Completions one rank generates in one round (TRL's GRPO: the micro-batches of `steps_per_generation`, by
    default an optimizer step's, generated together)."""
    return setup.micro_batch_size * (setup.method.steps_per_generation or setup.gradient_accumulation_steps)


def kv_cache_bytes_per_token(shape: ModelShape, setup: Setup) -> int:
    """Key and value of every layer for one token of one sequence. Values come out of the projection in the compute
    dtype; keys are rotated by cos/sin, which are in the hidden states' dtype, so with fp32 masters under autocast
    (one GPU, DDP: an fp32 embedding) the cache keeps fp32 keys beside bf16 values, 1.5× a bf16 cache (measured on
    CPU under autocast, tests/train/test_grpo.py). DeepSpeed's and FSDP2's half-precision module keeps both bf16."""
    precision = held_precisions(setup)
    return shape.num_layers * shape.kv_width * (precision.residual + precision.compute)


def generation_bytes(shape: ModelShape, setup: Setup) -> int:
    """One generation round of an online RL method on one GPU: the KV cache of every completion generated at once
    (`generated_at_once`), each `sequence_length` tokens long at the end (its prompt and completion), the
    next-token logits of the last position (the model's dtype, then fp32 for the sampler's softmax), and under ZeRO-3
    the policy gathered whole for the round (`gathered_policy_bytes`). Held while generating, when no activation is:
    the peak counts the larger of the two."""
    if not setup.method.generates:
        return 0
    completions = generated_at_once(setup)
    cache = completions * setup.sequence_length * kv_cache_bytes_per_token(shape, setup)
    return (cache + completions * shape.vocab_size * (_half_or_fp32(setup) + 2 * 4)
            + gathered_policy_bytes(shape, setup))


def gathered_policy_bytes(shape: ModelShape, setup: Setup) -> int:
    """Under ZeRO-3 with TRL's `ds3_gather_for_generation` (its default), each generation round runs inside
    `unwrap_model_for_generation`, which gathers every parameter (`deepspeed.zero.GatheredParameters`,
    trl/models/utils.py): the whole policy in the dtype it is partitioned in, on every GPU beside its partition (a
    70B in bf16: 131 GiB). Without the gather each layer is gathered again for every generated token: no such peak,
    but slow."""
    if not (setup.method.generates and setup.method.gathers_for_generation and setup.strategy == "deepspeed"
            and setup.zero_stage == 3):
        return 0
    return shape.num_parameters * _half_or_fp32(setup)


def vision_frozen(shape: ModelShape, setup: Setup) -> int:
    """Parameters of a vision-language model's vision side that full fine-tuning leaves frozen: the tower
    (`freeze_vision_tower`, on by default) and the projector (`freeze_projector`)."""
    if shape.vision is None:
        return 0
    return shape.vision.tower_parameters * setup.vision_tower_frozen + \
        shape.vision.projector_parameters * setup.projector_frozen


def vision_trained(shape: ModelShape, setup: Setup) -> int:
    """What a LoRA run trains in full on a vision-language model's vision side beside the adapters on its language
    model (finetune.models.lora): a copy of each part not frozen (peft's `modules_to_save`)."""
    if shape.vision is None:
        return 0
    return shape.vision.tower_parameters * (not setup.vision_tower_frozen) + \
        shape.vision.projector_parameters * (not setup.projector_frozen)


def vision_activation_bytes(shape: ModelShape, setup: Setup) -> float:
    """A vision tower's activations in one micro-batch, P patches (`image_tokens` × `patches_per_token`) of width h,
    MLP width i, L blocks, c bytes of the compute dtype. A trained tower keeps per block, per patch, what a
    pre-norm ViT block saves under SDPA: the two norms' inputs and outputs, q, k, v, the attention output and the
    projection's input (≈ 8h), the MLP's input, pre- and post-activation (h + 2i): c·P·(9h + 2i) a block. A frozen
    one keeps nothing (no input of it needs a gradient): its peak is one block's working set, c·P·(4h + i). The
    patches themselves come in as fp32 pixels (`patch_elements` each: Qwen2-VL's 3 channels × 2 frames × 14²)."""
    vision = shape.vision
    if vision is None or not setup.image_tokens:
        return 0.0
    c = held_precisions(setup).compute
    patches = setup.image_tokens * vision.patches_per_token
    h, i = vision.hidden_size, vision.intermediate_size
    pixels = 4 * patches * vision.patch_elements
    if setup.vision_tower_frozen:
        return pixels + c * patches * (4 * h + i)
    return pixels + vision.num_layers * c * patches * (9 * h + 2 * i)


def lora_trainable_parameters(shape: ModelShape, setup: Setup) -> int:
    """What peft trains: r·(d_in + d_out) per adapted matrix, plus DoRA's magnitude vector (d_out each,
    `peft/tuners/lora/dora.py`) and a full trainable copy of each of `lora_modules_to_save` (peft's
    `ModulesToSaveWrapper`; the original stays frozen, so the base count is unchanged). A module to save is
    counted from the model's linear layers by name, else as an embedding (vocab × hidden); a head tied to the
    embedding is that one matrix (peft keeps the tie, `ensure_weight_tying`)."""
    targets = lora_target_names(shape, setup.lora_target_modules)
    trainable = shape.lora_parameters(setup.lora_rank, targets)
    if setup.dora:
        trainable += sum(linear.out_features for linear in shape.linears
                         if linear.in_layers and (targets is None or linear.name.rsplit(".", 1)[-1] in targets))
    copies: dict[str, int] = {}  # one trained copy per distinct matrix
    for name in setup.lora_modules_to_save or ():
        linears = [linear for linear in shape.linears if linear.name == name or linear.name.endswith(f".{name}")]
        for linear in linears:
            is_tied_head = shape.tied_embeddings and not linear.in_layers and linear.out_features == shape.vocab_size
            copies["embedding" if is_tied_head else linear.name] = linear.in_features * linear.out_features
        if not linears:
            copies["embedding"] = shape.vocab_size * shape.hidden_size
    return trainable + sum(copies.values())


def lora_target_names(shape: ModelShape, target_modules: tuple[str, ...] | None) -> tuple[str, ...] | None:
    """The recipe's `lora_target_modules` as layer names (None: every linear in the blocks; `attention`: the
    projections the shape found inside attention modules, `finetune.memory.shapes.attention_projections`)."""
    if not target_modules or tuple(target_modules) == ("all-linear",):
        return None
    if tuple(target_modules) == ("attention",):
        return shape.attention_projections
    return tuple(target_modules)


def _half_or_fp32(setup: Setup) -> int:
    return 4 if setup.precision == "fp32" else 2


def _deepspeed_states(trainable: int, frozen_bytes: float, setup: Setup, largest_tensor: int):
    """DeepSpeed casts the module to the half dtype (w bytes) and keeps an fp32 master copy (see module doc)."""
    w, n, k = _half_or_fp32(setup), setup.shard_degree, OPTIMIZER_STATE_BYTES[setup.optimizer]
    offloaded = {"params_bytes": 0, "grads_bytes": 0, "optimizer_bytes": 0}
    if setup.zero_stage == 0:
        # FP16/BF16 optimizer: half weights and gradients, fp32 master weights and fp32 gradients (none of
        # the extra copies in fp32, where the torch optimizer steps on the model's own tensors).
        fp32_copy = 0 if w == 4 else 4
        return w * trainable + frozen_bytes, (w + fp32_copy) * trainable, (k + fp32_copy) * trainable, offloaded
    params = w * trainable + frozen_bytes
    if setup.zero_stage == 3:
        # ZeRO++ hpZ (arXiv 2306.10209): beside its primary partition each rank holds a secondary one of the weights
        # in the model dtype over its hpZ group, which the backward all-gather reads inside the node.
        params = params / n + (params / setup.hpz_group if setup.hpz_group > 1 else 0)
    # The partition in the model dtype + its fp32 copy at the step. ZeRO-3 builds the fp32 copy one sub-group at a
    # time and frees it before the next (stage3.py::step: `_prepare_sub_group` → `_prepare_fp32_grad_for_sub_group`,
    # then `_release_sub_group` sets `.grad = None`); sub-groups close once they reach `sub_group_size` elements
    # (`_create_fp16_sub_groups`; default 1e9, deepspeed/runtime/zero/config.py).
    # A sub-group closes on the tensor that takes it to `sub_group_size` or past it, so it can hold up to one more
    # tensor's partition (measured on the tiny model: 50,000 asked, 65,856 held).
    fp32_copy = trainable / n
    if setup.zero_stage == 3:
        largest_tensor = min(largest_tensor, trainable) / n
        fp32_copy = min(fp32_copy, (setup.sub_group_size or DEEPSPEED_SUB_GROUP_SIZE) + largest_tensor)
    grads = w * trainable / n + 4 * fp32_copy
    optimizer = (4 + k) * trainable / n  # fp32 master partition + states
    if setup.offload_optimizer:
        # ZeRO-1/2 reduce straight into pinned fp32 host buffers; ZeRO-3 keeps its gradient partition
        # buffer on the optimizer's device (stage3.py: grad_partitions_flat_buffer, device=self.device).
        host_grads = (w + 4) * trainable / n if setup.zero_stage == 3 else 4 * trainable / n
        offloaded.update(grads_bytes=host_grads, optimizer_bytes=optimizer)
        grads, optimizer = 0, 0
    if setup.offload_param:
        offloaded["params_bytes"] = params
        params = 0
    return params, grads, optimizer, offloaded


def _trainable_bytes(setup: Setup) -> int:
    """Bytes of one trainable weight (and of its gradient) outside DeepSpeed: fp32 masters, or bf16 by name."""
    return 2 if setup.pure_bf16 else 4


def _torch_states(trainable: int, frozen_bytes: float, setup: Setup, shard_degree: int | None = None):
    """Single GPU, DDP, FSDP, tensor parallel: trainable weights fp32 whatever the checkpoint's dtype, adapters too;
    `pure_bf16` halves weights, gradients and fp32-sized optimizer moments (8-bit states are 8-bit either way).
    `shard_degree`: 1 where the counts are already this rank's share."""
    n = setup.shard_degree if shard_degree is None else shard_degree
    k, w = OPTIMIZER_STATE_BYTES[setup.optimizer], _trainable_bytes(setup)
    if setup.pure_bf16 and setup.optimizer == "adamw":
        k = 2 * w
    params = (w * trainable + frozen_bytes) / n
    return params, w * trainable / n, k * trainable / n, {}


def grads_between_micro_steps(trainable: int, grads_at_step: float, setup: Setup) -> float:
    """Gradient bytes on the GPU between two micro-steps of one accumulation window (none without accumulation).

    DeepSpeed ZeRO-1 reduces only at the accumulation boundary (engine.py::allreduce_gradients, "Communicate only at
    gradient accumulation boundaries"; stage_1_and_2.py::reduce_ready_partitions_and_remove_grads reduces when
    `partition_gradients or is_gradient_accumulation_boundary()`), so autograd accumulates every trainable gradient
    at full size in the model dtype: wΨ, offload or not. ZeRO-2 reduce-scatters each micro-step and keeps its
    partition (`copy_grads_in_partition` into `grads_in_partition`), ZeRO-3 its `grad_partitions_flat_buffer`: wΨ/N;
    under optimizer offload both land in host buffers instead. ZeRO-0, DDP and single GPU keep `p.grad` as at the
    step. FSDP is counted as at the step (its unsharded accumulation under `no_sync` is not modelled yet).
    """
    if setup.gradient_accumulation_steps == 1:
        return 0
    if setup.strategy != "deepspeed" or setup.zero_stage == 0:
        return grads_at_step
    w = _half_or_fp32(setup)
    if setup.zero_stage == 1:
        return w * trainable
    return 0 if setup.offload_optimizer else w * trainable / setup.shard_degree


def loads_sharded(setup: Setup) -> bool:
    """Only global rank 0 reads the checkpoint; every other rank builds the model's shapes and gets its weights from
    rank 0 (ZeRO-3, FSDP with `sharded_loading`)."""
    return setup.sharded_loading and ((setup.strategy == "deepspeed" and setup.zero_stage == 3)
                                      or setup.strategy == "fsdp")


def host_load_bytes_of_rank(model_bytes: float, setup: Setup, rank: int, device_is_host: bool = False) -> float:
    """Host RAM rank `rank` (global) takes while `finetune train` loads the model and prepares it for the method,
    before Trainer shards it (`finetune.memory.ledger.HostLoadProbe` measures the same span).

    Transformers 5 builds the model on the meta device and materialises each weight from the checkpoint on the CPU
    when no `device_map` is given (`low_cpu_mem_usage` is gone: modeling_utils.py::from_pretrained pops it unused),
    so a rank that loads holds the whole model in the load dtype, trainable weights cast as the strategy holds them
    (`finetune.models.loading.hold_trainable_parameters`). Sharded loading leaves that to global rank 0:
    - ZeRO-3: TrainingArguments registers the DeepSpeed config before the model loads (Accelerate's
      `set_deepspeed_weakref`, whatever `zero3_init_flag` says), so `from_pretrained` runs under `zero.Init`; rank 0
      reads the checkpoint (`map_location = "cpu" if rank == 0 else "meta"`) and each module is gathered to be
      filled and partitioned at once (integrations/deepspeed.py::_load_state_dict_into_zero3_model): every rank
      holds its partition, on its GPU, or on the host with parameter offload (or on a CPU-only run,
      `device_is_host`).
    - FSDP2 with `fsdp_cpu_ram_efficient_loading`: ranks ≠ 0 build the model on the meta device
      (`finetune.models.loading.sharded_from_rank_zero`); Accelerate fills their shards from rank 0 when Trainer
      prepares the model.
    """
    if not loads_sharded(setup):
        return model_bytes
    partition = model_bytes / setup.shard_degree if setup.strategy == "deepspeed" else 0
    on_host = partition if (setup.offload_param or device_is_host) else 0
    return (model_bytes if rank == 0 else 0) + on_host


def host_load_bytes_per_node(model_bytes: float, setup: Setup) -> float:
    """Host RAM the busiest node needs while the model loads: GPUs per node × the model, or with sharded loading
    the first node's, where global rank 0 reads the checkpoint (`host_load_bytes_of_rank`)."""
    ranks = setup.gpus_per_node or setup.num_gpus
    return sum(host_load_bytes_of_rank(model_bytes, setup, rank) for rank in range(ranks))


def loaded_model_bytes(trainable: int, frozen_bytes: float, setup: Setup) -> float:
    """The whole model on a rank that loads it, at its peak: the weights as loaded (the half dtype under mixed
    precision, as hub checkpoints are stored, else fp32) and, where the toolkit holds trainable weights wider (fp32
    masters outside DeepSpeed), their cast copy beside them (measured: a bf16 checkpoint cast to fp32 peaks at
    6 bytes per parameter, tests/memory/test_loading_memory.py)."""
    loaded = _half_or_fp32(setup)
    held = loaded if setup.strategy == "deepspeed" else _trainable_bytes(setup)
    return (held + (loaded if held > loaded else 0)) * trainable + frozen_bytes


@dataclass(frozen=True)
class HeldPrecisions:
    """Bytes per element of what a forward computes with, as `finetune train` holds the model under a strategy."""

    compute: int     # the mixed-precision (autocast) dtype, or fp32
    residual: int    # the hidden states between layers: the embedding's dtype
    weights: int     # trainable base weights during the forward (full fine-tuning)
    adapters: int    # LoRA adapters during the forward

    @property
    def autocast(self) -> bool:
        """Some tensor is held wider than the compute dtype, so autocast casts it (a copy) for each matmul."""
        return self.compute == 2 and 4 in (self.residual, self.weights, self.adapters)


def held_precisions(setup: Setup) -> HeldPrecisions:
    """DeepSpeed casts the whole module (adapters too) to the half dtype; FSDP2 computes on parameters gathered in it
    (Accelerate's `MixedPrecisionPolicy(param_dtype=...)`); `pure_bf16` holds them so. On one GPU and under DDP
    trainable weights are fp32 masters (finetune.models.loading.hold_trainable_parameters) and Trainer's autocast
    casts them per matmul. A LoRA base is frozen in the half dtype; QLoRA's unquantized weights (embeddings, norms,
    head) are upcast to fp32 where peft's k-bit preparation runs (`finetune.models.lora.qlora_load`: not where
    parameters are sharded)."""
    if _half_or_fp32(setup) == 4:
        return HeldPrecisions(4, 4, 4, 4)
    half_module = setup.strategy in ("deepspeed", "fsdp") or setup.pure_bf16
    if setup.lora_rank or setup.peft:
        kbit_upcast = setup.qlora and not half_module
        return HeldPrecisions(2, 4 if kbit_upcast else 2, 2, 2 if half_module else 4)
    weights = 2 if half_module else 4
    return HeldPrecisions(2, weights, weights, weights)


# Linear layers reading the attention's output (already kept by the attention kernel for its backward).
ATTENTION_OUTPUT_PROJECTIONS = ("o_proj", "out_proj", "dense", "c_proj", "wo")


def _block_linears(shape: ModelShape) -> list:
    """One decoder block's linear layers (by their last name), in order."""
    block: dict[str, object] = {}
    for linear in shape.linears:
        if linear.in_layers:
            block.setdefault(linear.name.rsplit(".", 1)[-1], linear)
    return list(block.items())


def saved_per_layer_bytes(shape: ModelShape, setup: Setup) -> float:
    """Bytes one decoder block saves for backward in one micro-batch, counted per tensor as autograd keeps them (and
    measured so at real widths by `finetune.memory.saved`; docs/memory.md has the table). T tokens, width h, MLP
    width i, key/value width h_kv, a heads, c bytes of the compute dtype, r of the hidden states:

    - each RMSNorm keeps its input upcast to fp32 (4Th), its fp32 1/rms per token (4T) and, when its weight trains,
      the normalised input (rTh); Liger's RMSNorm keeps its input as it comes (rTh) and the same 1/rms (4T);
    - attention keeps q, k, v, the output (c·T·(2h + 2h_kv)) and the fp32 log-sum-exp (4aT) under SDPA or flash;
      eager attention keeps k and v repeated to every head, the fp32 softmax and its cast (a·s²·b·(4 + c)) instead of
      the log-sum-exp, and a contiguous copy of the output; SDPA on packed rows gets a block-diagonal mask, which
      it converts to the compute dtype and keeps (c·b·s²), and repeats k and v to every head (Transformers' GQA
      path needs no mask: integrations/sdpa_attention.py `use_gqa_in_sdpa`); flash attention's varlen kernel needs
      neither;
    - the gated MLP keeps gate, activation and up outputs (3cTi); Liger's SwiGLU keeps gate and up (2cTi) and
      recomputes the activation in its backward;
    - the rotary embedding keeps nothing of its own in a block: the cos and sin it multiplies by are one pair for all
      blocks (`saved_outside_layers_bytes`); Liger's rotates q and k in place and keeps that same pair;
    - each linear layer whose weight trains keeps its input: one tensor for the layers reading the same input (q, k,
      v) when it is already in the compute dtype, else a cast copy each (fp32 hidden states under autocast); none for
      the projection reading the attention's output, which the attention kept; a frozen base keeps none;
    - each LoRA adapter keeps its own copy of the input (c) where peft casts it to the adapters' dtype or dropout
      draws on it, plus dropout's bool mask (1 byte) and the rank-r product (c·T·r);
    - fp32 weights under autocast keep their half-precision cast for the backward: c bytes per weight.
    """
    precision = held_precisions(setup)
    c, r = precision.compute, precision.residual
    b = setup.micro_batch_size * setup.method.sequences_per_example  # a pair: chosen and rejected (TRL concatenates)
    s = setup.sequence_length
    tokens = b * s
    h, i, heads = shape.hidden_size, shape.intermediate_size, shape.num_attention_heads
    kv = h * shape.num_key_value_heads // heads
    lora = bool(setup.lora_rank or setup.peft)
    if setup.gradient_checkpointing:
        return r * tokens * h  # each block keeps only its input; one block is recomputed at a time (a transient)

    norms = 2 * norm_saved_bytes(setup, tokens, h, trains_weight=not lora)
    if setup.attention == "eager":
        attention = c * tokens * (4 * h) + heads * s * s * b * (4 + c)
    elif setup.packed and setup.attention == "sdpa":  # a block-diagonal mask: no GQA kernel, k and v repeated
        attention = c * tokens * (4 * h) + 4 * heads * tokens + c * b * s * s
    else:
        attention = c * tokens * (2 * h + 2 * kv) + 4 * heads * tokens
    mlp = (2 if setup.applied_kernels.swiglu else 3) * c * tokens * i

    targets = lora_target_names(shape, setup.lora_target_modules) if lora else ()
    inputs, shared_read = 0.0, set()
    split = 0.0  # what a tensor-parallel rank holds 1/t of: the casts of its weight slices, the sharded MLP input
    for name, linear in _block_linears(shape):
        reads_attention = name in ATTENTION_OUTPUT_PROJECTIONS
        reads_norm = not reads_attention and linear.in_features == h
        source = r if reads_norm else c  # a norm's output is in the residual dtype
        # linears reading one tensor: the attention's (q, k, v) or the MLP's (gate, up) norm output
        read = ("attention" if name in shape.attention_projections else "mlp", linear.in_features)
        width = linear.in_features
        if not lora:
            if source != c:
                inputs += c * tokens * width  # autocast's copy for this matmul
            elif not reads_attention and read not in shared_read:
                shared_read.add(read)
                if reads_norm:
                    inputs += c * tokens * width
                else:  # the down projection's input: the MLP's activation, split with the MLP's width
                    split += c * tokens * width
            if precision.weights != c:
                split += c * width * linear.out_features
        elif targets is None or name in targets:
            copies = precision.adapters != c or source != c or setup.lora_dropout > 0
            if copies:
                inputs += c * tokens * width
            elif not reads_attention and read not in shared_read:
                shared_read.add(read)
                inputs += c * tokens * width
            if setup.lora_dropout > 0:
                inputs += tokens * width  # the bool mask
            inputs += c * tokens * setup.lora_rank
            if precision.adapters != c:  # autocast's casts of the fp32 adapters
                inputs += c * setup.lora_rank * (width + linear.out_features)
    t = stage_tensor_parallel(shape, setup)
    if t > 1:  # each rank computes its share of the heads and of the MLP's width (TP alone or inside a stage)
        attention, mlp, split = attention / t, mlp / t, split / t
    return norms + attention + mlp + inputs + split


def norm_saved_bytes(setup: Setup, tokens: int, width: int, trains_weight: bool) -> float:
    """What one RMSNorm over `tokens` × `width` saves for backward. Transformers' (LlamaRMSNorm and its copies): the
    input upcast to fp32 (the upcast itself where the hidden states are fp32), kept by its square and its product with
    1/rms, that fp32 1/rms per token, and, when its weight trains, the normalised input cast back to the hidden states'
    dtype r, kept by the product with the weight (measured so by `finetune.memory.saved`). Liger's
    (`LigerRMSNormFunction`, casting mode "llama", ops/rms_norm.py): `save_for_backward(X, W, RSTD)`, the input as it
    comes (r bytes) and its fp32 1/rms per row, whether the weight trains or not."""
    r = held_precisions(setup).residual
    if setup.applied_kernels.rms_norm:
        return (r * width + 4) * tokens
    return (4 * width + 4 + (r * width if trains_weight else 0)) * tokens


def saved_outside_layers_bytes(shape: ModelShape, setup: Setup) -> float:
    """What the forward saves outside the blocks: the final norm (as a block's), the head's input and, where the
    full fine-tuning holds fp32 weights under autocast, the head's cast; the rotary cos/sin; the loss's fp32
    log-probabilities (4·T·vocab; none for a method whose log-probabilities come from TRL's fused head, which
    projects the answer positions in tiles: trl/trainer/utils.py add_fused_lm_head). Under Liger's fused linear
    cross-entropy, the gradients it computes in the forward instead (`liger_fused_loss_saved_bytes`)."""
    precision = held_precisions(setup)
    c, r = precision.compute, precision.residual
    tokens = setup.micro_batch_size * setup.method.sequences_per_example * setup.sequence_length
    h, vocab = shape.hidden_size, shape.vocab_size
    lora = bool(setup.lora_rank or setup.peft)
    norm = norm_saved_bytes(setup, tokens, h, trains_weight=not lora)
    fused_loss = setup.liger_loss == "fused_linear_cross_entropy"
    if fused_loss:
        head = liger_fused_loss_saved_bytes(shape, setup)
    elif setup.method.fused_head:  # its autograd function keeps the hidden states as they come, and two fp32 vectors
        head = r * tokens * h + 2 * 4 * tokens  # (trl/kernels/chunked_logprob.py: log_z, entropy); tiles are cast
    elif lora:  # a frozen head keeps no input, but a frozen fp32 head (QLoRA's upcast) keeps autocast's cast of it
        head = c * vocab * h if r == 4 and c == 2 else 0
    else:
        head = c * tokens * h + (c * vocab * h if precision.weights != c else 0)
    rotary = 2 * r * tokens * h // shape.num_attention_heads
    # Liger's cross-entropy keeps as many bytes: the fp32 logits, into which it wrote their gradient
    loss = 4 * tokens * vocab if setup.method.logits_held and not fused_loss else 0
    return norm + head + rotary + loss - _first_layer_shortfall(shape, setup)


def liger_fused_loss_saved_bytes(shape: ModelShape, setup: Setup) -> float:
    """What Liger's fused linear cross-entropy keeps from its forward to its backward
    (`LigerFusedLinearCrossEntropyFunction`, ops/fused_linear_cross_entropy.py, mean or sum reduction): it computes
    the loss's gradients chunk by chunk in the forward and `save_for_backward`s them, `grad_input`
    (`zeros_like(_input)`: tokens × hidden in the final norm's output dtype, the hidden states' r) and, where the head
    trains, `grad_weight` (`zeros_like(weight)`: vocab × hidden in the dtype the head is held in, fp32 masters under
    autocast; it becomes the head's gradient in the backward). It keeps neither the head's input nor its output."""
    precision = held_precisions(setup)
    tokens = setup.micro_batch_size * setup.method.sequences_per_example * setup.sequence_length
    h = shape.hidden_size
    head_trains = not (setup.lora_rank or setup.peft)  # adapters: the head stays frozen (no `grad_weight`)
    return precision.residual * tokens * h + (precision.weights * shape.vocab_size * h if head_trains else 0)


def liger_chunk_tokens(tokens: int, shape: ModelShape) -> int:
    """Rows of one chunk of Liger's fused linear cross-entropy: the tokens cut so that a chunk's logits are no larger
    than the hidden states, rounded up to a power of two (`chunk_size = next_power_of_2(cdiv(BT, cdiv(V, H)))`, at
    most BT, with its default `chunk_mem_const` of 1)."""
    increase = -(-shape.vocab_size // shape.hidden_size)
    return min(1 << max(0, math.ceil(math.log2(-(-tokens // increase)))), tokens)


def loss_transient_bytes(shape: ModelShape, setup: Setup) -> float:
    """The loss's largest transient beside what is saved:
    - the model's loss over the full logits: its backward holds two more fp32 (tokens × vocab) gradients beside the
      saved log-probabilities;
    - TRL's fused head: one tile of logits at a time, in the compute dtype (4,096 tokens × 32,768 ids);
    - Liger's cross-entropy writes the gradient into the fp32 logits it keeps (its backward scales it in place): only
      the logits in the compute dtype beside them, in the forward (the head's output) and the backward (the gradient
      cast back), none when that dtype is fp32 (the logits are upcast to themselves, and overwritten);
    - Liger's fused linear cross-entropy, in its forward: one chunk of logits in the compute dtype
      (`liger_chunk_tokens` × vocab) and, where the head is held in fp32 under autocast, its half-precision cast (kept
      in autocast's cache for a trained head, made for each chunk for a frozen one); its backward only scales what it
      saved, in place."""
    precision = held_precisions(setup)
    c, r = precision.compute, precision.residual
    tokens = setup.micro_batch_size * setup.method.sequences_per_example * setup.sequence_length
    vocab = shape.vocab_size
    if setup.liger_loss == "fused_linear_cross_entropy":
        lora = bool(setup.lora_rank or setup.peft)
        head_in_fp32 = c == 2 and (r == 4 if lora else precision.weights == 4)
        return c * liger_chunk_tokens(tokens, shape) * vocab + (c * vocab * shape.hidden_size if head_in_fp32 else 0)
    if setup.liger_loss == "cross_entropy":
        return c * tokens * vocab if c != 4 else 0
    if setup.method.fused_head:
        return c * min(tokens, 4096) * min(vocab, 32768)
    return 8 * tokens * vocab if setup.method.logits_held else 0


def _first_layer_shortfall(shape: ModelShape, setup: Setup) -> float:
    """Under LoRA nothing before the first block's adapters needs a gradient (without gradient checkpointing, which
    makes the embeddings' output need one), so the first block's first norm keeps nothing (Liger's neither: its
    autograd function records no graph) and the dropout on the adapters reading it keeps no mask."""
    if not (setup.lora_rank or setup.peft) or setup.gradient_checkpointing:
        return 0
    tokens = setup.micro_batch_size * setup.method.sequences_per_example * setup.sequence_length
    h = shape.hidden_size
    targets = lora_target_names(shape, setup.lora_target_modules)
    masks = sum(1 for name, linear in _block_linears(shape)
                if setup.lora_dropout > 0 and name in shape.attention_projections
                and name not in ATTENTION_OUTPUT_PROJECTIONS and (targets is None or name in targets))
    return norm_saved_bytes(setup, tokens, h, trains_weight=False) + masks * tokens * h


def activation_bytes(shape: ModelShape, setup: Setup) -> float:
    """Activations at their peak in one micro-batch: everything saved for backward (`saved_per_layer_bytes` per
    block, `saved_outside_layers_bytes`) plus the largest transient on top of it: the loss's (`loss_transient_bytes`),
    or, under gradient checkpointing, one block recomputed with everything it saves."""
    saved = shape.num_layers * saved_per_layer_bytes(shape, setup) + saved_outside_layers_bytes(shape, setup)
    recompute = saved_per_layer_bytes(shape, replace(setup, gradient_checkpointing=False)) \
        if setup.gradient_checkpointing else 0
    return saved + max(loss_transient_bytes(shape, setup), recompute)


def temporary_bytes(shape: ModelShape, setup: Setup, trainable: int) -> float:
    """Communication buffers and gathered weights that come and go around each step."""
    w = _half_or_fp32(setup)
    if setup.axis is not None:
        return setup.axis.temporary_bytes(shape, setup, trainable)
    if setup.strategy == "ddp" and setup.num_gpus > 1:
        return _trainable_bytes(setup) * trainable  # DDP's reducer buckets: a flat copy of the gradients
    if setup.strategy == "fsdp":
        return fsdp_gathered_weights_bytes(shape, setup) + fsdp_gradient_buffer_bytes(shape, setup, trainable) \
            if setup.shard_degree > 1 else 0
    if setup.strategy != "deepspeed":
        return 0
    if setup.zero_stage == 0:
        return 0
    # DeepSpeed allocates its reduce buckets at full size whatever the model (stage_1_and_2.py::setup_buckets,
    # stage3.py: ipg bucket buffers). Trainer fills ZeRO-3's "auto" with hidden².
    bucket = setup.reduce_bucket_size or (shape.hidden_size**2 if setup.zero_stage == 3 else BUCKET_SIZE)
    if setup.zero_stage in (1, 2):
        return bucket * w * (2 if setup.overlap_comm else 1)  # doubled to overlap communication
    # ZeRO-3: one reduce bucket, plus the largest module gathered with its gradient (DeepSpeed's
    # `4 * largest_layer_params` in bf16) and the next block prefetched.
    return bucket * w + 2 * shape.largest_layer_parameters * w + shape.layer_parameters * w


def _fsdp_groups(shape: ModelShape, setup: Setup) -> tuple[int, int, int]:
    """The parameters of FSDP2's groups on one rank before sharding: a decoder block, the input embedding, and the
    output head with the final norm (with the embedding too when tied). Under tensor parallelism each is the rank's
    TP slice (the vocabulary matrices cut by rows, the block's linear layers t ways)."""
    t = stage_tensor_parallel(shape, setup)
    norms = shape.layer_parameters - shape.block_linear_parameters // shape.num_layers
    block = shape.block_linear_parameters // (shape.num_layers * t) + norms
    vocabulary = math.ceil(shape.vocab_size / t) * shape.hidden_size
    return block, vocabulary, vocabulary + shape.hidden_size


def fsdp_gathered_weights_bytes(shape: ModelShape, setup: Setup) -> int:
    """The weights FSDP2 holds gathered at once, in the dtype it gathers in (the compute dtype under bf16, the fp32
    masters otherwise). Accelerate's FSDP2 and Transformers' `_fsdp_plan` (tensor parallelism) group the model alike:
    each decoder block, the input embedding, and a tail of the final norm and the head that stays gathered from its
    forward to its backward (the tail takes the embedding when tied, so it stays gathered the whole step). A group is
    all-gathered into one buffer and copied out of it into its parameters; the buffer lives until that copy-out (in
    the forward, until the next group's), so a group briefly holds twice its weights, and the next block is gathered
    while one runs:
    - untied: twice the largest group (the head's and a block's, or two blocks', are no more);
    - tied: the tail twice at its gather, or the tail and two blocks;
    - SHARD_GRAD_OP (every group kept from its forward to its backward): the whole model, and the last group of the
      forward (the head, or a block when tied) in its buffer.
    FSDP2 pads each tensor's rows to a multiple of the shards (a row a tensor at most). Measured exactly on CPU
    processes (finetune.testing.fsdp_gathers; tests/launch/test_fsdp.py and test_tensor_parallel.py)."""
    w = _half_or_fp32(setup)
    block, embedding, head = _fsdp_groups(shape, setup)
    if setup.fsdp_sharding == "shard_grad_op" and setup.strategy == "fsdp":
        return w * (shape.num_parameters + (block if shape.tied_embeddings else head))
    if shape.tied_embeddings:
        return w * (head + max(head, 2 * block))
    return 2 * w * max(block, embedding, head)


def fsdp_gradient_buffer_bytes(shape: ModelShape, setup: Setup, trainable: int) -> int:
    """A group's gradients as autograd leaves them on the gathered weights (in the dtype gathered) and the fp32 copy
    FSDP2 reduce-scatters them from, for the largest group with gradients; a tied tail's gradients are held from the
    first block's backward to the last, where it is reduced. With adapters, no more than the adapters' own. Counted
    from FSDP2's code (`foreach_reduce`), not measured."""
    w = _half_or_fp32(setup)
    block, embedding, head = _fsdp_groups(shape, setup)
    if shape.tied_embeddings:
        whole = max(w * head + (w + 4) * block, (w + 4) * head)
    else:
        whole = (w + 4) * max(block, embedding, head)
    return min(whole, (w + 4) * trainable)


def largest_partition(shape: ModelShape, world_size: int) -> int:
    """Elements of the largest parameter partition ZeRO-3 gives a rank: ceil(numel / world size) of the biggest
    module's weights (what an NVMe parameter buffer must hold, finetune.configs.deepspeed)."""
    return partition_elements(shape.largest_layer_parameters, world_size)
