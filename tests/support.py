"""Test support: runs from the project root, the shared short demo run, and the launches each strategy takes on 2 CPU
processes (read from the shipped strategy table)."""

from __future__ import annotations

from pathlib import Path

from finetune import launching
from finetune.launching import OUTPUT_TAIL, accelerate_launch_command, finetune_command, free_port  # noqa: F401
from finetune.strategies import SHIPPED, SHIPPED_BY_NAME

PROJECT_ROOT = Path(__file__).resolve().parents[1]

# The DeepSpeed configs a CPU-only machine can run (ZeRO-3 NVMe needs an NVMe path and the async-I/O op;
# ZeRO++ quantization kernels need CUDA), and a short demo run for tests.
CPU_RUNNABLE_DEEPSPEED = [row.name for row in SHIPPED if row.kind == "deepspeed" and row.cpu]
DEMO_SHORT_RUN = ["--max_steps", "3", "--logging_steps", "1", "--eval_on_start", "false",
                  "--generation_eval_samples", "6"]
# The Accelerate config (and DeepSpeed JSON swapped in) that runs each strategy on 2 CPU processes.
CPU_LAUNCHES = {name: SHIPPED_BY_NAME[name].launch(cpu=True) for name in ("ddp", "zero2", "zero3")}
# FSDP2 on 2 CPU processes: the CPU FSDP config run through the test-only shim that lets Accelerate prepare FSDP
# on CPU (tests/fsdp_on_cpu.py); without it Trainer falls back to DDP, which the strategy check stops.
FSDP_ON_CPU = {"config_file": "accelerate_configs/cpu_fsdp.yaml", "program": ("tests/fsdp_on_cpu.py",)}
FSDP_SHARD_GRAD_OP_ON_CPU = {**FSDP_ON_CPU, "config_file": "accelerate_configs/cpu_fsdp_shard_grad_op.yaml"}
# Short LoRA runs of the demo recipe under each of CPU_LAUNCHES; a planted HF_TOKEN must land nowhere.
LORA_DEMO_RUN = ["--use_lora", "true", "--lora_r", "8", "--learning_rate", "1e-2", "--max_steps", "30",
                 "--logging_steps", "10"]
PLANTED_TOKEN = "hf_notarealtokenbutonlyfortests"


def run(command: list[str], timeout: float = 600, env: dict | None = None, cwd: Path = PROJECT_ROOT):
    return launching.run(command, timeout=timeout, env=env, cwd=cwd)


def assert_succeeded(result) -> None:
    if result.returncode != 0:
        raise AssertionError(
            f"exit status {result.returncode}: {' '.join(map(str, result.args))}\n{result.output[-OUTPUT_TAIL:]}"
        )


def launch_demo(config_file: str, output_dir, *extra: str, deepspeed_json: str | None = None, timeout: float = 600,
                env: dict | None = None, num_processes: int | None = None,
                program: tuple[str, ...] = ("-m", "finetune")):
    """A short 2-process run of recipes/demo.yaml under an Accelerate config, optionally with another DeepSpeed JSON,
    another process count or another program in place of `python -m finetune`."""
    command = accelerate_launch_command(config_file, "train", "recipes/demo.yaml", "--output_dir", str(output_dir),
                                        *DEMO_SHORT_RUN, *extra, num_processes=num_processes,
                                        deepspeed_json=deepspeed_json, program=program)
    return run(command, timeout=timeout, env=env)
