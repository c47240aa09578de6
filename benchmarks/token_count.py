"""The token count's cost on 2 processes: Trainer's (a gather and a `.item()` every micro-step) against the toolkit's
(each rank counts on its device; one all-reduce when a log or a save reads the count), interleaved, side by side.

    python benchmarks/token_count.py [--steps 100] [--accumulation 4] [--repeats 3]

Starts itself under `torchrun --nproc_per_node 2` (gloo on CPU, NCCL on 2 GPUs). Each rank trains the tiny model
with FinetuneTrainer both ways; rank 0 prints the milliseconds a step (Trainer's `train_runtime`), the collectives
the count made per micro-step (counted, not assumed), the counts themselves (they must agree) and the ratio.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile

import torch
import torch.distributed as dist
from transformers import Trainer

from finetune import presets
from finetune.recipe.args import FinetuneTrainingArguments
from finetune.train.trainer import FinetuneTrainer


class PerMicroStepCount(FinetuneTrainer):
    """Trainer's own count: gathered over ranks and read back on the host at every micro-step."""

    _track_num_input_tokens = Trainer._track_num_input_tokens

    def _sum_tokens_seen(self) -> None:
        pass


def train(trainer_type: type, steps: int, accumulation: int) -> tuple[float, int, int]:
    """Seconds a step, the token count, and the collectives the count made."""
    tokenizer = presets.build_tokenizer()
    model = presets.build_model(tokenizer, seed=0)
    generator = torch.Generator().manual_seed(dist.get_rank())
    rows = steps * accumulation * 8
    lengths = torch.randint(16, 65, (rows,), generator=generator)
    data = [{"input_ids": ids, "attention_mask": (torch.arange(64) < length).long(), "labels": ids}
            for ids, length in zip(torch.randint(3, 250, (rows, 64), generator=generator), lengths)]
    with tempfile.TemporaryDirectory() as output_dir:
        args = FinetuneTrainingArguments(output_dir, per_device_train_batch_size=8,
                                         gradient_accumulation_steps=accumulation, max_steps=steps, report_to=[],
                                         save_strategy="no", logging_steps=25, disable_tqdm=True,
                                         include_num_input_tokens_seen="non_padding",
                                         use_cpu=not torch.cuda.is_available(), dataloader_drop_last=True)
        trainer = trainer_type(model=model, args=args, train_dataset=data)
        collectives, counting = {"count": 0}, {"now": False}
        for name in ("gather", "reduce"):  # the collectives made while the token count runs, and only those
            original = getattr(trainer.accelerator, name)

            def counted(*arguments, original=original, **kwargs):
                collectives["count"] += counting["now"]
                return original(*arguments, **kwargs)
            setattr(trainer.accelerator, name, counted)
        for name in ("_track_num_input_tokens", "_sum_tokens_seen"):
            method = getattr(trainer, name)

            def flagged(*arguments, method=method, **kwargs):
                counting["now"] = True
                try:
                    return method(*arguments, **kwargs)
                finally:
                    counting["now"] = False
            setattr(trainer, name, flagged)
        runtime = trainer.train().metrics["train_runtime"]
        return runtime / steps, trainer.state.num_input_tokens_seen, collectives["count"]


def worker(args) -> None:
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    results = {"per micro-step (Trainer's)": [], "summed at logs (finetune's)": []}
    for _ in range(args.repeats):
        for label, trainer_type in zip(results, (PerMicroStepCount, FinetuneTrainer)):
            results[label].append(train(trainer_type, args.steps, args.accumulation))
    if dist.get_rank() == 0:
        device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU, gloo"
        micro_steps = args.steps * args.accumulation
        print(f"device: {device}; 2 processes, tiny model, {args.steps} steps × {args.accumulation} micro-batches of "
              f"8 × ≤64 tokens, logs every 25 steps, median of {args.repeats}, interleaved")
        medians = {}
        for label, runs in results.items():
            medians[label] = statistics.median(seconds for seconds, _, _ in runs)
            tokens, collectives = runs[0][1], runs[0][2]
            print(f"{label:>28}: {medians[label] * 1e3:7.2f} ms/step (runs: "
                  f"{', '.join(f'{seconds * 1e3:.2f}' for seconds, _, _ in runs)}); "
                  f"the count's collectives: {collectives} for {micro_steps} micro-steps; {tokens:,} tokens counted")
        slow, fast = medians.values()
        print(f"ratio finetune's / Trainer's step time: {fast / slow:.3f}")
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--accumulation", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", __file__, "--worker",
               "--steps", str(args.steps), "--accumulation", str(args.accumulation), "--repeats", str(args.repeats)]
    sys.exit(subprocess.run(command, env={"OMP_NUM_THREADS": "1", **os.environ}).returncode)


if __name__ == "__main__":
    main()
