"""The run catalogue: every training run several tests read, as a named row. A row is trained once per test session
for all pytest-xdist workers: the first worker to ask trains it under a file lock in a folder every worker sees, the
others wait for the lock and read what it left (its output_dir, and a record of the launch's exit status and output).
A run that failed is recorded too, and fails every reader without training again.

Readers only read a row's folder: a test that changes a run (resumes it, deletes a file) copies it first.
conftest.py hands the rows to tests by the fixtures' familiar names (`deepspeed_runs`, `checkpointed_runs`, `lora_runs`,
`ddp_run`, `demo_run`); docs/testing.md says how a new test picks a row instead of launching.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import support
from filelock import FileLock
from support import (
    CHECKPOINTED_RUN,
    CPU_LAUNCHES,
    CPU_RUNNABLE_DEEPSPEED,
    DEMO_SHORT_RUN,
    LORA_DEMO_RUN,
    PLANTED_TOKEN,
    launch_demo,
    run,
)

from finetune.launch.commands import Launch, finetune_command


@dataclass(frozen=True)
class Row:
    """A run: `train(output_dir)` launches it into `output_dir` and returns the launch's result (`returncode`, `output`,
    `args`); `steps` is how many optimizer steps it logs."""
    train: Callable[[Path], object]
    steps: int
    what: str


ROWS: dict[str, Row] = {}


def row(name: str, steps: int, what: str):
    def register(train):
        ROWS[name] = Row(train, steps, what)
        return train
    return register


# One 2-process demo run per CPU-runnable DeepSpeed config (fp32, the CPU default), plus two in bf16 mixed precision.
# ZeRO-2 is also the checkpointed ZeRO-2 run (complete checkpoints at steps 3 and 6) the resume tests read: the same
# launch, so one run. The fp32 ZeRO-3 run is launched by `finetune train --gpus 2 --strategy zero3` itself, leaves a
# checkpoint at step 3 (ZeRO shards) for the export tests and scores the final model with lm-eval when training ends.
# It is not the checkpointed ZeRO-3 run, which the resume test launches typed as a user would, resuming it typed.
def deepspeed_row(name: str, extra: tuple[str, ...] = ()):
    def train(output_dir: Path):
        return launch_demo(CPU_LAUNCHES["zero2"]._replace(deepspeed_json=f"deepspeed_configs/{name}.json"),
                           output_dir, *extra)
    return train


for _name in CPU_RUNNABLE_DEEPSPEED:
    if _name not in ("zero2", "zero3"):
        row(f"deepspeed/{_name}", 3, f"the demo recipe, 3 steps under {_name} on 2 processes")(deepspeed_row(_name))
for _name in ("zero2", "zero3"):
    row(f"deepspeed/{_name}_bf16", 3, f"the demo recipe, 3 steps under {_name} in bf16 on 2 processes")(
        deepspeed_row(_name, ("--bf16", "true")))


@row("deepspeed/zero2", 6, "the demo recipe under ZeRO-2 on 2 processes, complete checkpoints at steps 3 and 6: "
                           "also checkpointed/zero2")
def zero2(output_dir: Path):
    return launch_demo(CPU_LAUNCHES["zero2"], output_dir, *CHECKPOINTED_RUN)


@row("deepspeed/zero3", 3, "`finetune train --gpus 2 --strategy zero3` (a self-launch), 3 steps, a checkpoint at step "
                           "3, lm-eval's synthetic_add on the final model")
def zero3(output_dir: Path):
    return run(finetune_command("train", "recipes/demo.yaml", "--gpus", "2", "--strategy", "zero3", "--output_dir",
                                str(output_dir), *DEMO_SHORT_RUN, "--save_strategy", "steps", "--save_steps", "3",
                                "--eval_harness_tasks", "synthetic_add"))


for _name in ("ddp", "zero3"):
    row(f"checkpointed/{_name}", 6, f"the demo recipe typed as `accelerate launch` under {_name} on 2 processes, "
                                    "complete checkpoints at steps 3 and 6")(
        lambda output_dir, name=_name: launch_demo(CPU_LAUNCHES[name], output_dir, *CHECKPOINTED_RUN))
ALIASES = {"checkpointed/zero2": "deepspeed/zero2"}


def lora_row(name: str):
    def train(output_dir: Path):
        # The DDP run's log is read for library warnings, some of which a fresh interpreter prints as it imports
        # (test_self_launch.py): its processes are real.
        result = launch_demo(CPU_LAUNCHES[name], output_dir, *LORA_DEMO_RUN, env={"HF_TOKEN": PLANTED_TOKEN},
                             real=name == "ddp")
        output_dir.with_name(f"{output_dir.name}.log").write_text(result.output)  # outside the run's own files
        return result
    return train


for _name in CPU_LAUNCHES:
    row(f"lora/{_name}", 30, f"a LoRA run of the demo recipe under {_name} on 2 processes, a planted HF_TOKEN in its "
                             "environment; what it printed in `<output_dir>.log`")(lora_row(_name))


@row("ddp/tight_plan", 3, "DDP with an fp16 gradient-compression hook, carrying a launch plan with half the model "
                          "states it holds, handed as a self-launch hands it; what it printed in "
                          "`launcher_output.txt`")
def ddp_tight_plan(output_dir: Path):
    from finetune.launch.self_launch import LAUNCH_PLAN_ENV, Machine
    from finetune.plan.launch import plan_launch

    _, plan, _ = plan_launch("recipes/demo.yaml", [*DEMO_SHORT_RUN, "--ddp_comm_hook", "fp16", "--strategy", "ddp"],
                             Machine(2, None, 16.0, "the test", None))
    plan["predicted"]["model_states_bytes"] //= 2
    # handed as a self-launch hands it: naming the launcher process, whose ranks alone trust it
    command = Launch("accelerate_configs/cpu_ddp.yaml").command(
        "train", "recipes/demo.yaml", "--output_dir", str(output_dir), *DEMO_SHORT_RUN, "--ddp_comm_hook", "fp16")
    become_launcher = ("import json, os, sys; plan = json.loads(sys.argv[1]) | {'launcher_pid': os.getpid()}; "
                       f"os.execve(sys.argv[2], sys.argv[2:], {{**os.environ, {LAUNCH_PLAN_ENV!r}: json.dumps(plan)}})")
    result = run([sys.executable, "-c", become_launcher, json.dumps(plan), *command])
    if output_dir.is_dir():
        (output_dir / "launcher_output.txt").write_text(result.output)
    return result


@row("demo", 1500, "the main job exactly as `make demo` runs it on a machine without GPUs: `finetune train "
                   "recipes/demo.yaml --gpus 2` (ZeRO-2 on 2 CPU processes, 1500 steps)")
def demo(output_dir: Path):
    return run(finetune_command("train", "recipes/demo.yaml", "--gpus", "2", "--output_dir", str(output_dir)),
               timeout=900)


def vision_row(name: str, *extra: str):
    def train(output_dir: Path):
        return run(finetune_command("train", "recipes/vision.yaml", "--gpus", "2", "--output_dir", str(output_dir),
                                    *extra), timeout=600)
    return train


row("vision/full", 250, "the vision-language recipe as `finetune train recipes/vision.yaml --gpus 2` runs it: the tiny "
                        "Qwen2-VL, its vision tower frozen, under ZeRO-2 on 2 processes")(vision_row("full"))
row("vision/lora", 250, "the vision-language recipe with LoRA on the language model (the projector trained in full), "
                        "under ZeRO-2 on 2 processes")(vision_row("lora", "--use_lora", "true"))


class Catalogue:
    """The rows of one test session, kept in `folder` (seen by every worker): `catalogue[name]` trains the row if no
    worker has yet, and returns `SimpleNamespace(output_dir, returncode, output, args, steps)`."""

    def __init__(self, folder: Path):
        self.folder = folder

    def __getitem__(self, name: str) -> SimpleNamespace:
        name = ALIASES.get(name, name)
        row = ROWS[name]  # an unknown name is a KeyError, as in any mapping
        stem = self.folder / name.replace("/", "--")
        output_dir, record = stem, stem.with_suffix(".json")
        with FileLock(str(stem.with_suffix(".lock"))):
            if not record.is_file():
                # A row is trained as it says whichever test asks first: a launcher-tier reader does not make it real.
                tier, support.LAUNCHER_TIER = support.LAUNCHER_TIER, False
                try:
                    result = row.train(output_dir)
                finally:
                    support.LAUNCHER_TIER = tier
                record.write_text(json.dumps({"args": [str(arg) for arg in result.args],
                                              "returncode": result.returncode, "output": result.output}))
        return SimpleNamespace(output_dir=output_dir, steps=row.steps, **json.loads(record.read_text()))
