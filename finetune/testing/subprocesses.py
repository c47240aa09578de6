"""Starting `finetune` and `accelerate launch` in subprocesses, as the tests and the bench do: a timeout, and the
child's output kept (stdout and stderr merged) to show when it fails."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from finetune.errors import ChildTimedOut

OUTPUT_TAIL = 6000  # characters of a child's output shown when it fails


def child_environment(env: dict | None = None) -> dict[str, str]:
    """A child's environment: this process's, unbuffered output, and `env` over it."""
    return {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}


def run(command: list[str], timeout: float = 600, env: dict | None = None, cwd: str | Path | None = None):
    """Runs `command`, returning the CompletedProcess with stdout and stderr merged into `.output`; a timeout is a
    `ChildTimedOut` with the output so far."""
    child_env = child_environment(env)
    try:
        result = subprocess.run(
            command, cwd=cwd, env=child_env, timeout=timeout, text=True,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        )
    except subprocess.TimeoutExpired as error:
        output = error.stdout if isinstance(error.stdout, str) else (error.stdout or b"").decode(errors="replace")
        raise ChildTimedOut(f"timed out after {timeout}s: {' '.join(command)}\n{output[-OUTPUT_TAIL:]}") from None
    result.output = result.stdout
    return result
