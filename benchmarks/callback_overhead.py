"""Cost of the toolkit's per-step work in `finetune train`: the same Trainer run on the tiny model with and without
it (FinetuneTrainer in place of Trainer, MemoryReportCallback, ThroughputCallback and Trainer's non-pad token count
the throughput report reads), interleaved, printed side by side as milliseconds per step and their ratio.

    python benchmarks/callback_overhead.py [--steps 200] [--repeats 5]

Time is Trainer's own `train_runtime` (the reports written at the end of training are not per-step cost). Run to
run, a shared machine varies by more than the target, so the run with the toolkit also times, directly, every call
into its callbacks and into Trainer's token count during training: that share of the runtime is the cost.
Runs on one process (CPU or GPU); the callbacks' work is per rank, so one rank shows its cost.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch
from transformers import Trainer

from finetune import presets
from finetune.memory import MemoryReportCallback
from finetune.recipe.args import FinetuneTrainingArguments
from finetune.train.throughput import ThroughputCallback
from finetune.train.trainer import FinetuneTrainer


class Stopwatch:
    """Accumulates the time spent in wrapped methods while training runs (on_train_end is excluded)."""

    def __init__(self):
        self.seconds = 0.0

    def wrap(self, owner, name: str) -> None:
        method = getattr(owner, name)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start

        setattr(owner, name, timed)


def seconds_per_step(steps: int, with_toolkit: bool, stopwatch: Stopwatch | None = None) -> float:
    tokenizer = presets.build_tokenizer()
    model = presets.build_model(tokenizer, seed=0)
    generator = torch.Generator().manual_seed(0)
    data = [{"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
            for ids in torch.randint(0, 250, (steps * 8, 64), generator=generator)]
    callbacks = [MemoryReportCallback(sequence_length=64), ThroughputCallback()]
    with tempfile.TemporaryDirectory() as output_dir:
        args = FinetuneTrainingArguments(output_dir, per_device_train_batch_size=8, max_steps=steps, report_to=[],
                                         eval_on_start=False, save_strategy="no", logging_steps=50, disable_tqdm=True,
                                         use_cpu=not torch.cuda.is_available(),
                                         include_num_input_tokens_seen="non_padding" if with_toolkit else "no")
        trainer_type = FinetuneTrainer if with_toolkit else Trainer
        trainer = trainer_type(model=model, args=args, train_dataset=data, callbacks=callbacks if with_toolkit else [])
        if stopwatch is not None:
            for callback in callbacks:
                for name in ("on_train_begin", "on_step_begin", "on_step_end", "on_log", "on_save", "on_evaluate"):
                    if hasattr(callback, name):
                        stopwatch.wrap(callback, name)
            stopwatch.wrap(trainer, "_track_num_input_tokens")
        return trainer.train().metrics["train_runtime"] / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    times, shares = {False: [], True: []}, []
    for _ in range(args.repeats):
        times[False].append(seconds_per_step(args.steps, False))
        stopwatch = Stopwatch()
        times[True].append(seconds_per_step(args.steps, True, stopwatch))
        shares.append(stopwatch.seconds / (times[True][-1] * args.steps))
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    without, with_ = statistics.median(times[False]), statistics.median(times[True])
    print(f"device: {device}; tiny model, micro-batch 8 × 64 tokens, {args.steps} steps, median of {args.repeats}")
    for label, key in (("without", False), ("with", True)):
        print(f"{label:>7} the toolkit's callbacks: {statistics.median(times[key]) * 1e3:.2f} ms/step "
              f"(runs: {', '.join(f'{t * 1e3:.2f}' for t in times[key])})")
    print(f"ratio with/without: {with_ / without:.3f}")
    print(f"time inside the toolkit's callbacks and token count: {statistics.median(shares):.2%} of the runtime "
          f"(runs: {', '.join(f'{share:.2%}' for share in shares)}; target ≤ 3%)")


if __name__ == "__main__":
    main()
