"""Context parallelism's home on the axis seam: PyTorch's ring attention through Accelerate's `ParallelismConfig`
(`cp_size`, under FSDP2), each sequence's attention split over `context_parallel_size` GPUs. GPUs only: it has no CPU
kernel, so a launch on CPU processes is refused before anything else."""

from __future__ import annotations

from dataclasses import dataclass, field

from finetune.axes import Axis
from finetune.errors import RecipeError

ON_CPU = ("`context_parallel_size` needs GPUs: PyTorch's ring attention (context parallelism) has no CPU kernel. On "
          "CPU processes split long sequences with sequence parallelism (DeepSpeed Ulysses) instead.")


@dataclass
class ContextArguments:
    context_parallel_size: int | None = field(
        default=None,
        metadata={"help": "Split each sequence's attention over this many GPUs (PyTorch ring attention, FSDP2); GPUs "
                          "only: refused on CPU processes."},
    )


class ContextParallelism(Axis):
    name = "context_parallel"
    description = "each sequence's attention split over several GPUs (PyTorch ring attention, under FSDP2)"
    arguments = ContextArguments
    size_key = "context_parallel_size"
    accelerate_size = "cp_size"

    @classmethod
    def refusal_here(cls, size: int, on_gpu: bool) -> str | None:
        return None if on_gpu else ON_CPU

    def check(self, sections, parallelism, strategy):
        """Ring attention runs full causal attention: it drops the attention mask and the position ids that keep
        packed (or padding-free) documents apart, so each document would attend to the ones before it in its row.
        TRL's SFTTrainer refuses packing under `cp_size > 1` for the same reason."""
        for key in ("packing", "padding_free"):
            if getattr(sections.data, key):
                raise RecipeError(f"`{key}: true` with `context_parallel_size: {self.size}`: context parallelism "
                                  "drops the attention mask that keeps the documents of a row apart, so they would "
                                  f"attend across their boundaries; set `{key}: false`, or train without "
                                  "`context_parallel_size`.")
        return strategy
