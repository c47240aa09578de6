"""Helpers for real multi-process tests: launch `accelerate launch` or `finetune` in a subprocess on a free
port with a timeout, and show the child's output when it fails."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parents[1]
OUTPUT_TAIL = 6000


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run(command: list[str], timeout: float = 600, env: dict | None = None, cwd: Path = PROJECT_ROOT):
    """Runs `command`, returning the CompletedProcess with stdout and stderr merged into `.output`."""
    child_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    try:
        result = subprocess.run(
            command, cwd=cwd, env=child_env, timeout=timeout, text=True,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        )
    except subprocess.TimeoutExpired as error:
        output = error.stdout if isinstance(error.stdout, str) else (error.stdout or b"").decode(errors="replace")
        raise AssertionError(f"timed out after {timeout}s: {' '.join(command)}\n{output[-OUTPUT_TAIL:]}") from None
    result.output = result.stdout
    return result


def finetune_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "finetune", *args]


def accelerate_launch_command(config_file: str, *args: str, num_processes: int | None = None,
                              deepspeed_json: str | None = None, program: tuple[str, ...] = ("-m", "finetune")) -> list[str]:
    """`accelerate launch --config_file CONFIG [--num_processes N] [--deepspeed_config_file JSON] --main_process_port
    PORT -m finetune ARGS` (or another `program`: a script path)."""
    command = [sys.executable, "-m", "accelerate.commands.accelerate_cli", "launch", "--config_file", config_file]
    if num_processes is not None:
        command += ["--num_processes", str(num_processes)]
    if deepspeed_json is not None:
        command += ["--deepspeed_config_file", deepspeed_json]
    return [*command, "--main_process_port", str(free_port()), *program, *args]


def assert_succeeded(result) -> None:
    if result.returncode != 0:
        raise AssertionError(
            f"exit status {result.returncode}: {' '.join(map(str, result.args))}\n{result.output[-OUTPUT_TAIL:]}"
        )


# The DeepSpeed configs a CPU-only machine can run (ZeRO-3 NVMe needs an NVMe path and the async-I/O op;
# ZeRO++ quantization kernels need CUDA), and a short demo run for tests.
CPU_RUNNABLE_DEEPSPEED = ["zero0", "zero1", "zero2", "zero2_offload", "zero3", "zero3_offload"]
DEMO_SHORT_RUN = ["--max_steps", "3", "--logging_steps", "1", "--eval_on_start", "false",
                  "--generation_eval_samples", "6"]


def launch_demo(config_file: str, output_dir, *extra: str, deepspeed_json: str | None = None, timeout: float = 600,
                env: dict | None = None, num_processes: int | None = None, program: tuple[str, ...] = ("-m", "finetune")):
    """A short 2-process run of recipes/demo.yaml under an Accelerate config, optionally with another DeepSpeed JSON,
    another process count or another program in place of `python -m finetune`."""
    command = accelerate_launch_command(config_file, "train", "recipes/demo.yaml", "--output_dir", str(output_dir),
                                        *DEMO_SHORT_RUN, *extra, num_processes=num_processes,
                                        deepspeed_json=deepspeed_json, program=program)
    return run(command, timeout=timeout, env=env)


# The Accelerate config (and DeepSpeed JSON swapped in) that runs each strategy on 2 CPU processes.
CPU_LAUNCHES = {
    "ddp": ("accelerate_configs/cpu_ddp.yaml", None),
    "zero2": ("accelerate_configs/cpu_deepspeed_zero2.yaml", None),
    "zero3": ("accelerate_configs/cpu_deepspeed_zero2.yaml", "deepspeed_configs/zero3.json"),
}
# Short LoRA runs of the demo recipe under each of CPU_LAUNCHES; a planted HF_TOKEN must land nowhere.
LORA_DEMO_RUN = ["--use_lora", "true", "--lora_r", "8", "--learning_rate", "1e-2", "--max_steps", "30",
                 "--logging_steps", "10"]
PLANTED_TOKEN = "hf_notarealtokenbutonlyfortests"
