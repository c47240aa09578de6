"""Test support: runs from the project root, the shared short demo run, and the launches each strategy takes on 2 CPU
processes (read from the shipped strategy table)."""

from __future__ import annotations

import atexit
import os
from pathlib import Path

from finetune.launch.commands import Launch, accelerate_launch_command, finetune_command, free_port  # noqa: F401
from finetune.launch.strategies import SHIPPED, SHIPPED_BY_NAME
from finetune.memory import model_shape
from finetune.testing import subprocesses
from finetune.testing.subprocesses import OUTPUT_TAIL  # noqa: F401
from finetune.testing.warm_launch import WarmLauncher

REAL_LAUNCHES = "FINETUNE_TESTS_REAL_LAUNCHES"

PROJECT_ROOT = Path(__file__).resolve().parents[1]

# The DeepSpeed configs a CPU-only machine can run (ZeRO-3 NVMe needs an NVMe path and the async-I/O op;
# ZeRO++ quantization kernels need CUDA; sequence parallelism is tested in launch/test_sequence_parallel.py), and a
# short demo run for tests.
CPU_RUNNABLE_DEEPSPEED = [row.name for row in SHIPPED
                          if row.kind == "deepspeed" and row.cpu and not row.parallelism]
DEMO_SHORT_RUN = ["--max_steps", "3", "--logging_steps", "1", "--eval_on_start", "false",
                  "--generation_eval_samples", "6"]
# The Accelerate config (and DeepSpeed JSON swapped in) that runs each strategy on 2 CPU processes.
CPU_LAUNCHES = {name: SHIPPED_BY_NAME[name].launch(cpu=True) for name in ("ddp", "zero2", "zero3")}
# FSDP2 on 2 CPU processes: the CPU FSDP configs run by `finetune.testing.fsdp_on_cpu`, which lets Accelerate prepare
# FSDP on
# CPU; with `-m finetune` Trainer falls back to DDP, which the strategy check stops.
FSDP_ON_CPU = SHIPPED_BY_NAME["fsdp_full_shard"].launch(cpu=True)
FSDP_SHARD_GRAD_OP_ON_CPU = SHIPPED_BY_NAME["fsdp_shard_grad_op"].launch(cpu=True)
# A 2-process run of the demo recipe with complete checkpoints at steps 3 and 6 (conftest's `checkpointed_runs`, one per
# CPU launch); a resume of it takes the same arguments.
CHECKPOINTED_RUN = ["--max_steps", "6", "--save_strategy", "steps", "--save_steps", "3", "--logging_steps", "1",
                    "--warmup_steps", "2"]
# Short LoRA runs of the demo recipe under each of CPU_LAUNCHES; a planted HF_TOKEN must land nowhere.
LORA_DEMO_RUN = ["--use_lora", "true", "--lora_r", "8", "--learning_rate", "1e-2", "--max_steps", "30",
                 "--logging_steps", "10"]
PLANTED_TOKEN = "hf_notarealtokenbutonlyfortests"


# Tests about the launcher itself (`@pytest.mark.launcher`: a rank's last line, hangs, signals, the run lock, the
# self-launch, two nodes, the README's commands) start real processes; every other launch and one-process run is
# forked from a warm process (finetune.testing.warm_launch), which has imported what they import. Set by conftest for
# each test; FINETUNE_TESTS_REAL_LAUNCHES=1 makes every launch real.
LAUNCHER_TIER = False
REAL_RUNS: list[dict] = []  # the runs `run` did not fork, and why
_warm: WarmLauncher | None = None


def warm_launcher() -> WarmLauncher:
    global _warm
    if _warm is None:
        _warm = WarmLauncher()
        atexit.register(_warm.stop)
    return _warm


def run(command: list[str], timeout: float = 600, env: dict | None = None, cwd: Path = PROJECT_ROOT,
        real: bool | None = None):
    """Runs `command` as a subprocess would (`finetune.testing.subprocesses.run`): forked from the warm process unless
    `real` (default: the test is of the launcher tier) or the command cannot be forked (another program, or an
    environment a library reads at import)."""
    why = ("the launcher tier" if LAUNCHER_TIER and real is None else "the test asks for real processes" if real else
           "FINETUNE_TESTS_REAL_LAUNCHES" if os.environ.get(REAL_LAUNCHES) else
           warm_launcher().why_not(command, subprocesses.child_environment(env)))
    if why is None:
        return warm_launcher().run(command, timeout=timeout, env=env, cwd=cwd)
    REAL_RUNS.append({"test": os.environ.get("PYTEST_CURRENT_TEST", ""), "why": why})
    return subprocesses.run(command, timeout=timeout, env=env, cwd=cwd)


ERROR_MARK = "finetune: error: "


def error_lines(output: str) -> list[str]:
    """The one-line errors the ranks printed (from the mark on: a progress bar may stand before it on its line).
    Under a launcher, its closing summary quotes the line again after `traceback : ` (finetune.cli leaves it in the
    rank's reply file): not counted here."""
    found = []
    for line in output.splitlines():
        where = line.find(ERROR_MARK)
        if where >= 0 and not line[:where].rstrip().endswith("traceback :"):
            found.append(line[where:])
    return found


def assert_succeeded(result) -> None:
    if result.returncode != 0:
        raise AssertionError(
            f"exit status {result.returncode}: {' '.join(map(str, result.args))}\n{result.output[-OUTPUT_TAIL:]}"
        )


def launch_demo(launch: Launch | str, output_dir, *extra: str, deepspeed_json: str | None = None,
                timeout: float = 600, env: dict | None = None, num_processes: int | None = None,
                program: tuple[str, ...] | None = None, real: bool | None = None):
    """A short 2-process run of recipes/demo.yaml as `launch` says (or under an Accelerate config file), optionally with
    another DeepSpeed JSON, another process count or another program in place of the launch's; `real` as `run`."""
    launch = Launch(launch) if isinstance(launch, str) else launch
    if deepspeed_json is not None:
        launch = launch._replace(deepspeed_json=deepspeed_json)
    if program is not None:
        launch = launch._replace(program=program)
    command = launch.command("train", "recipes/demo.yaml", "--output_dir", str(output_dir), *DEMO_SHORT_RUN, *extra,
                             num_processes=num_processes)
    return run(command, timeout=timeout, env=env, real=real)


def measuring_gathers(launch: Launch, record_dir: Path) -> tuple[Launch, dict]:
    """`launch` under finetune.testing.fsdp_gathers (its own CPU shim run inside it), and the environment that makes
    each rank record what FSDP2 gathered into `record_dir`."""
    from finetune.testing.fsdp_gathers import RECORD_DIR, UNDER

    record_dir.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, RECORD_DIR: str(record_dir), **({UNDER: launch.program[-1]} if launch.program else {})}
    return launch._replace(program=("-m", "finetune.testing.fsdp_gathers")), env


def gathered_weights_peaks(record_dir: Path) -> list[int]:
    """Each rank's peak of the weights FSDP2 held gathered, by rank (finetune.testing.fsdp_gathers)."""
    import json

    records = sorted(record_dir.glob("rank*.json"), key=lambda path: int(path.stem.removeprefix("rank")))
    return [json.loads(path.read_text())["gathered_weights_peak_bytes"] for path in records]


# What DeepSpeed's measured memory may exceed the estimator by, per state and run (the ledger's documented slack).
ALIGNMENT = 1024  # bytes: DeepSpeed pads each flat partition to an alignment boundary
# Trainer's second parameter group (no weight decay: the tiny model's 2·3 + 1 RMSNorm weights of 128) is stepped after
# the first group's fp32 gradients are freed, so the step holds the larger group's fp32 copy, not both; the estimator
# counts the whole partition (the norms are a negligible share of any real model). Its fp32 shard per rank:
NO_DECAY_FP32 = 4 * (2 * model_shape("tiny").num_layers + 1) * model_shape("tiny").hidden_size // 2


def slack(key: str, run: str) -> int:
    """Allowed difference: alignment padding; for gradients the no-decay group's fp32 shard, and for ZeRO-1/2 one
    whole parameter tensor: DeepSpeed sizes a rank's gradient buffer by the whole tensors its partition touches
    (stage_1_and_2.py `grads_in_partition`), so the rank whose boundary cuts the embedding holds up to that tensor
    more."""
    if key != "grads_bytes":
        return ALIGNMENT
    if run[:5] in ("zero1", "zero2") and "offload" not in run:
        element = 2 if run.endswith("bf16") else 4
        return ALIGNMENT + NO_DECAY_FP32 + model_shape("tiny").largest_layer_parameters * element
    return ALIGNMENT + NO_DECAY_FP32


def wait_for_models(port: int, server, timeout: float = 240) -> list[dict]:
    """The models a server just started lists, once it answers (`finetune serve`'s tests); it failing first is an
    error with what it printed."""
    import json
    import time
    import urllib.request

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise AssertionError(f"the server ended early ({server.returncode}): {server.stderr.read()}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=5) as response:
                return json.loads(response.read())["data"]
        except OSError:
            time.sleep(1)
    raise AssertionError("the server did not answer in time")
