"""`finetune plan`: which strategy fits a model on N GPUs, with what batch plan, launched how.

Every shipped strategy is estimated; the recommendation is the first that fits in the classic decision
tree (fits on one GPU → DDP, then ZeRO-1; a little short → ZeRO-2; far short → ZeRO-3 / FSDP; still short →
CPU offload, then NVMe), each step trading speed for memory. The micro-batch is the largest that still fits
the recommended strategy; accumulation makes up the target global batch and the learning rate is scaled
by `finetune.scaling`. The precision is the GPU's (`finetune.devices`): bf16 where it has it, else fp16 (a T4).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from finetune.devices import Gpu, default_precision
from finetune.errors import RecipeError
from finetune.memory.estimate import GiB, MemoryEstimate, Setup, estimate, parallel_3d
from finetune.memory.shapes import ALIASES, model_shape
from finetune.scaling import plan_batch, scale_learning_rate
from finetune.strategies import SHIPPED, SHIPPED_BY_NAME, ShippedStrategy

HEADROOM = 0.9  # of GPU memory the estimate may fill; the rest: CUDA context, allocator fragmentation


@dataclass(frozen=True)
class Candidate:
    name: str
    config: str  # the shipped Accelerate config that launches it
    options: dict  # the estimator's strategy fields, read from the shipped config


def _candidate(row: ShippedStrategy) -> Candidate:
    return Candidate(row.label, row.accelerate_file, row.strategy.estimator_options())


# In decision-tree order (the shipped table's): the first that fits is recommended.
CANDIDATES = tuple(_candidate(row) for row in SHIPPED if row.decision_tree)
SINGLE_GPU = _candidate(SHIPPED_BY_NAME["single"])


@dataclass(frozen=True)
class PlanRequest:
    model: str
    gpus: int
    gpu_memory_gib: float
    host_memory_gib: float | None = None
    precision: str = "auto"  # fp32, bf16, fp16, or auto: the GPU's (`plan_precision`)
    gpu: Gpu | None = None  # the GPU planned for; None: unknown, taken to do bf16
    optimizer: str = "adamw"
    lora_rank: int = 0
    qlora: bool = False
    sequence_length: int = 2048
    gradient_checkpointing: bool = False
    global_batch_size: int = 32
    max_micro_batch_size: int = 64
    learning_rate: float | None = None  # at base_batch_size; default 2e-5 full, 2e-4 LoRA
    base_batch_size: int | None = None
    lr_scaling: str = "sqrt"
    recipe: str = "RECIPE.yaml"
    nodes: int = 1
    inter_node_gbps: float = 100.0  # network bandwidth of one node, Gb/s per direction
    tflops_per_gpu: float = 400.0  # achieved, not peak: about 40% MFU on an H100


def candidates_for(gpus: int) -> tuple[Candidate, ...]:
    if gpus == 1:  # sharding over one rank saves nothing; offload still helps
        return (SINGLE_GPU, *(c for c in CANDIDATES if "offload" in c.name))
    return CANDIDATES


def _setup(request: PlanRequest, candidate: Candidate, micro_batch_size: int) -> Setup:
    return Setup(
        **candidate.options, num_gpus=request.gpus, precision=request.precision, optimizer=request.optimizer,
        lora_rank=request.lora_rank, qlora=request.qlora, micro_batch_size=micro_batch_size,
        sequence_length=request.sequence_length, gradient_checkpointing=request.gradient_checkpointing,
        gpus_per_node=request.gpus // request.nodes if request.nodes > 1 else None,
    )


def fits(request: PlanRequest, result: MemoryEstimate) -> bool:
    if not result.fits(request.gpu_memory_gib * GiB, HEADROOM):
        return False
    host_limited = request.host_memory_gib is not None and result.setup.offload_optimizer == "cpu"
    return not host_limited or result.host_bytes_per_node <= HEADROOM * request.host_memory_gib * GiB


def make_plan(request: PlanRequest) -> dict:
    if request.gpus < 1 or request.gpu_memory_gib <= 0:
        raise RecipeError("`--gpus` must be at least 1 and `--gpu-memory` positive (GiB per GPU).")
    if request.nodes < 1 or request.gpus % request.nodes:
        raise RecipeError(f"`--gpus {request.gpus}` counts the GPUs of all nodes: it must be a multiple of "
                          f"`--nodes {request.nodes}`.")
    request = replace(request, precision=plan_precision(request))
    shape = model_shape(request.model)
    rows = []
    for candidate in candidates_for(request.gpus):
        result = estimate(shape, _setup(request, candidate, 1))
        rows.append({"name": candidate.name, "config": candidate.config, "fits": fits(request, result),
                     "estimate": result})
    recommended = next((row for row in rows if row["fits"]), None)
    plan = {
        "model": request.model,
        "num_parameters": shape.num_parameters,
        "trainable_parameters": rows[0]["estimate"].trainable_parameters,
        "gpus": request.gpus,
        "gpu_memory_gib": request.gpu_memory_gib,
        "gpu": request.gpu and request.gpu.describe(),
        "precision": request.precision,
        "strategies": rows,
        "recommended": recommended and recommended["name"],
        "batch_plan": None,
        "launch_command": None,
        "parallel_3d": None,
        "inter_node": None,
    }
    if request.nodes > 1:
        plan["inter_node"] = inter_node_traffic(request, shape, plan["trainable_parameters"])
    if recommended is None:
        plan["parallel_3d"] = smallest_3d_fit(request, shape)
        return plan
    candidate = next(c for c in candidates_for(request.gpus) if c.name == recommended["name"])
    micro = largest_micro_batch(request, shape, candidate)
    plan["batch_plan"] = batch_plan(request, micro)
    plan["launch_command"] = launch_command(request, candidate, plan["batch_plan"])
    if not any(row["fits"] and "offload" not in row["name"] for row in rows):
        plan["parallel_3d"] = smallest_3d_fit(request, shape)
    return plan


def plan_precision(request: PlanRequest) -> str:
    """The mixed precision planned: `auto` is bf16 on a GPU that has it and fp16 on one that does not (a T4, compute
    capability 7.5); asking bf16 by name for such a GPU is refused, since `finetune train` would refuse it there
    (`finetune.preflight.check_precision_on_gpu`)."""
    if request.precision == "auto":
        return default_precision(request.gpu)
    if request.precision == "bf16" and request.gpu is not None and not request.gpu.supports_bf16:
        raise RecipeError(f"`--precision bf16` for {request.gpu.describe()}: it has no bf16 (compute capability 8.0, "
                          "Ampere, or newer); use `--precision fp16` or `auto`.")
    return request.precision


def inter_node_traffic(request: PlanRequest, shape, trainable: int) -> dict:
    """Seconds per step each strategy spends moving data between nodes, next to the step's compute (6 FLOPs per
    parameter and token at `tflops_per_gpu`): where the network takes longer than the compute it cannot be hidden
    behind it, and ZeRO++ or FSDP hybrid sharding pay off."""
    fraction = (request.nodes - 1) / request.nodes
    link_bytes_per_second = request.inter_node_gbps * 1e9 / 8
    tokens = request.global_batch_size * request.sequence_length
    compute = 6 * shape.num_parameters * tokens / (request.gpus * request.tflops_per_gpu * 1e12)
    rows = []
    for row in (row for row in SHIPPED if row.cross_node is not None):
        (per_parameter, per_trained), name, config = row.cross_node, row.label, row.multinode_file
        values = per_parameter * shape.num_parameters + per_trained * trainable
        moved = values * 2 * fraction  # bf16 bytes through one node's link
        rows.append({"name": name, "config": config, "bytes_per_node": moved,
                     "seconds": moved / link_bytes_per_second, "hidden": moved / link_bytes_per_second <= compute})
    return {"nodes": request.nodes, "gpus_per_node": request.gpus // request.nodes,
            "inter_node_gbps": request.inter_node_gbps, "compute_seconds": compute, "strategies": rows}


def decision_path(plan: dict) -> list[str]:
    """The decision tree as walked for this plan: each strategy tried in order, with its predicted GiB per GPU
    against the usable memory, up to the first that fits."""
    usable = HEADROOM * plan["gpu_memory_gib"] * GiB
    lines = []
    for row in plan["strategies"]:
        total = row["estimate"].total_bytes
        if row["fits"]:
            lines.append(f"{row['name']}: {_size(total)} ≤ {_size(usable)} usable → recommended")
            return lines
        reason = f"{_size(total)} > {_size(usable)} usable" if total > usable else "host RAM short for offload"
        lines.append(f"{row['name']}: {reason} → next")
    lines.append("nothing fits: more or larger GPUs, LoRA/QLoRA, gradient checkpointing or shorter sequences")
    return lines


def _size(num_bytes: float) -> str:
    return f"{num_bytes / GiB:,.1f} GiB" if num_bytes >= GiB else f"{num_bytes / 1024**2:,.1f} MiB"


def largest_micro_batch(request: PlanRequest, shape, candidate: Candidate) -> int:
    """The largest power-of-two micro-batch (up to the per-GPU share of the global batch) that still fits."""
    limit = min(request.max_micro_batch_size, max(1, request.global_batch_size // request.gpus))
    micro = 1
    while micro * 2 <= limit and fits(request, estimate(shape, _setup(request, candidate, micro * 2))):
        micro *= 2
    return micro


def batch_plan(request: PlanRequest, max_micro_batch_size: int) -> dict:
    micro, accumulation = plan_batch(request.global_batch_size, request.gpus, max_micro_batch_size)
    base_lr = request.learning_rate or (2e-4 if request.lora_rank else 2e-5)
    base_batch = request.base_batch_size or request.global_batch_size
    return {
        "micro_batch_size": micro,
        "gradient_accumulation_steps": accumulation,
        "global_batch_size": micro * request.gpus * accumulation,
        "learning_rate": scale_learning_rate(base_lr, base_batch, request.global_batch_size, request.lr_scaling),
        "lr_scaling": request.lr_scaling,
        "base_learning_rate": base_lr,
        "base_batch_size": base_batch,
    }


def launch_command(request: PlanRequest, candidate: Candidate, batch: dict) -> str:
    model = ALIASES.get(request.model.lower(), request.model)
    parts = ["accelerate launch", f"--config_file {candidate.config}"]
    default_processes = 1 if candidate is SINGLE_GPU else 2
    if request.gpus != default_processes:
        parts.append(f"--num_processes {request.gpus}")
    parts += [
        "-m finetune train", request.recipe, f"--model_name_or_path {model}",
        f"--per_device_train_batch_size {batch['micro_batch_size']}",
        f"--gradient_accumulation_steps {batch['gradient_accumulation_steps']}",
        f"--learning_rate {batch['learning_rate']:.3g}",
        f"--max_seq_length {request.sequence_length}",
    ]
    if request.precision != "fp32":  # the recipe key wins over the Accelerate config's mixed_precision
        parts.append(f"--{request.precision} true")
    if request.qlora:  # the 4-bit base the memory was estimated for; `use_qlora` implies LoRA
        parts.append(f"--use_qlora true --lora_r {request.lora_rank}")
    elif request.lora_rank:
        parts.append(f"--use_lora true --lora_r {request.lora_rank}")
    if request.gradient_checkpointing:
        parts.append("--gradient_checkpointing true")
    return " ".join(parts)


def smallest_3d_fit(request: PlanRequest, shape) -> dict | None:
    """The smallest tensor × pipeline split (ZeRO-1 over the rest) that fits, on paper: when data parallelism
    alone does not fit without offload, this says how far 3D parallelism (Megatron-style) would go."""
    setup = replace(_setup(request, CANDIDATES[0], 1), strategy="deepspeed", zero_stage=1)
    micro_batches = max(1, request.global_batch_size // request.gpus)
    options = []
    for tensor in (1, 2, 4, 8):
        for pipeline in (1, 2, 4, 8, 16, 32):
            if tensor * pipeline <= request.gpus and request.gpus % (tensor * pipeline) == 0 and tensor * pipeline > 1:
                result = parallel_3d(shape, setup, tensor, pipeline, micro_batches)
                if result["total_bytes"] <= HEADROOM * request.gpu_memory_gib * GiB:
                    options.append(result)
    return min(options, key=lambda r: (r["tensor_parallel"] * r["pipeline_parallel"], r["pipeline_bubble_fraction"]),
               default=None)
