"""Runs the benchmark variants one after another on the same model, data and sequence length, each in its own
process(es), and reads every result the same way: non-pad tokens seen ÷ Trainer's `train_runtime`.

On CPU one process stands for one GPU: single-process runs get one thread, as torchrun gives each rank.
"""

from __future__ import annotations

import json
import os
import platform
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from finetune import outputs
from finetune.launch.commands import finetune_command
from finetune.launch.strategies import SHIPPED, SHIPPED_BY_NAME
from finetune.testing.subprocesses import run

# The strategies the bench compares: every shipped one that also runs on CPU processes, launched as the table says.
STRATEGY_VARIANTS = [row.name for row in SHIPPED if row.cpu]


@dataclass
class Variant:
    name: str
    what: str
    processes: int = 1
    launch: str | None = None  # a shipped strategy (finetune.launch.strategies.SHIPPED)
    extra: list[str] = field(default_factory=list)
    plain: bool = False
    peer: bool = False  # TRL's SFTTrainer (finetune.bench.trl_sft), run with `finetune bench --peers`
    needs_cuda: str | None = None  # why it cannot run without CUDA
    repeats: int = 1  # the median run is kept: the baseline and the callback-overhead pair are compared closely


def variants(processes: int) -> list[Variant]:
    """The plain baseline, the toolkit's defaults (with and without its callbacks, and with the full logits),
    packing (eager and compiled), the peer (TRL's SFTTrainer, padded and packed), fused kernels, then every strategy
    on `processes` processes."""
    single = [
        Variant("plain_trainer", "plain Hugging Face Trainer, padded batches (the baseline)", plain=True, repeats=3),
        Variant("finetune", "finetune train defaults", repeats=3),
        Variant("finetune_no_callbacks", "same, memory and throughput reports off (callback overhead)",
                extra=["--memory_report", "false", "--throughput_report", "false"], repeats=3),
        Variant("finetune_full_logits", "same, the loss from the full logits (`fused_lm_head: false`)",
                extra=["--fused_lm_head", "false"]),
        Variant("packing", "finetune train, packed rows", extra=["--packing", "true"]),
        Variant("compile", "finetune train, packed rows, torch.compile (inductor)",
                extra=["--packing", "true", "--torch_compile", "true"]),
        Variant("trl_sft", "TRL SFTTrainer, padded batches (its fused LM head)", peer=True, repeats=3),
        Variant("trl_sft_packed", "TRL SFTTrainer, packed rows", peer=True, extra=["--packing"]),
        Variant("liger", "finetune train, packed rows, Liger fused kernels",
                extra=["--packing", "true", "--use_liger_kernel", "true"],
                needs_cuda="Liger kernels are Triton (CUDA)"),
    ]
    strategies = [Variant(name, f"{name} on {processes} processes", processes=processes, launch=name)
                  for name in STRATEGY_VARIANTS]
    return single + strategies


def long_tailed_file(path: Path, examples: int, max_length: int, seed: int = 0) -> Path:
    """Instruction-like lengths (log-normal, median ~55 tokens, long tail): an echo task in lowercase letters."""
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(mean=4.0, sigma=0.8, size=examples), 8, max_length - 8).astype(int)
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
    with path.open("w") as out:
        for length in lengths:
            text = "".join(rng.choice(letters, size=int(length) // 2))
            out.write(json.dumps({"instruction": "echo", "input": text, "output": text}) + "\n")
    return path


def random_init_model_dir(name: str, directory: Path) -> str:
    """`tiny`, or a random-init model of a known shape (e.g. llama-3.2-1b) saved with the tiny tokenizer."""
    if name == "tiny":
        return name
    import torch
    from transformers import AutoModelForCausalLM

    from finetune import presets
    from finetune.memory.shapes import resolve_config

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(resolve_config(name), dtype=torch.bfloat16)
    model.save_pretrained(directory)
    presets.build_tokenizer().save_pretrained(directory)
    return str(directory)


@dataclass
class Settings:
    model: str
    train_file: Path
    max_seq_length: int
    micro_batch: int
    steps: int
    bf16: bool
    cuda: bool


def command(variant: Variant, settings: Settings, output_dir: Path) -> list[str]:
    if variant.plain or variant.peer:
        program = "finetune.bench.plain_trainer" if variant.plain else "finetune.bench.trl_sft"
        return [sys.executable, "-m", program, "--model_dir", settings.model,
                "--train_file", str(settings.train_file), "--output_dir", str(output_dir),
                "--max_seq_length", str(settings.max_seq_length), "--per_device_train_batch_size",
                str(settings.micro_batch), "--max_steps", str(settings.steps), *(["--bf16"] if settings.bf16 else []),
                *variant.extra]
    args = ["train", "recipes/demo.yaml", "--model_name_or_path", settings.model, "--train_file",
            str(settings.train_file), "--output_dir", str(output_dir), "--max_seq_length", str(settings.max_seq_length),
            "--per_device_train_batch_size", str(settings.micro_batch), "--gradient_accumulation_steps", "1",
            "--max_steps", str(settings.steps), "--learning_rate", "2e-4", "--warmup_steps", "0",
            "--logging_steps", "10", "--save_strategy", "no", "--eval_strategy", "no", "--eval_on_start", "false",
            "--generation_eval_samples", "0", "--bf16", str(settings.bf16).lower(), *variant.extra]
    if variant.launch is None:  # one plain process, as the baselines run (the demo recipe names zero2)
        return finetune_command(*args, "--strategy", "single")
    return SHIPPED_BY_NAME[variant.launch].launch(cpu=not settings.cuda).command(*args, num_processes=variant.processes)


def last_window(history: list[dict]) -> dict:
    """The last log entry the throughput callback measured a window in: past torch.compile's first compile and its
    recompiles ({} where none was logged)."""
    return next((entry for entry in reversed(history) if "throughput/tokens_per_second" in entry), {})


def read_result(output_dir: Path) -> dict:
    """Useful tokens/s from Trainer's own count and runtime; peak memory and MFU where the run measured them."""
    history = json.loads((output_dir / "trainer_state.json").read_text())["log_history"]
    final = next(entry for entry in reversed(history) if "train_runtime" in entry and "train_loss" in entry)
    result = {"tokens": final["num_input_tokens_seen"], "train_runtime": final["train_runtime"],
              "tokens_per_second": final["num_input_tokens_seen"] / final["train_runtime"],
              "train_loss": final["train_loss"], "peak_bytes": None, "mfu": None}
    peak = outputs.read_record(output_dir, outputs.PEAK_MEMORY, missing={}).get("peak_bytes")
    memory = outputs.read_record(output_dir, outputs.MEMORY_REPORT, missing=None)
    if memory is not None:
        peak = max((rank["measured"] or {}).get("peak_bytes", 0) for rank in memory["ranks"])
    result["peak_bytes"] = peak
    result["mfu"] = outputs.read_record(output_dir, outputs.THROUGHPUT, missing={}).get("mfu")
    result["steady_tokens_per_second"] = last_window(history).get("throughput/tokens_per_second")
    compiled = outputs.read_record(output_dir, outputs.COMPILE, missing=None)
    if compiled is not None:
        result["compile"] = compiled
    return result


def run_once(variant: Variant, settings: Settings, output_dir: Path, timeout: float = 900) -> dict:
    """One run of the variant: its result, or why it failed."""
    env = {} if settings.cuda or variant.processes > 1 else {"OMP_NUM_THREADS": "1"}
    started = time.perf_counter()
    result = run(command(variant, settings, output_dir), timeout=timeout, env=env)
    if result.returncode != 0:
        errors = [line for line in result.output.splitlines() if "error" in line.lower()]
        return {"failed": (errors or result.output.splitlines() or ["no output"])[-1][:300]}
    return {**read_result(output_dir), "wall_seconds": round(time.perf_counter() - started, 1)}


def run_variants(chosen: list[Variant], settings: Settings, scratch: Path, report=print) -> dict[str, dict]:
    """Runs every variant once, then the repeats in rounds, so variants compared over repeats alternate and share
    the machine's drift; keeps each variant's median run by tokens/s."""
    runs: dict[str, list[dict]] = {variant.name: [] for variant in chosen}
    skipped = {variant.name: f"{variant.needs_cuda}; no CUDA here" for variant in chosen
               if variant.needs_cuda and not settings.cuda}
    for round_ in range(max(variant.repeats for variant in chosen)):
        for variant in chosen:
            if variant.name in skipped or round_ >= variant.repeats or any("failed" in r for r in runs[variant.name]):
                continue
            report(f"running {variant.name} ({round_ + 1}/{variant.repeats}): {variant.what}")
            runs[variant.name].append(run_once(variant, settings, scratch / variant.name / str(round_)))
    rows = {}
    for variant in chosen:
        base = {"what": variant.what, "processes": variant.processes}
        done = runs[variant.name]
        if variant.name in skipped or any("failed" in r for r in done):
            rows[variant.name] = {**base, **({"skipped": skipped[variant.name]} if variant.name in skipped
                                             else next(r for r in done if "failed" in r))}
            continue
        done.sort(key=lambda measured: measured["tokens_per_second"])
        repeats = [round(r["tokens_per_second"], 1) for r in done]
        rows[variant.name] = {**base, **done[len(done) // 2], "repeats": repeats}
    return rows


def device_label(cuda: bool) -> str:
    if cuda:
        import torch

        return re.sub(r"[^a-z0-9]+", "-", torch.cuda.get_device_name().lower()).strip("-")
    return f"cpu-{os.cpu_count()}-cores-{platform.machine()}"
