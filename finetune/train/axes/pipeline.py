"""Pipeline parallelism's home on the axis seam: its recipe keys and checks, and at run time the stage each rank
holds and the loop that trains it (finetune.train.pipeline: neither Trainer nor Accelerate drive a pipeline)."""

from __future__ import annotations

from dataclasses import dataclass, field

from finetune.errors import RecipeError
from finetune.recipe.axes import Axis


@dataclass
class PipelineArguments:
    pipeline_parallel_size: int | None = field(
        default=None,
        metadata={"help": "Split the model's layers into this many consecutive stages, one a process (pipeline "
                          "parallelism on torch.distributed.pipelining), each step's batch flowing through them in "
                          "`gradient_accumulation_steps` micro-batches. Launched as plain processes, one a stage; "
                          "a multiple of it runs that many replicas of the pipeline, data parallel. Full fine-tuning "
                          "with SFT."},
    )
    pipeline_schedule: str = field(
        default="1f1b",
        metadata={"help": "With pipeline_parallel_size: gpipe (every micro-batch's forward, then the backwards) or "
                          "1f1b (one forward, one backward: fewer micro-batches' activations held at once)."},
    )


class PipelineParallelism(Axis):
    name = "pipeline"
    description = "the model's layers in consecutive stages, one a process, the batch flowing through in micro-batches"
    arguments = PipelineArguments
    size_key = "pipeline_parallel_size"
    runs_the_steps = True

    def check(self, sections, parallelism, strategy):
        from finetune.recipe.preflight import check_pipeline

        keys = {**sections.training_inputs, "pipeline_parallel_size": self.settings.pipeline_parallel_size,
                "pipeline_schedule": self.settings.pipeline_schedule}
        strategy = check_pipeline(keys, sections.data, sections.lora.use_lora or sections.lora.use_qlora,
                                  sections.method.name, parallelism, strategy)
        self.settings.pipeline_schedule = keys["pipeline_schedule"]  # as the loop names it
        return strategy

    def before_loading(self, recipe) -> None:
        from finetune.train.pipeline import check_shared_output_dir

        check_shared_output_dir(recipe.training.output_dir)  # every stage writes there: all ranks must see it

    def loads_shapes_only(self, recipe) -> bool:
        from finetune.train.pipeline import loads_stage_only

        return loads_stage_only(recipe.model)

    def prepare_model(self, recipe, model):
        from finetune.train.pipeline import cut_stage

        return cut_stage(recipe, model)  # this rank's stage, the only weights it reads

    def run(self, recipe, model, prepared, tokenizer, data, resume, host_load_bytes):
        from finetune.train.pipeline import train_pipeline

        return train_pipeline(recipe, model, prepared, tokenizer, data, resume, host_load_bytes=host_load_bytes)

    def plan_launch(self, recipe: str, overrides: list[str], machine, sections) -> dict | None:
        """The plan record of a self-launch (`finetune train --gpus N`): every stage estimated as the loop runs it
        (the recipe's micro-batches, rows at `max_seq_length`; the launch's processes over the stages are the
        replicas), the fullest rank's memory against this machine's GPUs and the node's host RAM at load (each rank
        reads its stage alone) against its RAM; None where the model's shape cannot be read (launched unplanned)."""
        from finetune.launch.parallelism import process_count
        from finetune.memory.shapes import model_shape
        from finetune.plan.calibration import calibration_for
        from finetune.plan.decision_tree import context_bytes, pipeline_row, usable_bytes
        from finetune.plan.from_recipe import request_from_recipe
        from finetune.plan.launch import MARGIN, predicted_per_rank
        from finetune.recipe.batch_plan import plan_from_recipe

        training = sections.training_inputs
        stages = self.size
        tensor = process_count("tensor_parallel_size", training.get("tensor_parallel_size"), "the recipe") or 1
        if machine.processes % (stages * tensor):
            each = f"{stages} × {tensor} = {stages * tensor}" if tensor > 1 else f"{stages}"
            raise RecipeError(f"`pipeline_parallel_size: {stages}` runs one stage a process"
                              f"{f' split over `tensor_parallel_size: {tensor}`' if tensor > 1 else ''}, but this "
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
                           batch.gradient_accumulation_steps, replicas=replicas, tensor=tensor)
        return {
            "strategy": "pipeline", "label": row["name"], "chosen_by": "the recipe's pipeline_parallel_size",
            "device": machine.describe(), "processes": machine.processes, "nodes": machine.nodes,
            "memory_per_gpu_gib": machine.memory_gib, "memory_source": machine.memory_source,
            "usable_bytes": int(usable_bytes(machine.memory_gib, context_bytes(request))), "margin": MARGIN,
            "micro_batch_size": batch.micro_batch_size, "fits": row["fits"], "shortfall": row["shortfall"],
            "rejected": [], "candidates": [], "predicted": predicted_per_rank(row, machine),
            "host_load_bytes_per_node": row["estimate"].host_load_bytes_per_node,
        }
