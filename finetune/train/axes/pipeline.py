"""Pipeline parallelism's home on the axis seam: its recipe keys and checks, and at run time the stage each rank
holds and the loop that trains it (finetune.train.pipeline: neither Trainer nor Accelerate drive a pipeline)."""

from __future__ import annotations

from dataclasses import dataclass, field

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
