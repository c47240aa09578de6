"""Batch-size and learning-rate planning that stays right when the GPU count changes.

Effective (global) batch = micro-batch × processes × accumulation steps. Given a target global batch,
the world size and the largest micro-batch that fits, `plan_batch` picks the largest micro-batch that
divides the per-process share exactly and accumulates the rest. The learning rate follows the
recipe's reference point `(base_learning_rate, base_batch_size)`:

- `linear`: lr = base_lr × batch / base_batch (Goyal et al. 2017, "Accurate, Large Minibatch SGD").
- `sqrt`:   lr = base_lr × sqrt(batch / base_batch) (Krizhevsky 2014, "One weird trick"; for Adam,
            Malladi et al. 2022, "On the SDEs and Scaling Rules for Adaptive Gradient Algorithms").
- `none`:   lr = base_lr.

Warmup is given in tokens (`warmup_tokens`, turned into steps here) or as a ratio of the run
(`warmup_steps` below 1, which Trainer itself reads as a fraction of the total steps).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from rich.console import Console
from rich.table import Table

from finetune import outputs
from finetune.errors import RecipeError

LR_SCALING_RULES = ("none", "linear", "sqrt")
DEFAULT_LR_SCALING = "none"  # the recipe key's default (`FinetuneTrainingArguments.lr_scaling`; a test checks)


@dataclass(frozen=True)
class BatchPlan:
    world_size: int
    micro_batch_size: int
    gradient_accumulation_steps: int
    learning_rate: float
    lr_scaling: str = "none"
    base_learning_rate: float | None = None
    base_batch_size: int | None = None
    warmup_steps: int | None = None

    @property
    def global_batch_size(self) -> int:
        return self.micro_batch_size * self.world_size * self.gradient_accumulation_steps

    @classmethod
    def running(cls, args) -> BatchPlan:
        """The batch a Trainer's arguments run with (after any plan was applied to them): what callbacks and
        checkpoint markers read, given only `TrainingArguments`."""
        return cls(micro_batch_size=args.per_device_train_batch_size, world_size=data_parallel_size(args),
                   gradient_accumulation_steps=args.gradient_accumulation_steps, learning_rate=args.learning_rate)

    def to_dict(self) -> dict:
        return {**asdict(self), "global_batch_size": self.global_batch_size}


def data_parallel_size(args) -> int:
    """Processes that see different batches under Trainer: the world size over the ranks that share one batch (a
    tensor, sequence or context parallel group: `ranks_sharing_a_batch`, set when the recipe is parsed), as Trainer's
    `get_dp_world_size` counts them."""
    return args.world_size // (getattr(args, "ranks_sharing_a_batch", None) or 1)


def _positive(name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise RecipeError(f"`{name}` must be a positive whole number, got {value!r}.")


def plan_batch(global_batch_size: int, world_size: int, max_micro_batch_size: int) -> tuple[int, int]:
    """`(micro_batch_size, gradient_accumulation_steps)` with micro × world × accumulation == target."""
    _positive("global_batch_size", global_batch_size)
    _positive("world size", world_size)
    _positive("max_micro_batch_size", max_micro_batch_size)
    if global_batch_size % world_size:
        lower = global_batch_size // world_size * world_size
        nearest = [size for size in (lower, lower + world_size) if size > 0]
        raise RecipeError(
            f"`global_batch_size: {global_batch_size}` cannot be split evenly over {world_size} processes; "
            f"nearest reachable: {' or '.join(map(str, nearest))}."
        )
    per_process = global_batch_size // world_size
    micro = max(size for size in range(1, min(per_process, max_micro_batch_size) + 1) if per_process % size == 0)
    return micro, per_process // micro


def reachable_global_batch(global_batch_size: int, world_size: int) -> int:
    """The smallest global batch ≥ `global_batch_size` that `world_size` processes split evenly: for a default
    batch, which a planner may adapt to the GPU count (a batch the user gave is split exactly or refused)."""
    _positive("global_batch_size", global_batch_size)
    _positive("world size", world_size)
    return math.ceil(global_batch_size / world_size) * world_size


def scale_learning_rate(base_learning_rate: float, base_batch_size: int, batch_size: int, rule: str) -> float:
    if rule not in LR_SCALING_RULES:
        raise RecipeError(f"`lr_scaling: {rule}` is not one of {', '.join(LR_SCALING_RULES)}.")
    if not base_learning_rate > 0:
        raise RecipeError(f"`base_learning_rate` must be positive, got {base_learning_rate!r}.")
    _positive("base_batch_size", base_batch_size)
    ratio = batch_size / base_batch_size
    return base_learning_rate * {"none": 1.0, "linear": ratio, "sqrt": math.sqrt(ratio)}[rule]


def warmup_steps_from_tokens(warmup_tokens: int, global_batch_size: int, tokens_per_sequence: int) -> int:
    """Steps covering `warmup_tokens`, counting every sequence at `tokens_per_sequence` (an upper bound)."""
    _positive("warmup_tokens", warmup_tokens)
    return math.ceil(warmup_tokens / (global_batch_size * tokens_per_sequence))


def plan_from_recipe(training: dict, max_seq_length: int, world_size: int) -> BatchPlan:
    """The plan for this launch from the recipe's training keys (as parsed, before TrainingArguments)."""
    micro, accumulation = training["per_device_train_batch_size"], training["gradient_accumulation_steps"]
    _positive("per_device_train_batch_size", micro)  # named here: the base_* keys below default to these
    _positive("gradient_accumulation_steps", accumulation)
    if not training["learning_rate"] > 0 and training.get("base_learning_rate") is None:
        raise RecipeError(f"`learning_rate` must be positive, got {training['learning_rate']!r}.")
    target = training.get("global_batch_size")
    if target is not None:
        micro, accumulation = plan_batch(target, world_size, training.get("max_micro_batch_size") or micro)
    batch = micro * world_size * accumulation
    rule = training.get("lr_scaling") or DEFAULT_LR_SCALING
    base_lr = training.get("base_learning_rate") or training["learning_rate"]
    base_batch = training.get("base_batch_size") or batch
    learning_rate = scale_learning_rate(base_lr, base_batch, batch, rule)
    warmup = None
    if training.get("warmup_tokens"):
        warmup = warmup_steps_from_tokens(training["warmup_tokens"], batch, max_seq_length)
    return BatchPlan(world_size, micro, accumulation, learning_rate, rule, base_lr, base_batch, warmup)


def write_batch_plan(plan: BatchPlan, output_dir: str) -> dict:
    """Writes `batch_plan.json`, noting a world-size change since the plan an earlier run left there."""
    record = plan.to_dict()
    previous = outputs.read_record(output_dir, outputs.BATCH_PLAN, missing=None)
    if previous is not None and previous.get("world_size") != plan.world_size:
        def compared(name: str, then, now) -> str:
            return f"{name} {now:g} kept" if then == now else f"{name} changed from {then:g} to {now:g}"

        batch = compared("global batch", previous.get("global_batch_size"), plan.global_batch_size)
        learning_rate = compared("learning rate", previous.get("learning_rate"), plan.learning_rate)
        record["note"] = (f"world size changed from {previous.get('world_size')} to {plan.world_size}: micro-batch and "
                          f"accumulation re-planned; {batch}, {learning_rate}.")
    outputs.write_record(output_dir, outputs.BATCH_PLAN, record)
    return record


def print_batch_plan(record: dict) -> None:
    table = Table(title="Batch plan")
    table.add_column("micro-batch × processes × accumulation = global batch")
    table.add_column("learning rate")
    table.add_row(
        f"{record['micro_batch_size']} × {record['world_size']} × {record['gradient_accumulation_steps']} = "
        f"{record['global_batch_size']}",
        f"{record['learning_rate']:g} ({record['lr_scaling']} from {record['base_learning_rate']:g} "
        f"at batch {record['base_batch_size']})",
    )
    console = Console()
    console.print(table)
    if "note" in record:
        console.print(record["note"])
