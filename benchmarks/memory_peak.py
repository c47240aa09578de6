"""Predicted vs measured peak GPU memory per strategy, for the tiny model and a random-init Qwen2.5-0.5B shape.

    python benchmarks/memory_peak.py [--models tiny qwen2.5-0.5b] [--gpus 1] [--seq-len 512] [--micro-batch 4]

Each configuration runs as its own `torchrun` job (a few bf16 steps of Trainer on fixed-length random tokens,
with MemoryReportCallback); the table prints measured / predicted for model states and for the peak
(`torch.cuda.max_memory_allocated`). Needs CUDA for the peak; on CPU the model-state columns still compare.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from finetune.strategies import SHIPPED

# One process without DeepSpeed, and every shipped DeepSpeed config that runs without NVMe or CUDA-only kernels.
STRATEGIES = ["single", *(row.name for row in SHIPPED if row.kind == "deepspeed" and row.cpu)]


def worker(args) -> None:
    import torch
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

    from finetune.memory import MemoryReportCallback
    from finetune.memory.shapes import resolve_config
    from finetune.strategies import SHIPPED_BY_NAME

    cuda = torch.cuda.is_available()
    deepspeed = SHIPPED_BY_NAME[args.strategy].deepspeed_json()
    config = resolve_config(args.model)
    model = AutoModelForCausalLM.from_config(config)
    tokens = torch.randint(0, min(config.vocab_size, 30000), (args.steps * args.micro_batch * 4, args.seq_len),
                           generator=torch.Generator().manual_seed(0))
    data = [{"input_ids": ids, "labels": ids} for ids in tokens]
    training = TrainingArguments(args.output_dir, per_device_train_batch_size=args.micro_batch, max_steps=args.steps,
                                 bf16=cuda, deepspeed=deepspeed, report_to=[], save_strategy="no", logging_steps=1,
                                 disable_tqdm=True, use_cpu=not cuda)
    Trainer(model=model, args=training, train_dataset=data,
            callbacks=[MemoryReportCallback(sequence_length=args.seq_len)]).train()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["tiny", "qwen2.5-0.5b"])
    parser.add_argument("--strategies", nargs="+", default=STRATEGIES, choices=STRATEGIES)
    parser.add_argument("--gpus", type=int, default=1)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--strategy", help=argparse.SUPPRESS)
    parser.add_argument("--output-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    print("| model | strategy | GPUs | states predicted MiB | states measured / predicted | peak predicted MiB "
          "| peak measured MiB | peak measured / predicted |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for model in args.models:
        for strategy in args.strategies:
            if strategy == "single" and args.gpus > 1:
                continue
            with tempfile.TemporaryDirectory() as output_dir:
                command = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={args.gpus}",
                           __file__, "--worker", "--model", model, "--strategy", strategy, "--output-dir", output_dir,
                           "--seq-len", str(args.seq_len), "--micro-batch", str(args.micro_batch),
                           "--steps", str(args.steps)]
                result = subprocess.run(command, capture_output=True, text=True)
                report = Path(output_dir, "memory_report.json")
                if result.returncode != 0 or not report.is_file():
                    print(f"| {model} | {strategy} | {args.gpus} | failed: {result.stderr.strip().splitlines()[-1:]} |")
                    continue
                record = json.loads(report.read_text())["ranks"][0]
            measured, predicted = record["measured"], record["predicted"]
            keys = ("params_bytes", "grads_bytes", "optimizer_bytes")
            states_predicted = sum(predicted[k] for k in keys)
            states_measured = sum(measured[k] for k in keys)
            mib = 1024**2
            print(f"| {model} | {strategy} | {args.gpus} | {states_predicted / mib:,.1f} | "
                  f"{states_measured / states_predicted:.3f} | {predicted['peak_bytes'] / mib:,.1f} | "
                  f"{measured['peak_bytes'] / mib:,.1f} ({measured['peak_kind']}) | "
                  f"{measured['peak_bytes'] / predicted['peak_bytes']:.3f} |", flush=True)


if __name__ == "__main__":
    main()
