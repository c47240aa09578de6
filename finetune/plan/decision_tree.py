"""`finetune plan`: which strategy fits a model on N GPUs, with what batch plan, launched how.

Every shipped strategy is estimated; the recommendation is the first that fits in the classic decision
tree (fits on one GPU → DDP, then ZeRO-1; a little short → ZeRO-2; far short → ZeRO-3 / FSDP; still short →
CPU offload, then NVMe), each step trading speed for memory. The micro-batch is the largest that still fits
the recommended strategy; the batch plan is `finetune.recipe.batch_plan.plan_from_recipe`, the one `finetune train`
runs, with
its defaults, and the launch command passes the global batch (not micro-batch × accumulation) so `finetune train`
re-plans for whatever world size it is launched with. A default global batch is adapted to the GPU count; one the
user gave is split exactly or refused. The precision is the GPU's (`finetune.launch.devices`): bf16 where it has it,
else
fp16 (a T4). Each strategy is estimated with the accumulation it would run (ZeRO-1 holds full-size gradients between
micro-steps) and checked against host RAM at load as well as under offload. `finetune.plan.from_recipe` fills a request
from a recipe and its data's token lengths.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from finetune.axes import all_axes
from finetune.errors import RecipeError
from finetune.launch.devices import Gpu, default_precision
from finetune.launch.strategies import SHIPPED, SHIPPED_BY_NAME, ShippedStrategy, Strategy
from finetune.memory.estimate import (
    FusedKernels,
    GiB,
    MemoryEstimate,
    MethodTerms,
    Setup,
    estimate,
    largest_partition,
)
from finetune.memory.shapes import ALIASES, model_shape
from finetune.plan.calibration import overhead_of
from finetune.recipe.batch_plan import plan_batch, plan_from_recipe, reachable_global_batch
from finetune.recipe.methods import DEFAULT_METHOD, method_class

HEADROOM = 0.9  # of GPU memory the prediction may fill: the rest is for allocator fragmentation and what it leaves out
# What a GPU run holds outside PyTorch's allocator and no term predicts: the CUDA context with its kernels, cuBLAS
# and NCCL workspaces (0.5-1 GiB). With it and the 10% headroom the plan covers the published end-to-end peaks it
# was held against (docs/memory.md: up to 11% above the prediction).
CUDA_CONTEXT_BYTES = GiB


def usable_bytes(gpu_memory_gib: float, context_bytes: int = CUDA_CONTEXT_BYTES) -> float:
    """GPU memory a predicted peak may fill: `HEADROOM` of it, less the CUDA context allowance (none for the CPU
    processes that stand in for GPUs on a machine without them)."""
    return HEADROOM * gpu_memory_gib * GiB - context_bytes
DEFAULT_GLOBAL_BATCH_SIZE = 32  # sequences per step when neither the user nor a recipe gives one
# A micro-batch is padded to its longest row: the planned length is the one a micro-batch reaches at this quantile.
LENGTH_QUANTILE = 0.99


@dataclass(frozen=True)
class Candidate:
    name: str
    config: str  # the shipped Accelerate config that launches it
    options: dict  # the estimator's strategy fields, read from the shipped config
    deepspeed: str | None = None  # its DeepSpeed JSON
    key: str = ""  # its name in the shipped table (`finetune train --strategy KEY`)
    strategy_label: str = ""  # how a memory report and the calibration store name it
    cpu: bool = False  # runs on CPU processes standing in for GPUs


def _candidate(row: ShippedStrategy) -> Candidate:
    return Candidate(row.label, row.accelerate_file, row.strategy.estimator_options(), row.deepspeed_file, row.name,
                     row.strategy.label, row.cpu)


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
    lora_dropout: float = 0.05  # the recipe's default: each adapter keeps a dropped copy of its input and a mask
    qlora: bool = False
    sequence_length: int = 2048
    gradient_checkpointing: bool = False
    global_batch_size: int | None = None  # None: DEFAULT_GLOBAL_BATCH_SIZE, adapted to the GPU count
    max_micro_batch_size: int = 64
    learning_rate: float | None = None  # at base_batch_size; default 2e-5 full, 2e-4 LoRA
    base_batch_size: int | None = None
    lr_scaling: str | None = None  # None: the recipe's default (finetune.recipe.batch_plan.DEFAULT_LR_SCALING)
    recipe: str = "RECIPE.yaml"
    # Planned from a recipe (finetune.plan.from_recipe): the launch leaves model, precision, LoRA, lengths and learning
    # rate to it and passes only the keys in `launch_keys`, besides the batch.
    from_recipe: bool = False
    launch_keys: tuple[str, ...] = ()
    lora_target_modules: tuple[str, ...] | None = None
    dora: bool = False
    lora_modules_to_save: tuple[str, ...] | None = None
    attention: str = "sdpa"
    # Token count of every training row after truncation (and packing); None: every row is `sequence_length` long.
    token_lengths: tuple[int, ...] | None = None
    # A vision-language model's: image tokens of the row with the most (from the data), and which parts are frozen
    image_tokens_per_row: int = 0
    vision_tower_frozen: bool = True
    projector_frozen: bool = False
    padding_free: bool = False  # each micro-batch flattened into one row (its tokens, no padding)
    packing: bool = False  # rows of several examples told apart by position ids
    your_strategy: Strategy | None = None  # the strategy the recipe or `--config` launches, checked beside the tree
    your_config: str | None = None
    method: str = DEFAULT_METHOD  # a training method's name (finetune.recipe.methods): what it adds to the memory
    method_terms: MethodTerms | None = None  # what a recipe's settings of it add (None: the method's, by name)
    kernels: FusedKernels = FusedKernels()  # Liger's fused kernels the recipe asks for (`use_liger_kernel`)
    num_generations: int | None = None  # an online RL method's group size asked for (None: its default, 8)
    completion_length: int | None = None  # an online RL method's new tokens a completion (None: the method's)
    gather_for_generation: bool | None = None  # ZeRO-3: TRL's `ds3_gather_for_generation` (None: the method's, on)
    recipe_sets_deepspeed: bool = False  # the recipe's `deepspeed` key, which wins over the launch config
    # Measured beyond the prediction on this GPU, by strategy label (finetune.plan.calibration.calibration_for)
    calibrations: dict = field(default_factory=dict, hash=False)
    cpu_processes: bool = False  # CPU processes stand in for the GPUs: CPU-runnable strategies, no CUDA context
    micro_batch_size: int | None = None  # every strategy estimated at the micro-batch the run will use, not at 1
    nodes: int = 1
    inter_node_gbps: float = 100.0  # network bandwidth of one node, Gb/s per direction
    tflops_per_gpu: float = 400.0  # achieved, not peak: about 40% MFU on an H100


def candidates_for(gpus: int, cpu_processes: bool = False) -> tuple[Candidate, ...]:
    """The decision tree's strategies for this many GPUs, in order (on CPU processes, those that run there)."""
    if gpus == 1:  # sharding over one rank saves nothing; offload still helps
        candidates = (SINGLE_GPU, *(c for c in CANDIDATES if "offload" in c.name))
    else:
        candidates = CANDIDATES
    return tuple(c for c in candidates if c.cpu or c is SINGLE_GPU) if cpu_processes else candidates


def context_bytes(request: PlanRequest) -> int:
    return 0 if request.cpu_processes else CUDA_CONTEXT_BYTES


def accumulation_steps(request: PlanRequest, micro_batch_size: int) -> int:
    """Micro-steps per optimizer step at this micro-batch: what the global batch leaves to accumulation."""
    return math.ceil(request.global_batch_size / request.gpus / micro_batch_size)


def planned_sequence_length(request: PlanRequest, micro_batch_size: int) -> int:
    """Tokens per row of a micro-batch, from the data when its lengths are known: rows are padded to the longest of
    the micro-batch, and the longest of b rows stays at or under the q^(1/b) quantile of one row's length with
    probability q (`LENGTH_QUANTILE`). Padding-free batches have no padding: one row of b examples, counted here as
    b rows of the mean length (the same tokens). Without data: `sequence_length`."""
    lengths = request.token_lengths
    if not lengths:
        return request.sequence_length
    if request.padding_free:
        return math.ceil(sum(lengths) / len(lengths))
    ordered = sorted(lengths)
    rank = math.ceil(LENGTH_QUANTILE ** (1 / micro_batch_size) * len(ordered)) - 1
    return ordered[min(max(rank, 0), len(ordered) - 1)]


def _setup(request: PlanRequest, options: dict, micro_batch_size: int) -> Setup:
    return Setup(
        **options, num_gpus=request.gpus, precision=request.precision, optimizer=request.optimizer,
        lora_rank=request.lora_rank, qlora=request.qlora, micro_batch_size=micro_batch_size,
        lora_dropout=request.lora_dropout if request.lora_rank else 0.0,
        packed=request.packing or request.padding_free,
        lora_target_modules=request.lora_target_modules, dora=request.dora,
        lora_modules_to_save=request.lora_modules_to_save, attention=request.attention,
        sequence_length=planned_sequence_length(request, micro_batch_size),
        gradient_checkpointing=request.gradient_checkpointing,
        gpus_per_node=request.gpus // request.nodes if request.nodes > 1 else None,
        gradient_accumulation_steps=accumulation_steps(request, micro_batch_size),
        method=method_terms(request), kernels=request.kernels,
        image_tokens=micro_batch_size * request.image_tokens_per_row,
        vision_tower_frozen=request.vision_tower_frozen, projector_frozen=request.projector_frozen,
    )


def method_terms(request: PlanRequest) -> MethodTerms:
    """What the method adds to the estimate: a recipe's settings of it, else the method's own terms by name, with the
    completion length asked for where it generates."""
    terms = request.method_terms or method_class(request.method).memory
    if terms.generates and request.completion_length:
        terms = replace(terms, completion_length=request.completion_length)
    if terms.generates and request.gather_for_generation is not None:
        terms = replace(terms, gathers_for_generation=request.gather_for_generation)
    return terms


def shortfall(request: PlanRequest, result: MemoryEstimate, overhead_bytes: int = 0) -> str | None:
    """Why a strategy does not fit (None: it fits): GPU memory (with any calibrated overhead), host RAM for the
    offloaded states, or host RAM while the model loads."""
    usable = usable_bytes(request.gpu_memory_gib, context_bytes(request))
    if result.total_bytes + overhead_bytes > usable:
        return "gpu"
    if request.host_memory_gib is None:
        return None
    host = HEADROOM * request.host_memory_gib * GiB
    if result.setup.offload_optimizer == "cpu" and result.host_bytes_per_node > host:
        return "host offload"
    if result.host_load_bytes_per_node > host:
        return "host load"
    return None


def fits(request: PlanRequest, result: MemoryEstimate, overhead_bytes: int = 0) -> bool:
    return shortfall(request, result, overhead_bytes) is None


def _row(request: PlanRequest, name: str, config: str | None, result: MemoryEstimate, strategy_label: str,
         key: str | None = None) -> dict:
    overhead, calibrated_by = overhead_of(request.calibrations, strategy_label, request.method,
                                          result.num_parameters, result.total_bytes)
    reason = shortfall(request, result, overhead)
    row = {"name": name, "key": key, "config": config, "fits": reason is None, "shortfall": reason,
           "estimate": result, "strategy_label": strategy_label, "overhead_bytes": overhead,
           "calibrated_by": calibrated_by}
    if result.setup.offload_param == "nvme":  # what `offload_param.buffer_size` must hold (finetune train: "auto")
        row["nvme_param_buffer_size"] = largest_partition(model_shape(request.model), request.gpus)
    return row


def resolve_global_batch(request: PlanRequest) -> tuple[int, str | None]:
    """The global batch planned and, when a default was adapted to the GPU count, a note saying so. A batch the
    user gave must split over the GPUs (the same check `finetune train` makes)."""
    if request.global_batch_size is not None:
        try:
            plan_batch(request.global_batch_size, request.gpus, 1)  # refuses an uneven split, naming the key
        except RecipeError as error:
            raise RecipeError(f"{error} Give a multiple of {request.gpus} (`--global-batch-size`), or none: the "
                              "default is then rounded up to the GPU count.") from None
        return request.global_batch_size, None
    adapted = reachable_global_batch(DEFAULT_GLOBAL_BATCH_SIZE, request.gpus)
    if adapted == DEFAULT_GLOBAL_BATCH_SIZE:
        return adapted, None
    return adapted, (f"global batch {adapted}: the default {DEFAULT_GLOBAL_BATCH_SIZE} rounded up to a multiple of "
                     f"{request.gpus} GPUs (give --global-batch-size to choose)")


def make_plan(request: PlanRequest) -> dict:
    if request.gpus < 1 or request.gpu_memory_gib <= 0:
        raise RecipeError("`--gpus` must be at least 1 and `--gpu-memory` positive (GiB per GPU).")
    if request.nodes < 1 or request.gpus % request.nodes:
        raise RecipeError(f"`--gpus {request.gpus}` counts the GPUs of all nodes: it must be a multiple of "
                          f"`--nodes {request.nodes}`.")
    global_batch, batch_note = resolve_global_batch(request)
    request = replace(request, precision=plan_precision(request), global_batch_size=global_batch)
    shape = model_shape(request.model)
    first_micro = request.micro_batch_size or 1
    rows = [_row(request, candidate.name, candidate.config,
                 estimate(shape, _setup(request, candidate.options, first_micro)), candidate.strategy_label,
                 candidate.key)
            for candidate in candidates_for(request.gpus, request.cpu_processes)]
    for row in rows:  # whether a strategy fits at all: at the smallest micro-batch
        row["micro_batch_size"] = first_micro
    recommended = next((row for row in rows if row["fits"]), None)
    yours = None
    if request.your_strategy is not None:
        options = request.your_strategy.for_world_size(request.gpus).estimator_options()
        micro = min(request.max_micro_batch_size, max(1, global_batch // request.gpus))
        yours = _row(request, f"yours: {request.your_strategy.label}", request.your_config,
                     estimate(shape, _setup(request, options, micro)), request.your_strategy.label)
        yours["micro_batch_size"] = micro
    plan = {
        "model": request.model,
        "num_parameters": shape.num_parameters,
        "trainable_parameters": rows[0]["estimate"].trainable_parameters,
        "gpus": request.gpus,
        "gpu_memory_gib": request.gpu_memory_gib,
        "gpu": request.gpu and request.gpu.describe(),
        "precision": request.precision,
        "global_batch_size": global_batch,
        "global_batch_note": batch_note,
        "calibrations": request.calibrations,
        "device_context_bytes": context_bytes(request),
        "strategies": rows,
        "your_strategy": yours,
        "recommended": recommended and recommended["name"],
        "recommended_estimate": None,
        "sequence_length": None,
        "batch_plan": None,
        "launch_command": None,
        "launch_note": None,
        "parallel_3d": None,
        "inter_node": None,
        "axes": [],
        "axis_choice": None,
        "group_sizes": None,
        "gathered_policy": gathered_policy_note(request, shape, rows),
    }
    if request.nodes > 1:
        plan["inter_node"] = inter_node_traffic(request, shape, plan["trainable_parameters"])
    if recommended is None:
        return _with_axes(request, shape, plan)
    candidate = next(c for c in candidates_for(request.gpus, request.cpu_processes) if c.name == recommended["name"])
    micro = largest_micro_batch(request, shape, candidate, recommended["overhead_bytes"])
    plan["batch_plan"] = batch_plan(request, micro)
    planned_micro = plan["batch_plan"]["micro_batch_size"]
    plan["recommended_estimate"] = estimate(shape, _setup(request, candidate.options, planned_micro))
    # the recommended row as the run will hold it: at the batch plan's micro-batch, not the smallest
    index = rows.index(recommended)
    rows[index] = _row(request, recommended["name"], recommended["config"], plan["recommended_estimate"],
                       recommended["strategy_label"], recommended["key"])
    rows[index]["micro_batch_size"] = planned_micro
    plan["sequence_length"] = planned_sequence_length(request, planned_micro)
    plan["launch_command"] = launch_command(request, candidate, plan["batch_plan"])
    if request.recipe_sets_deepspeed and not candidate.deepspeed:
        plan["launch_note"] = ("the recipe's `deepspeed` key would run DeepSpeed whatever the launch config: remove "
                               f"it to run {candidate.name}")
    if method_terms(request).generates:
        from finetune.plan.generation import group_sizes

        plan["group_sizes"] = group_sizes(request, shape, candidate, plan["batch_plan"], recommended["overhead_bytes"])
    return _with_axes(request, shape, plan)


def gathered_policy_note(request: PlanRequest, shape, rows: list[dict]) -> str | None:
    """What GRPO's generation round costs under ZeRO-3 and the setting that avoids it, where a ZeRO-3 row counts the
    gathered policy (finetune.memory.estimate.gathered_policy_bytes); None elsewhere."""
    from finetune.memory.estimate import gathered_policy_bytes

    gathered = max((gathered_policy_bytes(shape, row["estimate"].setup) for row in rows), default=0)
    if not gathered:
        return None
    return (f"under ZeRO-3 each generation round gathers the whole policy onto every GPU ({_size(gathered)}, counted "
            "in the ZeRO-3 rows; TRL's `ds3_gather_for_generation`, on by default); `ds3_gather_for_generation: "
            "false` (`--ds3-gather-for-generation false`) avoids it, gathering each layer again for every "
            "generated token instead: no such peak, but far slower generation.")


def _with_axes(request: PlanRequest, shape, plan: dict) -> dict:
    """The parallelism axes' rows (`axis_rows`) beside the data-parallel tree. The first 2D axis that fits is
    recommended instead of the tree's answer where no data-parallel strategy fits, or only an offload one while a
    long sequence's activations outweigh the model states (offloading states leaves them). PP × TP × DP is
    recommended when nothing simpler fits: no data-parallel strategy without offload and no 2D axis (offload would
    step every parameter's Adam on the host; 3D keeps the step on the GPUs). The plan says why."""
    plan["axes"] = axis_rows(request, shape, request.micro_batch_size or 1)
    plan["axis_choice"] = None
    three_d = next((row for row in plan["axes"] if "sizes" in row), None)
    plan["parallel_3d"] = three_d and {"name": three_d["name"], **three_d["sizes"], "fits": three_d["fits"],
                                       "total_bytes": three_d["estimate"].total_bytes}
    tree_fits = next((row for row in plan["strategies"] if row["fits"]), None)
    zero3 = next((row for row in plan["strategies"] if row["key"] == "zero3"), None)
    simpler = [row for row in plan["axes"] if row is not three_d]
    if tree_fits is not None and "offload" not in tree_fits["name"]:
        return plan
    if tree_fits is not None and (zero3 is None or not _long_sequence_bound(zero3["estimate"])):
        # offload fits: kept unless no 2D axis fits and 3D does
        if any(row["fits"] for row in simpler) or three_d is None or not three_d["fits"]:
            return plan
    chosen = next((row for row in plan["axes"] if row["fits"]), None)
    if chosen is None:
        return plan
    because = "no data-parallel strategy fits" + (" without offload" if tree_fits is not None else "")
    if zero3 is not None and zero3["shortfall"] in ("gpu", None):
        result = zero3["estimate"]
        because += (f" (ZeRO-3 needs {_size(result.total_bytes)} per GPU, {_size(result.activations_bytes)} of it "
                    "activations)")
    elif zero3 is not None:
        because += f" (ZeRO-3: {_shortfall_in_words(zero3)})"
    if chosen is three_d and simpler:
        because += "; nor does a 2D axis (" + "; ".join(f"{row['name']}: {_shortfall_in_words(row)}"
                                                         for row in simpler) + ")"
    plan["axis_choice"] = {"name": chosen["name"], "key": chosen["key"], "because": f"{because}; {chosen['why']}",
                           "overrides": chosen["overrides"], "launch_command": axis_launch_command(request, chosen)}
    plan["recommended"] = chosen["name"]
    plan["recommended_estimate"] = chosen["estimate"]
    plan["batch_plan"] = None  # the axis's overrides say how the batch splits (`finetune train` plans it)
    plan["launch_command"] = plan["axis_choice"]["launch_command"]
    return plan


def _shortfall_in_words(row: dict) -> str:
    """What a row is short of, with its size: GPU memory, or host RAM at load or for offload."""
    result = row["estimate"]
    return {"gpu": f"{_size(planned_total(row))} a GPU",
            "host load": f"{_size(result.host_load_bytes_per_node)} of host RAM a node at load",
            "host offload": f"{_size(result.host_bytes_per_node)} of host RAM a node for offload"}[row["shortfall"]]


LONG_SEQUENCE = 16384  # tokens: where sequence parallelism starts to pay (ALST, axolotl's long-context recipes)


def _long_sequence_bound(result: MemoryEstimate) -> bool:
    """A long sequence's activations outweigh the model states a GPU holds: offloading states does not solve that."""
    states = result.params_bytes + result.grads_peak_bytes + result.optimizer_bytes
    return result.setup.sequence_length >= LONG_SEQUENCE and result.activations_bytes > states


def axis_sizes(count: int, gpus: int, per_node: int) -> int:
    """The largest size ≤ the GPUs of a node (and of the run) that divides `count` (heads) and the GPU count."""
    return max((size for size in range(2, min(gpus, per_node) + 1) if count % size == 0 and gpus % size == 0),
               default=1)


def head_split(request: PlanRequest, shape) -> int:
    """The size an axis that splits the heads takes (SP's all-to-all, TP's matrices): the largest within a node
    dividing every attention and key-value head and the GPU count (1: none)."""
    heads = math.gcd(shape.num_attention_heads, shape.num_key_value_heads)
    return axis_sizes(heads, request.gpus, request.gpus // request.nodes)


def hidden_states_bytes(request: PlanRequest, shape, micro_batch_size: int) -> int:
    """One micro-batch's hidden states at the planned length in the compute dtype: what an axis's collectives move
    per layer."""
    c = 4 if plan_precision(request) == "fp32" else 2
    return micro_batch_size * planned_sequence_length(request, micro_batch_size) * shape.hidden_size * c


def axis_rows(request: PlanRequest, shape, micro_batch_size: int) -> list[dict]:
    """The parallelism axes for this request, each at the size a node allows, with its memory per GPU (the estimator's
    terms) and what it costs in communication or idle time, as each axis's home plans its rows (`Axis.plan_rows`, in
    the registry's order: SP × ZeRO-3, TP × FSDP2, then a pipeline's PP, PP × DP and, last, PP × TP × DP rows, the last
    chosen only when none of the others fits); none on one GPU."""
    if request.gpus < 2:
        return []
    return [row for axis in all_axes() for row in axis.plan_rows(request, shape, micro_batch_size)]


def _axis_row(request: PlanRequest, shape, micro_batch_size: int, name: str, key: str, options: dict,
              overrides: dict, config: str, replicas: int, cost: str, why: str, micro_batches: int | None = None,
              ranks: int = 1, runs_as: dict | None = None) -> dict:
    """One axis's row: the estimate on the rank holding the most (over `ranks` ranks: for PP, every stage, the largest
    total). `runs_as`: what the axis's run changes in the request's setup (a pipeline pads every row to
    `max_seq_length` and runs without gradient checkpointing)."""
    results = []
    for rank in range(ranks):
        setup = replace(_setup(request, {**options, "rank": rank}, micro_batch_size),
                        **({"gradient_accumulation_steps": micro_batches} if micro_batches else {}), **(runs_as or {}))
        results.append(estimate(shape, setup))
    result = max(results, key=lambda item: item.total_bytes)
    row = _row(request, name, config, result, result.setup.strategy, key)
    row.update(overrides=[f"{option} {value}" for option, value in overrides.items()], cost=cost, why=why,
               replicas=replicas)
    return row


def axis_launch_command(request: PlanRequest, row: dict) -> str:
    parts = ["accelerate launch", f"--config_file {row['config']}"]
    if request.gpus != 2:
        parts.append(f"--num_processes {request.gpus}")
    return " ".join([*parts, "-m finetune train", request.recipe, *row["overrides"]])


def plan_precision(request: PlanRequest) -> str:
    """The mixed precision planned: `auto` is bf16 on a GPU that has it and fp16 on one that does not (a T4, compute
    capability 7.5); asking bf16 by name for such a GPU is refused, since `finetune train` would refuse it there
    (`finetune.recipe.preflight.check_precision_on_gpu`)."""
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


def planned_total(row: dict) -> int:
    """A strategy's predicted bytes per GPU with the calibration measured on this GPU added: what `fits` holds
    against the usable memory."""
    return row["estimate"].total_bytes + row["overhead_bytes"]


def why_not(row: dict, plan: dict) -> str:
    """Why the plan passed a strategy over (its `shortfall`), in words."""
    usable = usable_bytes(plan["gpu_memory_gib"], plan["device_context_bytes"])
    return {"gpu": f"{_size(planned_total(row))} > {_size(usable)} usable",
            "host offload": "host RAM short for offload",
            "host load": "host RAM short while every rank loads the model"}[row.get("shortfall") or "gpu"]


def decision_path(plan: dict) -> list[str]:
    """The decision tree as walked for this plan: each strategy tried in order, with its predicted GiB per GPU
    against the usable memory, up to the first that fits; where an axis is recommended instead (`_with_axes`), the
    axes tried after the tree, up to it."""
    usable = usable_bytes(plan["gpu_memory_gib"], plan["device_context_bytes"])
    choice = plan.get("axis_choice")
    lines = []
    for row in plan["strategies"]:
        if row["fits"] and choice is None:
            lines.append(f"{row['name']}: {_size(planned_total(row))} ≤ {_size(usable)} usable → recommended")
            return lines
        if row["fits"]:
            lines.append(f"{row['name']}: fits with offload, passed over for an axis that fits without it → next")
            break
        lines.append(f"{row['name']}: {why_not(row, plan)} → next")
    if choice is None:
        lines.append("nothing fits: more or larger GPUs, LoRA/QLoRA, gradient checkpointing or shorter sequences")
        return lines
    for row in plan["axes"]:
        if row["name"] == choice["name"]:
            lines.append(f"{row['name']}: {_size(planned_total(row))} ≤ {_size(usable)} usable → recommended")
            return lines
        lines.append(f"{row['name']}: {why_not(row, plan)} → next")
    return lines


def _size(num_bytes: float) -> str:
    return f"{num_bytes / GiB:,.1f} GiB" if num_bytes >= GiB else f"{num_bytes / 1024**2:,.1f} MiB"


def largest_micro_batch(request: PlanRequest, shape, candidate: Candidate, overhead_bytes: int = 0) -> int:
    """The largest power-of-two micro-batch (up to the per-GPU share of the global batch) that still fits."""
    limit = min(request.max_micro_batch_size, max(1, request.global_batch_size // request.gpus))
    micro = 1
    while micro * 2 <= limit and fits(request, estimate(shape, _setup(request, candidate.options, micro * 2)),
                                      overhead_bytes):
        micro *= 2
    return micro


def batch_plan(request: PlanRequest, max_micro_batch_size: int) -> dict:
    """The batch plan `finetune train` makes for this global batch on `request.gpus` processes
    (`finetune.recipe.batch_plan.plan_from_recipe`, the same defaults), capped at the micro-batch that fits."""
    base_lr = request.learning_rate or (2e-4 if request.lora_rank else 2e-5)
    training = {"per_device_train_batch_size": max_micro_batch_size, "gradient_accumulation_steps": 1,
                "global_batch_size": request.global_batch_size, "max_micro_batch_size": max_micro_batch_size,
                "learning_rate": base_lr, "base_batch_size": request.base_batch_size,
                "lr_scaling": request.lr_scaling}
    record = plan_from_recipe(training, request.sequence_length, request.gpus).to_dict()
    record["max_micro_batch_size"] = max_micro_batch_size
    return record


def launch_command(request: PlanRequest, candidate: Candidate, batch: dict) -> str:
    """`accelerate launch` of `finetune train` with the global batch and the micro-batch cap that fits, so that the
    recipe plans micro-batch × accumulation (and scales the learning rate) for whatever world size it gets."""
    parts = ["accelerate launch", f"--config_file {candidate.config}"]
    default_processes = 1 if candidate is SINGLE_GPU else 2
    if request.gpus != default_processes:
        parts.append(f"--num_processes {request.gpus}")
    parts += ["-m finetune train", request.recipe, f"--global_batch_size {batch['global_batch_size']}",
              f"--max_micro_batch_size {batch['max_micro_batch_size']}"]
    if request.from_recipe:
        if request.recipe_sets_deepspeed and candidate.deepspeed:  # else the recipe's own JSON would win
            parts.append(f"--deepspeed {candidate.deepspeed}")
        return " ".join(parts + list(request.launch_keys))
    parts.insert(-2, f"--model_name_or_path {ALIASES.get(request.model.lower(), request.model)}")
    parts.append(f"--learning_rate {batch['base_learning_rate']:.3g}")
    if request.lr_scaling not in (None, "none"):
        parts.append(f"--lr_scaling {request.lr_scaling}")
    if request.base_batch_size is not None:
        parts.append(f"--base_batch_size {request.base_batch_size}")
    parts.append(f"--max_seq_length {request.sequence_length}")
    if request.precision != "fp32":  # the recipe key wins over the Accelerate config's mixed_precision
        parts.append(f"--{request.precision} true")
    if request.qlora:  # the 4-bit base the memory was estimated for; `use_qlora` implies LoRA
        parts.append(f"--use_qlora true --lora_r {request.lora_rank}")
    elif request.lora_rank:
        parts.append(f"--use_lora true --lora_r {request.lora_rank}")
    if request.gradient_checkpointing:
        parts.append("--gradient_checkpointing true")
    if request.method != DEFAULT_METHOD:
        parts.append(f"--method {request.method}")
    return " ".join(parts)
