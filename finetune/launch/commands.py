"""The commands that launch a strategy: `accelerate launch` with its config (and a DeepSpeed JSON swapped in), a free
port for each launch, and `python -m finetune`. Accelerate's launcher runs as `-m finetune.launch.accelerate_launch`
(the same launcher, ending on a signal without a traceback) and is shown as `accelerate launch`."""

from __future__ import annotations

import socket
import sys
from typing import NamedTuple


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def finetune_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "finetune", *args]


FINETUNE = ("-m", "finetune")
ACCELERATE_LAUNCH = ("-m", "finetune.launch.accelerate_launch")  # `accelerate launch`, run by finetune.launch


class Launch(NamedTuple):
    """How a strategy is launched: an Accelerate config, a DeepSpeed JSON swapped in or None, and the program."""

    config_file: str
    deepspeed_json: str | None = None
    program: tuple[str, ...] = FINETUNE

    def command(self, *args: str, num_processes: int | None = None, options: tuple[str, ...] = ()) -> list[str]:
        """`options`: `accelerate launch` options beside the config file (`--mixed_precision fp16`)."""
        return accelerate_launch_command(self.config_file, *args, num_processes=num_processes,
                                         deepspeed_json=self.deepspeed_json, program=self.program, options=options)


def accelerate_launch_command(config_file: str, *args: str, num_processes: int | None = None,
                              deepspeed_json: str | None = None, program: tuple[str, ...] = FINETUNE,
                              options: tuple[str, ...] = (), main_process_port: int | None = None) -> list[str]:
    """`accelerate launch --config_file CONFIG [--num_processes N] [--deepspeed_config_file JSON] [OPTIONS]
    --main_process_port PORT -m finetune ARGS` (or another `program`: a script path); a free port unless given."""
    command = [sys.executable, *ACCELERATE_LAUNCH, "--config_file", config_file]
    if num_processes is not None:
        command += ["--num_processes", str(num_processes)]
    if deepspeed_json is not None:
        command += ["--deepspeed_config_file", deepspeed_json]
    port = free_port() if main_process_port is None else main_process_port
    return [*command, *options, "--main_process_port", str(port), *program, *args]


def as_typed(command: list[str], environment: dict[str, str] | None = None) -> str:
    """A launch command as a user types it: `accelerate launch ...`, not this interpreter's `-m accelerate...`, after
    the variables `environment` adds (`NAME=value ...`)."""
    import shlex

    if tuple(command[1:3]) == ACCELERATE_LAUNCH:
        command = ["accelerate", "launch", *command[3:]]
    return shlex.join([*(f"{name}={value}" for name, value in (environment or {}).items()), *command])
