"""Starting `finetune` and `accelerate launch` in subprocesses, as the bench (and the tests) do: a free port for each
launch, a timeout, and the child's output kept (stdout and stderr merged) to show when it fails."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

OUTPUT_TAIL = 6000  # characters of a child's output shown when it fails


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run(command: list[str], timeout: float = 600, env: dict | None = None, cwd: str | Path | None = None):
    """Runs `command`, returning the CompletedProcess with stdout and stderr merged into `.output`; a timeout is an
    AssertionError with the output so far."""
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


FINETUNE = ("-m", "finetune")


class Launch(NamedTuple):
    """How a strategy is launched: an Accelerate config, a DeepSpeed JSON swapped in or None, and the program."""

    config_file: str
    deepspeed_json: str | None = None
    program: tuple[str, ...] = FINETUNE

    def command(self, *args: str, num_processes: int | None = None) -> list[str]:
        return accelerate_launch_command(self.config_file, *args, num_processes=num_processes,
                                         deepspeed_json=self.deepspeed_json, program=self.program)


def accelerate_launch_command(config_file: str, *args: str, num_processes: int | None = None,
                              deepspeed_json: str | None = None, program: tuple[str, ...] = FINETUNE) -> list[str]:
    """`accelerate launch --config_file CONFIG [--num_processes N] [--deepspeed_config_file JSON] --main_process_port
    PORT -m finetune ARGS` (or another `program`: a script path)."""
    command = [sys.executable, "-m", "accelerate.commands.accelerate_cli", "launch", "--config_file", config_file]
    if num_processes is not None:
        command += ["--num_processes", str(num_processes)]
    if deepspeed_json is not None:
        command += ["--deepspeed_config_file", deepspeed_json]
    return [*command, "--main_process_port", str(free_port()), *program, *args]
