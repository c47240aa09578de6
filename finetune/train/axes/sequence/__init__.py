"""Sequence parallelism's home on the axis seam: DeepSpeed Ulysses (ALST) through Accelerate's `ParallelismConfig(
sp_backend="deepspeed")`, each sequence split over `sequence_parallel_size` ranks beside a DeepSpeed ZeRO engine. Its
recipe key and checks, its plan row, its memory term (`SequenceShare`), and at run time Trainer's `parallelism_config`,
the collator that makes batches cuttable and the gradient fix-up of ZeRO-0/1/2."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from finetune.axes import Axis
from finetune.errors import RecipeError

# why a run under Ulysses weighs each micro-batch's loss as its own token mean (effective_config.json says it)
ULYSSES_LOSS = ("sequence parallelism: DeepSpeed's Ulysses loader takes the labels out of the batch Trainer sees, "
                "so each micro-batch's loss is its own token mean")


@dataclass
class SequenceArguments:
    sequence_parallel_size: int | None = field(
        default=None,
        metadata={"help": "Split each sequence over this many processes (DeepSpeed Ulysses / ALST), for long "
                          "sequences; under a DeepSpeed config."},
    )


@dataclass(frozen=True)
class SequenceShare:
    """What a strategy and the estimator carry of sequence parallelism beside the DeepSpeed engine running it."""

    sequence_parallel_size: int

    def label(self) -> str:
        return f"sp{self.sequence_parallel_size}"

    def describe(self) -> str:
        return f"sequence parallel {self.sequence_parallel_size}"

    def record(self) -> dict[str, Any]:
        return {"sequence_parallel_size": self.sequence_parallel_size}

    def activation_share(self, setup):
        """The sequence one GPU computes activations for: each rank runs every layer on its 1/sp of the tokens; the
        attention, after its all-to-all, sees the whole sequence for 1/sp of the heads: the same bytes. ZeRO still
        shards the states over every GPU."""
        return replace(setup, sequence_length=-(-setup.sequence_length // self.sequence_parallel_size))


class SequenceParallelism(Axis):
    name = "sequence_parallel"
    description = "each sequence split over several processes (DeepSpeed Ulysses), beside a DeepSpeed ZeRO engine"
    arguments = SequenceArguments
    size_key = "sequence_parallel_size"
    accelerate_size = "sp_size"
    launched_as = "zero3"
    keeps_a_named_engine = True  # SP under a named DeepSpeed strategy runs under that one

    def layout(self) -> SequenceShare:
        return SequenceShare(self.size)

    def check(self, sections, parallelism, strategy):
        """Ulysses runs under DeepSpeed only; Trainer cannot count a step's answer tokens under it (`check_loss`)."""
        if strategy.kind != "deepspeed":
            where = "plain processes." if strategy.kind in ("ddp", "single") else f"{strategy.kind}."
            raise RecipeError(f"`sequence_parallel_size: {self.size}` runs through DeepSpeed Ulysses (ALST): launch "
                              "it under a DeepSpeed config (accelerate_configs/sequence_parallel.yaml), not " + where)
        check_loss(sections.training_inputs, sections.sources, self.size)
        others = tuple(axis for axis in strategy.beside if not isinstance(axis, SequenceShare))  # as read, once
        return replace(strategy, beside=(*others, self.layout()))

    def prepare_training(self, recipe, model) -> None:
        """Trainer's `parallelism_config` for Ulysses, running the model's own attention; and DeepSpeed's
        communication layer over the process group this rank already joined (Ulysses builds its sequence groups there
        before DeepSpeed's engine would set it up)."""
        import deepspeed
        import torch.distributed as dist

        from finetune.data.collate import attention_implementation

        recipe.training.parallelism_config = ulysses_config(self.size, recipe.parallelism.data_parallel_size,
                                                            attention_implementation(model))
        if dist.is_initialized():
            deepspeed.init_distributed(dist_backend=dist.get_backend(), auto_mpi_discovery=False)

    def collator(self, collator, tokenizer, recipe):
        """Batches Ulysses can cut into `sequence_parallel_size` equal pieces, each filled to `max_seq_length` when
        the ranks talk over gloo (one shape for every step)."""
        import torch.distributed as dist

        from finetune.data.collate import SequenceShardedCollator

        gloo = dist.is_initialized() and dist.get_backend() == "gloo"
        return SequenceShardedCollator(collator, self.size, tokenizer.pad_token_id,
                                       length=recipe.data.max_seq_length if gloo else None)

    def trainer_built(self, trainer) -> None:
        trainer.gradient_excess = gradient_excess  # ZeRO-0/1/2 apply Ulysses' gradient `sp` times

    @classmethod
    def running_size(cls, trainer) -> int:
        """As the DeepSpeed engine Trainer prepared runs it."""
        return getattr(trainer.model_wrapped, "sequence_parallel_size", 1) or 1

    @classmethod
    def plan_rows(cls, request, shape, micro_batch_size: int) -> list[dict]:
        """SP × ZeRO-3: each sequence split over the GPUs of a node; activations ÷ sp, states sharded over every GPU;
        per layer and micro-batch, all-to-alls of q, k, v and the output forward and backward."""
        from finetune.plan.decision_tree import _axis_row, _size, head_split, hidden_states_bytes

        if request.gpus < 2:
            return []
        hidden = hidden_states_bytes(request, shape, micro_batch_size)
        sequence = head_split(request, shape)
        if sequence < 2:
            return []
        options = {"strategy": "deepspeed", "zero_stage": 3, "beside": (SequenceShare(sequence),)}
        return [_axis_row(request, shape, micro_batch_size, f"SP {sequence} × ZeRO-3", cls.name, options,
                          {f"--{cls.size_key}": sequence}, "accelerate_configs/deepspeed_zero3.yaml",
                          request.gpus // sequence,
                          f"all-to-all per layer and micro-batch: ~{_size(8 * hidden / sequence)} a GPU",
                          f"SP {sequence} splits each sequence over {sequence} GPUs of a node: activations ÷ "
                          f"{sequence}")]


def check_loss(training_inputs: dict[str, Any], sources: dict[str, str], size: int) -> None:
    """Under Ulysses Trainer never counts a step's answer tokens: DeepSpeed's `UlyssesSPDataLoaderAdapter` pops the
    labels (Transformers' `deepspeed_sp_compute_loss` returns each micro-batch's token mean), so `loss_normalization:
    tokens` cannot be run. Asked for by name it is refused; by default the run takes `micro_batch_mean`, and
    effective_config.json says why."""
    if training_inputs.get("loss_normalization", "tokens") == "tokens" and "loss_normalization" in sources:
        raise RecipeError(f"`loss_normalization: tokens` with `sequence_parallel_size: {size}`: DeepSpeed's Ulysses "
                          "loader hides the labels from Trainer, which then cannot weigh every answer token of a step "
                          "the same; each micro-batch's loss is its own token mean. Set `loss_normalization: "
                          "micro_batch_mean`, or train without sequence parallelism.")
    training_inputs["loss_normalization"] = "micro_batch_mean"
    sources["loss_normalization"] = ULYSSES_LOSS


def ulysses_config(size: int, data_parallel: int, attention: str | None):
    """Accelerate's `ParallelismConfig` for DeepSpeed Ulysses over `size` ranks, running `attention` (the model's own:
    Ulysses wraps it) on sequences of any length. The other ranks are plain data parallelism to DeepSpeed
    (`dp_replicate_size`: Accelerate sizes DeepSpeed's batch by it)."""
    if attention in ("eager", "flex_attention"):
        raise RecipeError(f"`sequence_parallel_size: {size}` with `attn_implementation: {attention}`: DeepSpeed "
                          "Ulysses runs sdpa or flash attention over the whole gathered sequence (eager would need a "
                          "4D mask the size of the sequence squared); set `attn_implementation: sdpa`.")
    from accelerate.parallelism_config import ParallelismConfig
    from accelerate.utils import DeepSpeedSequenceParallelConfig

    return ParallelismConfig(sp_size=size, sp_backend="deepspeed", dp_replicate_size=data_parallel,
                             sp_handler=DeepSpeedSequenceParallelConfig(sp_seq_length_is_variable=True,
                                                                        sp_attn_implementation=attention))


def gradient_excess(trainer) -> int:
    """How many times the one-process gradient Ulysses would apply.

    Transformers' `deepspeed_sp_compute_loss` weighs the ranks' shard losses after a differentiable all-gather, whose
    backward sums each rank's gradient over the `sp` ranks of its sequence group: every rank holds `sp` × its share.
    DeepSpeed's ZeRO-0/1/2 reductions then sum over the sequence group (they divide by the data-parallel size only:
    stage_1_and_2.py, engine.py), so the update is `sp` times too large (measured at SP 2 with SGD: grad norm 19.01
    against 9.505 on one process). ZeRO-3's reduce-scatter (`reduce_scatter: true`, its default) averages over every
    rank instead, which divides the all-gather's `sp` back out: its update is right as is. Read at the first training
    step (the engine is built by then)."""
    ranks = trainer.get_sp_size()
    if ranks == 1:
        return 1
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

    optimizer = getattr(trainer.model_wrapped, "optimizer", None)
    if isinstance(optimizer, DeepSpeedZeroOptimizer_Stage3) and optimizer.reduce_scatter:
        return 1
    return ranks
