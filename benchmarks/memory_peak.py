"""Predicted vs measured peak GPU memory per strategy, for the tiny model and a random-init Qwen2.5-0.5B shape.

    python benchmarks/memory_peak.py [--models tiny qwen2.5-0.5b] [--gpus 1 2] [--seq-len 512] [--micro-batch 4]
                                     [--accumulation 2]

Each configuration runs as its own `torchrun` job (a few bf16 steps of Trainer on fixed-length random tokens,
with MemoryReportCallback): one process, DDP, FSDP2 full shard and shard-grad-op, and every CPU-runnable shipped
DeepSpeed config. The table prints measured / predicted for model states and for the peak
(`torch.cuda.max_memory_allocated`), the peak the caching allocator reserved (`max_memory_reserved`, what
`nvidia-smi` and an out-of-memory error see), and whether the peak is within the 15% target. The table and every
rank's record go to benchmarks/results/memory-peak-<device>.json, the device named. Needs CUDA for the peak; on CPU
the model-state columns still compare (the peak is the process's RSS there, not comparable; FSDP runs through
finetune.testing.fsdp_on_cpu).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from finetune.launch.strategies import SHIPPED

# One process, DDP, FSDP2, and every shipped DeepSpeed config that runs without NVMe or CUDA-only kernels.
STRATEGIES = ["single", "ddp", "fsdp_full_shard", "fsdp_shard_grad_op",
              *(row.name for row in SHIPPED if row.kind == "deepspeed" and row.cpu and not row.parallelism)]


def worker(args) -> None:
    import torch
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

    from finetune.launch.strategies import SHIPPED_BY_NAME
    from finetune.memory import MemoryReportCallback
    from finetune.memory.shapes import resolve_config

    cuda = torch.cuda.is_available()
    row = SHIPPED_BY_NAME[args.strategy]
    deepspeed, fsdp = row.deepspeed_json(), {}
    if row.kind == "fsdp":  # FSDP2, sharded as the shipped config says (Trainer turns these into Accelerate's plugin)
        if not cuda:
            import finetune.testing.fsdp_on_cpu  # noqa: F401  (Accelerate prepares FSDP for GPUs only)
        fsdp = {"fsdp": row.fsdp_sharding, "fsdp_config": {"version": 2, "auto_wrap_policy": "TRANSFORMER_BASED_WRAP"}}
    config = resolve_config(args.model)
    model = AutoModelForCausalLM.from_config(config)
    tokens = torch.randint(0, min(config.vocab_size, 30000), (args.steps * args.micro_batch * 4, args.seq_len),
                           generator=torch.Generator().manual_seed(0))
    data = [{"input_ids": ids, "labels": ids} for ids in tokens]
    training = TrainingArguments(args.output_dir, per_device_train_batch_size=args.micro_batch, max_steps=args.steps,
                                 gradient_accumulation_steps=args.accumulation, bf16=cuda, deepspeed=deepspeed,
                                 report_to=[], save_strategy="no", logging_steps=1,
                                 disable_tqdm=True, use_cpu=not cuda, **fsdp)
    Trainer(model=model, args=training, train_dataset=data,
            callbacks=[MemoryReportCallback(sequence_length=args.seq_len)]).train()


def main() -> None:
    import re
    from datetime import date

    import torch

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["tiny", "qwen2.5-0.5b"])
    parser.add_argument("--strategies", nargs="+", default=STRATEGIES, choices=STRATEGIES)
    parser.add_argument("--gpus", type=int, nargs="+", default=[1, 2], help="process counts to run (at most visible)")
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--accumulation", type=int, default=1, help="gradient accumulation steps")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--strategy", help=argparse.SUPPRESS)
    parser.add_argument("--output-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    cuda = torch.cuda.is_available()
    device = torch.cuda.get_device_name() if cuda else f"cpu-{os.cpu_count()}-cores"
    visible = torch.cuda.device_count() if cuda else 2
    rows = []
    print(f"{device}, {date.today().isoformat()}")
    print("| model | strategy | GPUs | states predicted MiB | states measured / predicted | peak predicted MiB "
          "| peak measured MiB | peak measured / predicted | reserved MiB | within 15% |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---|")
    for gpus in (count for count in args.gpus if count <= visible):
        for model in args.models:
            for strategy in args.strategies:
                if (strategy == "single") != (gpus == 1):  # one process is `single`; the others need several
                    continue
                row = run_one(args, model, strategy, gpus)
                rows.append(row)
                print(format_row(row, cuda), flush=True)
    name = re.sub(r"[^a-z0-9]+", "-", device.lower()).strip("-")
    path = Path(__file__).resolve().parent / "results" / f"memory-peak-{name}.json"
    path.write_text(json.dumps({"date": date.today().isoformat(), "device": device, "seq_len": args.seq_len,
                                "micro_batch": args.micro_batch, "accumulation": args.accumulation, "rows": rows},
                               indent=1) + "\n")
    print(f"wrote {path}")


def run_one(args, model: str, strategy: str, gpus: int) -> dict:
    """One torchrun job; its rank-0 record, or the error it ended with."""
    with tempfile.TemporaryDirectory() as output_dir:
        command = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={gpus}", __file__, "--worker",
                   "--model", model, "--strategy", strategy, "--output-dir", output_dir, "--seq-len", str(args.seq_len),
                   "--micro-batch", str(args.micro_batch), "--steps", str(args.steps),
                   "--accumulation", str(args.accumulation)]
        result = subprocess.run(command, capture_output=True, text=True)
        report = Path(output_dir, "memory_report.json")
        row = {"model": model, "strategy": strategy, "gpus": gpus}
        if result.returncode != 0 or not report.is_file():
            return {**row, "error": (result.stderr.strip().splitlines() or ["no output"])[-1][:400]}
        record = json.loads(report.read_text())["ranks"][0]
    return {**row, "measured": record["measured"], "predicted": record["predicted"]}


def format_row(row: dict, cuda: bool) -> str:
    head = f"| {row['model']} | {row['strategy']} | {row['gpus']} |"
    if "error" in row:
        return f"{head} failed: {row['error']} |"
    measured, predicted = row["measured"], row["predicted"]
    keys = ("params_bytes", "grads_bytes", "optimizer_bytes")
    states_predicted = sum(predicted[k] for k in keys)
    ratio = measured["peak_bytes"] / predicted["peak_bytes"]
    mib = 1024**2
    within = ("yes" if abs(ratio - 1) <= 0.15 else "no") if cuda else "– (CPU RSS)"
    reserved = measured.get("peak_reserved_bytes")
    return (f"{head} {states_predicted / mib:,.1f} | {sum(measured[k] for k in keys) / states_predicted:.3f} | "
            f"{predicted['peak_bytes'] / mib:,.1f} | {measured['peak_bytes'] / mib:,.1f} ({measured['peak_kind']}) | "
            f"{ratio:.3f} | {'–' if reserved is None else f'{reserved / mib:,.1f}'} | {within} |")


if __name__ == "__main__":
    main()
