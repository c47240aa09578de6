"""Cost of MemoryReportCallback: the same short Trainer run on the tiny model with and without the callback,
interleaved, printed side by side as seconds per step and their ratio.

    python benchmarks/memory_callback_overhead.py [--steps 200] [--repeats 3]

Runs on one process (CPU or GPU); the callback's work is per rank, so one rank shows its cost.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch
from transformers import Trainer, TrainingArguments

from finetune import presets
from finetune.memory import MemoryReportCallback


def run(steps: int, with_callback: bool) -> float:
    tokenizer = presets.build_tokenizer()
    model = presets.build_model(tokenizer, seed=0)
    generator = torch.Generator().manual_seed(0)
    data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 250, (steps * 8, 64), generator=generator)]
    callbacks = [MemoryReportCallback(sequence_length=64)] if with_callback else []
    with tempfile.TemporaryDirectory() as output_dir:
        args = TrainingArguments(output_dir, per_device_train_batch_size=8, max_steps=steps, report_to=[],
                                 save_strategy="no", logging_steps=steps, disable_tqdm=True,
                                 use_cpu=not torch.cuda.is_available())
        trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=callbacks)
        start = time.perf_counter()
        trainer.train()
        return (time.perf_counter() - start) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    times = {False: [], True: []}
    for _ in range(args.repeats):
        for with_callback in (False, True):
            times[with_callback].append(run(args.steps, with_callback))
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    without, with_ = statistics.median(times[False]), statistics.median(times[True])
    print(f"device: {device}; tiny model, micro-batch 8 × 64 tokens, {args.steps} steps, median of {args.repeats}")
    print(f"without callback: {without * 1e3:.2f} ms/step; with: {with_ * 1e3:.2f} ms/step; "
          f"ratio with/without: {with_ / without:.3f}")


if __name__ == "__main__":
    main()
