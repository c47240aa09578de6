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


def accelerate_launch_command(config_file: str, *args: str, num_processes: int | None = None) -> list[str]:
    """`accelerate launch --config_file CONFIG [--num_processes N] --main_process_port PORT -m finetune ARGS`."""
    command = [sys.executable, "-m", "accelerate.commands.accelerate_cli", "launch", "--config_file", config_file]
    if num_processes is not None:
        command += ["--num_processes", str(num_processes)]
    return [*command, "--main_process_port", str(free_port()), "-m", "finetune", *args]


def assert_succeeded(result) -> None:
    if result.returncode != 0:
        raise AssertionError(
            f"exit status {result.returncode}: {' '.join(map(str, result.args))}\n{result.output[-OUTPUT_TAIL:]}"
        )
