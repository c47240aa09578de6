"""Pipeline parallelism's home on the axis seam: its recipe keys and their checks, the plan of its self-launch, and
at run time the stage each rank holds and the loop that trains it (`loop`: neither Trainer nor Accelerate drive a
pipeline). Tensor parallelism beside it runs inside each stage (3D: pipeline × tensor × data)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from finetune.axes import Axis
from finetune.errors import RecipeError
from finetune.launch.parallelism import Parallelism, process_count
from finetune.launch.strategies import Strategy, is_true
from finetune.train.axes.pipeline.layout import PipelineLayout
from finetune.train.axes.tensor import KEY as TENSOR_KEY

# torch.distributed.pipelining's single-stage schedules a recipe may name
SCHEDULES = ("gpipe", "1f1b")
# what a step's micro-batches are padded to: the step's longest row, or `max_seq_length` (one shape for every step)
STEP_LENGTHS = ("longest", "max_seq_length")
# the dtype of the hidden states (and their gradients) passed between stages
HAND_OFF_DTYPES = ("fp32", "bf16")


@dataclass
class PipelineArguments:
    pipeline_parallel_size: int | None = field(
        default=None,
        metadata={"help": "Split the model's layers into this many consecutive stages, one a process (pipeline "
                          "parallelism on torch.distributed.pipelining), each step's batch flowing through them in "
                          "`gradient_accumulation_steps` micro-batches. Launched as plain processes, one a stage; "
                          "a multiple of it runs that many replicas of the pipeline, data parallel; with "
                          f"{TENSOR_KEY} each stage's layers are split over that many processes (PP × TP × "
                          "DP). SFT, full fine-tuning or LoRA (`use_lora`: PP × DP; not QLoRA, DoRA, "
                          f"modules_to_save, nor LoRA with {TENSOR_KEY})."},
    )
    pipeline_schedule: str = field(
        default="1f1b",
        metadata={"help": "With pipeline_parallel_size: gpipe (every micro-batch's forward, then the backwards) or "
                          "1f1b (one forward, one backward: fewer micro-batches' activations held at once)."},
    )
    pipeline_step_length: str = field(
        default="longest",
        metadata={"help": "With pipeline_parallel_size: longest (each step's micro-batches padded to the step's "
                          "longest row, rounded up to a multiple of 8: torch's schedule is rebuilt for each new "
                          "length) or max_seq_length (every step at one shape: padding costs compute, the buffers "
                          "never change)."},
    )
    pipeline_hand_off_dtype: str = field(
        default="fp32",
        metadata={"help": "With pipeline_parallel_size: the dtype the hidden states and their gradients pass between "
                          "stages in. fp32: as a stage computes them (its residual over fp32 master weights), a "
                          "one-process run's numbers; bf16 (with `bf16: true`): half the bytes sent and held in "
                          "receive buffers, each hand-off rounded to bf16."},
    )


class PipelineParallelism(Axis):
    name = "pipeline"
    description = "the model's layers in consecutive stages, one a process, the batch flowing through in micro-batches"
    arguments = PipelineArguments
    size_key = "pipeline_parallel_size"
    runs_the_steps = True
    launched_as = "ddp"  # plain processes, one a stage
    splits_tensor_parallelism = True  # each stage's layers over the mesh's tp ranks (3D)

    def check(self, sections, parallelism, strategy):
        keys = {**sections.training_inputs, "pipeline_parallel_size": self.settings.pipeline_parallel_size,
                "pipeline_schedule": self.settings.pipeline_schedule,
                "pipeline_step_length": self.settings.pipeline_step_length,
                "pipeline_hand_off_dtype": self.settings.pipeline_hand_off_dtype}
        strategy = check_pipeline(keys, sections.data, sections.lora.use_lora or sections.lora.use_qlora,
                                  sections.method.name, parallelism, strategy, lora=sections.lora)
        self.settings.pipeline_schedule = keys["pipeline_schedule"]  # as the loop names them
        self.settings.pipeline_step_length = keys.get("pipeline_step_length", "longest")
        self.settings.pipeline_hand_off_dtype = keys.get("pipeline_hand_off_dtype", "fp32")
        return strategy

    def before_loading(self, recipe) -> None:
        from finetune.train.axes.pipeline.loop import check_shared_output_dir

        check_shared_output_dir(recipe.training.output_dir)  # every stage writes there: all ranks must see it

    def loads_shapes_only(self, recipe) -> bool:
        from finetune.train.axes.pipeline.stages import loads_stage_only

        return loads_stage_only(recipe.model)

    def prepare_model(self, recipe, model):
        from finetune.train.axes.pipeline.stages import cut_stage

        return cut_stage(recipe, model)  # this rank's stage, the only weights it reads

    def run(self, recipe, model, prepared, tokenizer, data, resume, host_load_bytes):
        from finetune.train.axes.pipeline.loop import train_pipeline

        return train_pipeline(recipe, model, prepared, tokenizer, data, resume, host_load_bytes=host_load_bytes,
                              step_length=self.settings.pipeline_step_length)

    @classmethod
    def files_a_resume_needs(cls, marker: dict, needs: list[list[str]]) -> list[list[str]]:
        """The files its marker lists (each stage's), and no RNG state."""
        return [["trainer_state.json"], *([name] for name in marker.get("files", ()) if Path(name).name == name)]

    @classmethod
    def plan_rows(cls, request, shape, micro_batch_size: int) -> list[dict]:
        from finetune.train.axes.pipeline.plan import plan_rows

        return plan_rows(request, shape, micro_batch_size)

    def plan_launch(self, recipe: str, overrides: list[str], machine, sections) -> dict | None:
        """The plan record of a self-launch (`finetune train --gpus N`): every stage estimated as the loop runs it
        (the recipe's micro-batches, a step at `max_seq_length`, the longest it can be; the launch's processes over
        the stages are the replicas), the fullest rank's memory against this machine's GPUs and the node's host RAM
        at load (each rank reads its stage alone) against its RAM; None where the model's shape cannot be read
        (launched unplanned)."""
        from finetune.launch.parallelism import process_count
        from finetune.memory.shapes import model_shape
        from finetune.plan.calibration import calibration_for
        from finetune.plan.decision_tree import context_bytes, usable_bytes
        from finetune.plan.from_recipe import request_from_recipe
        from finetune.plan.launch import MARGIN, predicted_per_rank
        from finetune.recipe.batch_plan import plan_from_recipe
        from finetune.train.axes.pipeline.plan import pipeline_row

        training = sections.training_inputs
        stages = self.size
        tensor = process_count(TENSOR_KEY, sections.axis_inputs.get(TENSOR_KEY), "the recipe") or 1
        if machine.processes % (stages * tensor):
            each = f"{stages} × {tensor} = {stages * tensor}" if tensor > 1 else f"{stages}"
            raise RecipeError(f"`pipeline_parallel_size: {stages}` runs one stage a process"
                              f"{f' split over `{TENSOR_KEY}: {tensor}`' if tensor > 1 else ''}, but this "
                              f"launch has {machine.processes} process(es): launch a multiple of {stages * tensor} "
                              f"(each {each} processes one replica of the pipeline, data parallel across replicas).")
        replicas = machine.processes // (stages * tensor)
        batch = plan_from_recipe(training, sections.data.max_seq_length, replicas)  # the replicas share the batch
        request, _ = request_from_recipe(recipe, machine.processes, machine.memory_gib, machine.gpu,
                                         overrides=overrides, sections=sections,
                                         host_memory_gib=machine.host_memory_gib, nodes=machine.nodes,
                                         cpu_processes=machine.cpu,
                                         calibrations=calibration_for(machine.gpu and machine.gpu.name))
        try:
            shape = model_shape(request.model)
        except RecipeError:
            return None
        row = pipeline_row(request, shape, batch.micro_batch_size, stages, self.settings.pipeline_schedule,
                           batch.gradient_accumulation_steps, replicas=replicas, tensor=tensor,
                           hand_off=self.settings.pipeline_hand_off_dtype)
        return {
            "strategy": "pipeline", "label": row["name"], "chosen_by": "the recipe's pipeline_parallel_size",
            "device": machine.describe(), "processes": machine.processes, "nodes": machine.nodes,
            "memory_per_gpu_gib": machine.memory_gib, "memory_source": machine.memory_source,
            "usable_bytes": int(usable_bytes(machine.memory_gib, context_bytes(request))), "margin": MARGIN,
            "micro_batch_size": batch.micro_batch_size, "fits": row["fits"], "shortfall": row["shortfall"],
            "rejected": [], "candidates": [], "predicted": predicted_per_rank(row, machine),
            "host_load_bytes_per_node": row["estimate"].host_load_bytes_per_node,
        }


def check_pipeline(training_inputs: dict[str, Any], data_args, use_lora: bool, method: str,
                   parallelism: Parallelism, strategy: Strategy, lora=None) -> Strategy:
    """`pipeline_parallel_size` against the launch and the rest of the recipe (`loop` says what the pipeline loop
    runs); the strategy becomes the pipeline when one is asked for. `lora`: the recipe's LoRA section, whose
    variants the stages do not run are refused by name (without it `use_lora` is taken as plain LoRA)."""
    size = process_count("pipeline_parallel_size", training_inputs.get("pipeline_parallel_size"), "the recipe")
    if size in (None, 1):
        return strategy
    schedule = str(training_inputs.get("pipeline_schedule") or "1f1b").lower()
    if schedule not in SCHEDULES:
        raise RecipeError(f"`pipeline_schedule: {schedule}` is not one of {', '.join(SCHEDULES)}.")
    training_inputs["pipeline_schedule"] = schedule
    length = str(training_inputs.get("pipeline_step_length") or "longest").lower()
    if length not in STEP_LENGTHS:
        raise RecipeError(f"`pipeline_step_length: {length}` is not one of {', '.join(STEP_LENGTHS)}.")
    training_inputs["pipeline_step_length"] = length
    hand_off = str(training_inputs.get("pipeline_hand_off_dtype") or "fp32").lower()
    if hand_off not in HAND_OFF_DTYPES:
        raise RecipeError(f"`pipeline_hand_off_dtype: {hand_off}` is not one of {', '.join(HAND_OFF_DTYPES)}.")
    if hand_off == "bf16" and not is_true(training_inputs.get("bf16")):
        raise RecipeError("`pipeline_hand_off_dtype: bf16` rounds the hidden states passed between stages to bf16, "
                          "which a run computing in fp32 would not do: set `bf16: true`, or hand off in fp32.")
    training_inputs["pipeline_hand_off_dtype"] = hand_off
    world_size, tensor = int(os.environ.get("WORLD_SIZE", "1")), parallelism.size(TENSOR_KEY)
    if world_size % (size * tensor):
        ranks = f"{size} × {TENSOR_KEY} {tensor} = {size * tensor}" if tensor > 1 else f"{size}"
        raise RecipeError(f"`pipeline_parallel_size: {size}` runs one stage a process, but the launch has "
                          f"{world_size} process(es): launch a multiple of {ranks} (each {size * tensor} processes "
                          "one replica of the pipeline, data parallel across replicas).")
    if strategy.kind not in ("ddp", "single"):
        raise RecipeError(f"`pipeline_parallel_size: {size}` under {strategy.describe()}: the pipeline loop runs "
                          "its stages as plain processes (accelerate_configs/ddp.yaml, or `finetune train --gpus "
                          f"{size} --strategy ddp`), not under a DeepSpeed or FSDP config.")
    # tensor parallelism runs inside each stage; the other axes need their own engines (Ulysses under DeepSpeed,
    # context parallelism under FSDP2) or shard what the stage's replicas hold whole
    others = parallelism.replaced(**{TENSOR_KEY: 1})
    qlora, dora = bool(getattr(lora, "use_qlora", False)), bool(getattr(lora, "use_dora", False))
    refused = [(others != Parallelism(), f"{others.describe()} beside it"),
               # its 4-bit base is quantized while the whole model loads onto each GPU (bitsandbytes), where the
               # stages build the model on the meta device and read their own tensors
               (qlora, "QLoRA (its 4-bit base loads whole on every GPU; the stages read their own tensors: use "
                       "`use_lora` on the bf16 base)"),
               # torch's ColwiseParallel/RowwiseParallel split nn.Linear and nn.Embedding only, not peft's LoraLayer
               # wrapping them, and peft's own TP path is Transformers' `tp_plan` loading, not a stage's mesh
               (use_lora and tensor > 1, f"LoRA and `{TENSOR_KEY}` (torch's TP styles split plain linears, "
                                         "not peft's adapted ones)"),
               (use_lora and dora, "`use_dora` (its magnitudes come from base weights a stage reads after peft "
                                   "builds the adapters on the meta device)"),
               (use_lora and bool(getattr(lora, "modules_to_save", None)),
                "`modules_to_save` (its trained copies are not in the checkpoint the stages read)"),
               (method != "sft", f"`method: {method}` (supervised fine-tuning only)"),
               (data_args.packing or data_args.padding_free, "packed or padding-free batches"),
               (data_args.streaming, "streamed data"),
               (is_true(training_inputs.get("gradient_checkpointing")), "gradient checkpointing"),
               (is_true(training_inputs.get("fp16")), "fp16 (use bf16 or fp32)"),
               (is_true(training_inputs.get("torch_compile")), "`torch_compile` (its stages run eagerly)"),
               (is_true(training_inputs.get("save_on_each_node")),
                "`save_on_each_node` (every stage writes its part of the model into one output_dir, which the nodes "
                "must share)")]
    for asked, what in refused:
        if asked:
            raise RecipeError(f"`pipeline_parallel_size: {size}` with {what}: the pipeline loop does not run it; "
                              "drop it, or train without pipeline parallelism.")
    micro_batches = int(training_inputs.get("gradient_accumulation_steps") or 1)
    if schedule == "1f1b" and micro_batches < size:
        raise RecipeError(f"`pipeline_schedule: 1f1b` over {size} stages needs at least {size} micro-batches a step "
                          f"(`gradient_accumulation_steps`, now {micro_batches}): raise it, or use gpipe.")
    return Strategy.of_axis(PipelineLayout(size, schedule, hand_off, tensor), "the recipe", strategy.nodes)
