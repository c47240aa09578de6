"""The pipeline's rows in `finetune plan` (finetune.plan.decision_tree asks each axis on the seam for its rows): PP
on one node, PP × DP a pipeline a node, and PP × TP × DP (3D), each stage estimated as the loop runs it."""

from __future__ import annotations

import math

from finetune.memory.estimate import MemoryEstimate, held_precisions
from finetune.plan.decision_tree import PlanRequest, _axis_row, _size, axis_launch_command, head_split
from finetune.train.axes.pipeline.layout import (
    STEP_LENGTH_MULTIPLE,
    PipelineLayout,
    hand_off_bytes,
    pipeline_bubble_fraction,
    pipeline_recv_buffer_bytes,
    pipeline_stage_layers,
)
from finetune.train.axes.tensor import KEY as TENSOR_KEY


def plan_rows(request: PlanRequest, shape, micro_batch_size: int) -> list[dict]:
    """PP over a node's GPUs (one node), a pipeline a node with the nodes its replicas (several), and the 3D row
    last; full fine-tuning only, none on one GPU."""
    if request.gpus < 2:
        return []
    rows, per_node = [], request.gpus // request.nodes
    full = not (request.lora_rank or request.qlora)
    if full and request.nodes == 1 and request.gpus <= shape.num_layers:
        stages = request.gpus
        micro_batches = max(stages, math.ceil(request.global_batch_size / micro_batch_size))
        rows.append(pipeline_row(request, shape, micro_batch_size, stages, "1f1b", micro_batches))
    if full and request.nodes > 1 and per_node <= shape.num_layers:  # a pipeline a node, the nodes its replicas
        micro_batches = max(per_node, math.ceil(request.global_batch_size / micro_batch_size / request.nodes))
        rows.append(pipeline_row(request, shape, micro_batch_size, per_node, "1f1b", micro_batches,
                                 replicas=request.nodes))
    three_d = parallel_3d_row(request, shape, micro_batch_size)
    return rows + ([three_d] if three_d is not None else [])


def pipeline_row(request: PlanRequest, shape, micro_batch_size: int, stages: int, schedule: str,
                 micro_batches: int, replicas: int = 1, tensor: int = 1, hand_off: str = "fp32") -> dict:
    """The pipeline's row: every stage estimated as the loop runs it (finetune.train.axes.pipeline.loop), the fullest
    shown, and what it costs: the bubble, and the host RAM a node takes to load its stages (each rank reads only its
    own). With `replicas`, that many pipelines, data parallel (a launch of `replicas` × `stages` processes): each rank
    holds its stage as in one pipeline, and each step all-reduces every stage's gradients across the replicas. With
    `tensor` (PP × TP × DP, 3D parallelism), each stage is a TP group of that many GPUs within a node
    (`parallel_3d_row`)."""
    options = {"strategy": PipelineLayout.name, "axis": PipelineLayout(stages, schedule, hand_off, tensor)}
    bubble = pipeline_bubble_fraction(stages, micro_batches)
    name = (f"PP {stages}" + (f" × TP {tensor}" if tensor > 1 else "") + (f" × DP {replicas}" if replicas > 1 else "")
            + f" ({schedule.upper()})")
    if tensor > 1:
        why = (f"TP {tensor} splits each layer's matrices over a node's GPUs, PP {stages} gives each TP group "
               f"1/{stages} of the layers" + (f", {replicas} pipelines data parallel" if replicas > 1 else ""))
    else:
        why = f"PP {stages} holds 1/{stages} of the layers a GPU" + (
            f", {replicas} pipelines data parallel (one a node)" if replicas > 1 else "")
    overrides = {"--pipeline_parallel_size": stages, **({f"--{TENSOR_KEY}": tensor} if tensor > 1 else {}),
                 "--gradient_accumulation_steps": micro_batches}
    row = _axis_row(request, shape, micro_batch_size, name, "pipeline", options, overrides,
                    "accelerate_configs/ddp.yaml", replicas,
                    f"idle {bubble:.0%} of each step (bubble, {micro_batches} micro-batches)", why,
                    micro_batches=micro_batches, ranks=stages,
                    # a step may be max_seq_length long (its longest row's length), and the loop refuses gradient
                    # checkpointing
                    runs_as={"sequence_length": request.sequence_length, "gradient_checkpointing": False})
    result = row["estimate"]
    if tensor > 1:
        row["cost"] += "; " + _tensor_in_stage_cost(shape, result, tensor, micro_batches)
    if replicas > 1:  # a ring all-reduce sends and receives 2 (r − 1)/r of the stage's fp32 gradients
        gradients = result.grads_bytes
        row["cost"] += (f"; the stage's gradients all-reduced over {replicas} replicas: "
                        f"{_size(2 * (replicas - 1) / replicas * gradients)} a GPU a step")
    row["cost"] += (f"; loads {_size(result.host_load_bytes_per_node)}/node ("
                    + ("a rank its TP slice of a stage)" if tensor > 1 else "a stage a rank)"))
    if request.token_lengths:  # each step's rows padded to its longest: FLOPs the data's own lengths do not need
        rows = micro_batch_size * micro_batches
        padding = step_padding_factor(request.token_lengths, rows, request.sequence_length)
        row["padding_factor"] = padding
        trainer = step_padding_factor(request.token_lengths, micro_batch_size, request.sequence_length)
        row["cost"] += (f"; each step's {rows} rows padded to its longest: {padding:.2f}× the data's tokens "
                        f"(Trainer pads each micro-batch of {micro_batch_size}: {trainer:.2f}×)")
    return row


def step_padding_factor(lengths: list[int], rows: int, cap: int) -> float:
    """The tokens a batch of `rows` rows drawn from `lengths` computes when padded to its longest row (rounded up to
    the loop's multiple, at most `cap`), over the tokens of its rows: E[max of `rows` draws] / mean, the expected
    maximum read off the data's sorted lengths (draws with replacement: P(max ≤ x_(i)) = (i/N)^rows)."""
    ordered = sorted(min(int(length), cap) for length in lengths)
    count = len(ordered)
    padded = [min(-(-length // STEP_LENGTH_MULTIPLE) * STEP_LENGTH_MULTIPLE, cap) for length in ordered]
    expected_max = sum(length * ((index / count) ** rows - ((index - 1) / count) ** rows)
                       for index, length in enumerate(padded, start=1))
    return expected_max / (sum(ordered) / count)


def _tensor_in_stage_cost(shape, result: MemoryEstimate, tensor: int, micro_batches: int) -> str:
    """What TP inside a pipeline stage adds to a step: the P2P hand-over between stages (a micro-batch's hidden states
    in the residual dtype each way, torch's receive buffers counted in the stage's activations) and TP's all-reduces:
    per layer and micro-batch 2 forward (after the attention's and the MLP's row-parallel projections) and 2 backward
    (their column-parallel inputs' gradients) of the hidden states in the compute dtype, a ring moving 2 (t − 1)/t of
    each (Megatron-LM, Shoeybi et al. 2019, section 3); within a node, over NVLink."""
    setup = result.setup
    precision = held_precisions(setup)
    states = setup.micro_batch_size * setup.sequence_length * shape.hidden_size
    layers = len(pipeline_stage_layers(shape.num_layers, setup.axis.stages)[0])
    all_reduced = 4 * layers * micro_batches * 2 * (tensor - 1) / tensor * precision.compute * states
    return (f"P2P {_size(hand_off_bytes(setup) * states)} of hidden states a micro-batch each way between stages "
            f"(receive buffers {_size(pipeline_recv_buffer_bytes(shape, setup))} on the fullest stage); TP "
            f"all-reduces 4 × {_size(precision.compute * states)} a layer and micro-batch (NVLink): "
            f"{_size(all_reduced)} a GPU a step")


def parallel_3d_row(request: PlanRequest, shape, micro_batch_size: int) -> dict | None:
    """PP × TP × DP (3D parallelism, Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU
    Clusters Using Megatron-LM"), run by the pipeline loop on a (dp, pp, tp) mesh: TP innermost at a node's GPUs (the
    largest that divides the heads and key/value heads, so its all-reduces stay on NVLink), then the fewest stages p
    that fit (a stage's layers ÷ t, their activations as split), the remaining r = gpus / (p·t) pipelines data
    parallel; where none fits, the most stages (the least memory). Each replica takes its share of the global batch
    in m micro-batches (at least p, so every stage works). None where it cannot run or means nothing: one GPU, LoRA
    or QLoRA (the loop refuses adapters), a node of one GPU, or no p ≥ 2 left beside t."""
    if request.gpus < 2 or request.lora_rank or request.qlora:
        return None
    tensor = head_split(request, shape)
    stage_counts = [stages for stages in range(2, shape.num_layers + 1) if (request.gpus // tensor) % stages == 0]
    if tensor < 2 or not stage_counts:
        return None
    row = None
    for stages in stage_counts:
        replicas = request.gpus // (tensor * stages)
        micro_batches = max(stages, math.ceil(request.global_batch_size / micro_batch_size / replicas))
        row = pipeline_row(request, shape, micro_batch_size, stages, "1f1b", micro_batches, replicas=replicas,
                           tensor=tensor)
        row["sizes"] = {"pipeline_parallel": stages, "tensor_parallel": tensor, "data_parallel": replicas,
                        "micro_batches": micro_batches,
                        "bubble_fraction": pipeline_bubble_fraction(stages, micro_batches)}
        if row["fits"]:
            break
    row["launch_command"] = axis_launch_command(request, row)
    return row
