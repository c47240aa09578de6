"""A rank that stops answering ends the run within `ddp_timeout`, named; ranks whose launcher died stop and free the
run lock; SIGTERM with `save_on_preemption` saves a complete checkpoint at the current step that `auto` resumes with
the uninterrupted losses, and without it leaves the newest complete checkpoint as it was (finetune.launch.watchdog,
finetune.checkpoints.preemption). Faults are injected by tests/fault_injection.py."""

from __future__ import annotations

import fcntl
import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest
from support import CPU_LAUNCHES, PROJECT_ROOT, assert_succeeded, error_lines, finetune_command, run
from torch.distributed import HashStore

from finetune import outputs
from finetune.checkpoints.complete import is_complete, mark_complete
from finetune.checkpoints.preemption import Interrupted, ending_in_one_line_on_signals, save_on_preemption
from finetune.launch.grace import PREEMPTION_GRACE, grace_for_launch, launcher_grace
from finetune.launch.watchdog import RankWatchdog
from finetune.recipe.parse import parse_recipe

# The launcher tier (watchdog, hangs, signals and preemption: what the real launcher and ranks do):
# launches are real processes, not forked (tests/support.py).
pytestmark = pytest.mark.launcher

FAULTS = ("tests/fault_injection.py",)
DDP = CPU_LAUNCHES["ddp"]
STEPS = 60
SHORT_RUN = ["--max_steps", str(STEPS), "--logging_steps", "1", "--eval_on_start", "false",
             "--generation_eval_samples", "0", "--report_to", "none", "--memory_report", "false",
             "--throughput_report", "false", "--save_strategy", "steps", "--save_steps", "10"]
LOGGED_STEP = re.compile(r"\{'loss': ")


class Launched:
    """A 2-process DDP run of the demo recipe started in the background, its output in a file, its ranks known."""

    def __init__(self, output_dir: Path, *extra: str, env: dict | None = None, program=FAULTS):
        self.log = output_dir.with_name(output_dir.name + ".log")
        command = DDP._replace(program=program).command("train", "recipes/demo.yaml", "--output_dir", str(output_dir),
                                                        *SHORT_RUN, *extra)
        with self.log.open("w") as log:
            self.launcher = subprocess.Popen(command, cwd=PROJECT_ROOT, stdout=log, stderr=subprocess.STDOUT,
                                             env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
        self.ranks: list[psutil.Process] = []

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_for_steps(self, steps: int, timeout: float = 300) -> None:
        """Until rank 0 has logged `steps` losses; the ranks are known from then on."""
        deadline = time.monotonic() + timeout
        while len(LOGGED_STEP.findall(self.output())) < steps:
            assert self.launcher.poll() is None and time.monotonic() < deadline, self.output()[-6000:]
            time.sleep(0.2)
        self.ranks = psutil.Process(self.launcher.pid).children()
        assert len(self.ranks) == 2

    def ranks_alive(self) -> list[psutil.Process]:
        return [rank for rank in self.ranks if rank.is_running() and rank.status() != psutil.STATUS_ZOMBIE]

    def wait_until_ranks_end(self, timeout: float) -> float:
        """Seconds until every rank has ended (an AssertionError after `timeout`)."""
        start = time.monotonic()
        while self.ranks_alive():
            assert time.monotonic() - start < timeout, f"ranks running after {timeout} s:\n{self.output()[-6000:]}"
            time.sleep(0.2)
        return time.monotonic() - start

    def end(self) -> None:
        """Stops whatever is left of this launch (the launcher and the ranks this test started)."""
        for process in [psutil.Process(self.launcher.pid), *self.ranks] if self.launcher.poll() is None else self.ranks:
            try:
                process.kill()
            except psutil.NoSuchProcess:
                pass
        self.launcher.wait(timeout=30)


def logged_losses(output_dir: Path) -> dict[int, float]:
    state = json.loads((output_dir / "trainer_state.json").read_text())
    return {entry["step"]: entry["loss"] for entry in state["log_history"] if "loss" in entry}


def test_a_silent_neighbour_is_named_after_the_timeout_and_a_finished_one_is_not():
    store = HashStore()
    watchdog = RankWatchdog(store, rank=0, world_size=4, timeout=20, parent=os.getppid())
    assert watchdog.neighbours == [1, 3]
    store.set("1", "7")
    store.set("3", "done")
    assert watchdog.silent_neighbours(0.5) == []  # first sight of rank 1's beat
    time.sleep(0.6)
    assert watchdog.silent_neighbours(0.5) == [1]  # its beat stood still; rank 3 ended its run
    store.set("1", "8")
    assert watchdog.silent_neighbours(0.5) == []
    assert "rank 1 stopped answering" in watchdog.silence_message([1])


def test_save_on_preemption_is_on_under_slurm_by_default_and_as_the_recipe_says(monkeypatch):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    assert not save_on_preemption(parse_recipe("recipes/demo.yaml", ["--use_cpu", "true"]).training)
    monkeypatch.setenv("SLURM_JOB_ID", "42")
    assert save_on_preemption(parse_recipe("recipes/demo.yaml", ["--use_cpu", "true"]).training)
    assert not save_on_preemption(parse_recipe("recipes/demo.yaml", ["--use_cpu", "true",
                                                                     "--save_on_preemption", "false"]).training)


def test_ctrl_c_and_sigterm_end_in_one_line_naming_the_newest_complete_checkpoint(tmp_path):
    for step in (6, 12):
        mark_complete(tmp_path / f"checkpoint-{step}", step, {}, {})
    (tmp_path / "checkpoint-18").mkdir()  # a save the signal cut short
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(Interrupted) as stopped, ending_in_one_line_on_signals(str(tmp_path), rank=0):
        raise KeyboardInterrupt
    assert str(stopped.value) == (f"stopped by Ctrl-C (SIGINT): {tmp_path / 'checkpoint-12'} is the newest complete "
                                  "checkpoint; resume from it with `--resume_from_checkpoint auto`.")
    assert stopped.value.exit_status == 130
    with pytest.raises(Interrupted, match=r"^stopped by SIGTERM: .*checkpoint-12 is the newest") as stopped, \
            ending_in_one_line_on_signals(str(tmp_path), rank=0):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)  # not reached: the signal raises here
    assert stopped.value.exit_status == 143 and signal.getsignal(signal.SIGTERM) is before
    with pytest.raises(SystemExit) as quiet, ending_in_one_line_on_signals(str(tmp_path), rank=1):
        raise KeyboardInterrupt  # the other ranks say nothing
    assert quiet.value.code == 130
    with pytest.raises(Interrupted, match="no complete checkpoint in .* yet, so a new run starts from the beginning"), \
            ending_in_one_line_on_signals(str(tmp_path / "empty"), rank=0):
        raise KeyboardInterrupt


def test_the_launcher_ends_with_the_status_of_the_signal_that_stopped_it(monkeypatch):
    from torch.distributed.elastic.multiprocessing.api import SignalException

    from finetune.errors import report_user_error
    from finetune.launch import accelerate_launch

    def stopped(args):
        raise SignalException("Process 1 got signal: 2", sigval=signal.SIGINT)

    monkeypatch.setattr("accelerate.commands.launch.launch_command", stopped)
    assert accelerate_launch.main(["--num_processes", "2", "-m", "finetune", "train", "recipes/demo.yaml"]) == 130
    assert report_user_error(Interrupted("stopped by SIGTERM", signal.SIGTERM)) == 143  # what `finetune` exits with


@pytest.mark.distributed
def test_a_stopped_rank_ends_the_run_within_ddp_timeout_naming_it(tmp_path):
    timeout = 20
    launch = Launched(tmp_path / "run", "--ddp_timeout", str(timeout), "--max_steps", "2000",
                      env={"FAULT_KILL_RANK": "1", "FAULT_KILL_STEP": "3", "FAULT_KILL_SIGNAL": "SIGSTOP"})
    try:
        launch.wait_for_steps(2)
        deadline = time.monotonic() + 60
        while launch.ranks[1].status() != psutil.STATUS_STOPPED and time.monotonic() < deadline:
            time.sleep(0.1)
        stopped = time.monotonic()
        launch.launcher.wait(timeout=timeout + 120)
        ended_after = time.monotonic() - stopped
        launch.wait_until_ranks_end(5)
    finally:
        launch.end()
    # the timeout, a beat, the launcher's 30 s of grace before it SIGKILLs the stopped rank (~52 s), and slack for a
    # loaded machine: far below the ten minutes a stopped rank used to hang for
    assert ended_after < timeout + 90, ended_after
    assert launch.launcher.returncode != 0
    assert "rank 1 stopped answering: no heartbeat for 20 s (ddp_timeout 20)" in launch.output()


@pytest.mark.distributed
def test_ranks_whose_launcher_was_killed_stop_and_free_the_run_lock(tmp_path):
    launch = Launched(tmp_path / "run", "--max_steps", "2000", program=("-m", "finetune"))
    try:
        launch.wait_for_steps(2)
        launch.launcher.kill()
        seconds = launch.wait_until_ranks_end(10)
    finally:
        launch.end()
    assert seconds < 10
    assert lock_freed_within(tmp_path / "run" / outputs.RUN_LOCK, 15)


def lock_freed_within(path: Path, timeout: float) -> bool:
    """Whether the run lock can be taken within `timeout` (a loaded machine may take a moment to close the ended
    ranks' files); the processes still holding it are named otherwise."""
    deadline = time.monotonic() + timeout
    with path.open() as lock:
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)  # raises BlockingIOError while a process holds it
                return True
            except BlockingIOError:
                if time.monotonic() > deadline:
                    holders = [f"{process.pid} {' '.join(process.cmdline())[:200]}" for process in psutil.process_iter()
                               if _holds(process, path)]
                    raise AssertionError(f"{path} still locked after {timeout} s by: {holders}") from None
                time.sleep(0.2)


def _holds(process: psutil.Process, path: Path) -> bool:
    try:
        return any(Path(file.path) == path.resolve() for file in process.open_files())
    except (psutil.Error, OSError):
        return False


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    output_dir = tmp_path_factory.mktemp("uninterrupted") / "run"
    assert_succeeded(run(DDP.command("train", "recipes/demo.yaml", "--output_dir", str(output_dir), *SHORT_RUN)))
    return logged_losses(output_dir)


def sigterm_launcher_mid_run(output_dir: Path, *extra: str) -> tuple[Launched, int, float]:
    """Starts a run, sends SIGTERM to its launcher after step 13 has been logged; (the launch, the steps logged by
    then, seconds until every rank ended)."""
    launch = Launched(output_dir, *extra, program=("-m", "finetune"))
    try:
        launch.wait_for_steps(13)
        logged = len(LOGGED_STEP.findall(launch.output()))
        launch.launcher.send_signal(signal.SIGTERM)
        seconds = launch.wait_until_ranks_end(60)
        launch.launcher.wait(timeout=30)
    finally:
        launch.end()
    return launch, logged, seconds


@pytest.mark.distributed
def test_sigterm_with_save_on_preemption_saves_the_current_step_and_auto_resumes_it_exactly(tmp_path, uninterrupted):
    output_dir = tmp_path / "run"
    launch, logged, seconds = sigterm_launcher_mid_run(output_dir, "--save_on_preemption", "true")
    assert seconds < 60
    assert launch.launcher.returncode == 143  # as a shell reports a process SIGTERM ended
    assert "Traceback" not in launch.output() and len(error_lines(launch.output())) == 1  # rank 0's line alone
    preempted = re.search(r"preempted at step (\d+): checkpoint-(\d+) saved in \S+; resume with "
                          r"`--resume_from_checkpoint auto`", launch.output())
    assert preempted, launch.output()[-6000:]
    step = int(preempted.group(1))
    assert logged <= step < STEPS and preempted.group(2) == str(step)  # the step it was at, not the last save (10)
    assert is_complete(output_dir / f"checkpoint-{step}")

    resumed = run(DDP.command("train", "recipes/demo.yaml", "--output_dir", str(output_dir), *SHORT_RUN,
                              "--resume_from_checkpoint", "auto"))
    assert_succeeded(resumed)
    assert f"resuming from {output_dir / f'checkpoint-{step}'}" in resumed.output
    losses = logged_losses(output_dir)
    assert sorted(losses) == list(range(1, STEPS + 1))
    assert [losses[s] for s in range(step + 1, STEPS + 1)] == pytest.approx(
        [uninterrupted[s] for s in range(step + 1, STEPS + 1)], rel=1e-5)


@pytest.mark.distributed
def test_sigterm_saves_a_pipelines_current_step_on_every_stage_and_it_resumes_from_there(tmp_path):
    """The pipeline's own loop saves on preemption as Trainer does: SIGTERM to the launcher, every stage saves the step
    the ranks agree on, the run ends in one line with 143, and `--resume_from_checkpoint auto` takes it up there."""
    output_dir = tmp_path / "run"
    pipeline = ["--pipeline_parallel_size", "2", "--gradient_accumulation_steps", "2"]
    launch, logged, seconds = sigterm_launcher_mid_run(output_dir, "--save_on_preemption", "true", *pipeline)
    assert seconds < 60 and launch.launcher.returncode == 143
    assert "Traceback" not in launch.output() and len(error_lines(launch.output())) == 1, launch.output()[-6000:]
    preempted = re.search(r"preempted at step (\d+): checkpoint-(\d+) saved", launch.output())
    assert preempted, launch.output()[-6000:]
    step = int(preempted.group(1))
    assert logged <= step < STEPS and preempted.group(2) == str(step)
    assert is_complete(output_dir / f"checkpoint-{step}")
    assert sorted(path.name for path in (output_dir / f"checkpoint-{step}").glob("pipeline_stage_*")) == [
        "pipeline_stage_00.safetensors", "pipeline_stage_00_state.pt", "pipeline_stage_01.safetensors",
        "pipeline_stage_01_state.pt"]

    resumed = run(DDP.command("train", "recipes/demo.yaml", "--output_dir", str(output_dir), *SHORT_RUN, *pipeline,
                              "--resume_from_checkpoint", "auto"))
    assert_succeeded(resumed)
    assert f"resuming from {output_dir / f'checkpoint-{step}'}" in resumed.output
    assert sorted(logged_losses(output_dir)) == list(range(1, STEPS + 1))


@pytest.mark.distributed
def test_sigterm_without_save_on_preemption_leaves_the_newest_complete_checkpoint_intact(tmp_path):
    output_dir = tmp_path / "run"
    launch, logged, seconds = sigterm_launcher_mid_run(output_dir, "--save_on_preemption", "false")
    assert launch.launcher.returncode == 143
    assert "preempted at step" not in launch.output()
    assert "Traceback" not in launch.output()  # neither the ranks' nor the launcher's
    assert "death signal" not in launch.output() and "closing signal" not in launch.output()  # its relay, unsaid
    (line,) = error_lines(launch.output())
    assert seconds < 60
    assert not (output_dir / outputs.EVAL_RESULTS).exists()  # stopped mid-run
    complete = sorted(int(folder.name.split("-")[1]) for folder in output_dir.glob("checkpoint-*")
                      if is_complete(folder))
    assert complete and complete == list(range(10, complete[-1] + 1, 10))  # only the regular saves, each complete
    assert complete[-1] <= logged + 10
    assert line == (f"finetune: error: stopped by SIGTERM: {output_dir / f'checkpoint-{complete[-1]}'} is the newest "
                    "complete checkpoint; resume from it with `--resume_from_checkpoint auto`.")


def test_a_run_that_saves_on_preemption_is_launched_with_a_grace_and_a_rank_says_when_it_has_torchs(capsys):
    saves, default = {"SLURM_JOB_ID": "7"}, {}
    assert grace_for_launch("true", default) == {"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": str(PREEMPTION_GRACE)}
    assert grace_for_launch(None, saves) == {"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "110"}  # on by default under SLURM
    assert grace_for_launch(None, default) == grace_for_launch("false", saves) == {}
    assert grace_for_launch(True, {"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "300"}) == {}  # the user's value stands
    assert grace_for_launch(True, {"PET_SHUTDOWN_TIMEOUT": "300"}) == {}  # torchrun --shutdown-timeout's
    assert launcher_grace({}) is None  # no elastic agent: nobody SIGKILLs after a grace
    assert launcher_grace({"TORCHELASTIC_RUN_ID": "x"}) == 30
    assert launcher_grace({"TORCHELASTIC_RUN_ID": "x", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "110"}) == 110
    assert launcher_grace({"TORCHELASTIC_RUN_ID": "x", "PET_SHUTDOWN_TIMEOUT": "90",
                           "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "110"}) == 90


# Each rank sleeps through every step from FAULT_SLOW_FROM_STEP on, FAULT_SLOW_SECONDS long: a step longer than
# torch's 30 s grace. Put first on PYTHONPATH, it patches Trainer in every process the launch starts.
SLOW_STEPS = """
import os
import time

if os.environ.get("FAULT_SLOW_SECONDS"):
    from transformers import Trainer

    original = Trainer.training_step

    def training_step(self, *args, **kwargs):
        if self.state.global_step + 1 >= int(os.environ["FAULT_SLOW_FROM_STEP"]):
            time.sleep(float(os.environ["FAULT_SLOW_SECONDS"]))  # a signal's handler runs; the sleep goes on
        return original(self, *args, **kwargs)

    Trainer.training_step = training_step
"""


@pytest.mark.distributed
def test_sigterm_in_a_step_longer_than_torchs_grace_saves_that_step_under_a_self_launch(tmp_path):
    """`finetune train --gpus 2` with `save_on_preemption`: SIGTERM 1 s into a 40 s step. Under torch's 30 s grace the
    launcher would SIGKILL the ranks mid-step and no checkpoint of it would exist; the self-launch gives the run
    PREEMPTION_GRACE."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SLOW_STEPS)
    output_dir, log = tmp_path / "run", tmp_path / "run.log"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "FAULT_SLOW_FROM_STEP": "4", "FAULT_SLOW_SECONDS": "40",
           "PYTHONPATH": os.pathsep.join(filter(None, (str(site), os.environ.get("PYTHONPATH"))))}
    for name in ("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "PET_SHUTDOWN_TIMEOUT", "SLURM_JOB_ID"):
        env.pop(name, None)
    command = finetune_command("train", "recipes/demo.yaml", "--gpus", "2", "--strategy", "ddp", "--output_dir",
                               str(output_dir), *SHORT_RUN, "--save_on_preemption", "true")
    with log.open("w") as file:
        launcher = subprocess.Popen(command, cwd=PROJECT_ROOT, stdout=file, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + 300
        while len(LOGGED_STEP.findall(log.read_text(errors="replace"))) < 3:  # step 4, the slow one, has begun
            assert launcher.poll() is None and time.monotonic() < deadline, log.read_text()[-6000:]
            time.sleep(0.2)
        time.sleep(1)
        launcher.send_signal(signal.SIGTERM)
        launcher.wait(timeout=120)
    finally:
        for process in psutil.Process(launcher.pid).children(recursive=True) if launcher.poll() is None else ():
            process.kill()
        if launcher.poll() is None:
            launcher.kill()
    output = log.read_text(errors="replace")
    assert "preempted at step 4: checkpoint-4 saved in" in output, output[-6000:]
    assert is_complete(output_dir / "checkpoint-4")
    assert f"launch: TORCH_ELASTIC_SHUTDOWN_TIMEOUT={PREEMPTION_GRACE} accelerate launch " in output
    assert launcher.returncode == 143
    assert "save_on_preemption: the launcher kills the ranks" not in output  # its grace is not torch's default


def test_rank_0_names_torchs_grace_when_training_starts_under_it(monkeypatch, capsys):
    """Under a typed `accelerate launch` the ranks get torch's 30 s: rank 0 says so as training starts, not after a
    preemption that saved nothing."""
    from types import SimpleNamespace

    from finetune.checkpoints.preemption import PreemptionCallback

    for name in ("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "PET_SHUTDOWN_TIMEOUT"):
        monkeypatch.delenv(name, raising=False)
    callback = PreemptionCallback()
    try:
        for rank_zero, run_id, said in ((True, "x", True), (False, "x", False), (True, None, False)):
            if run_id is None:
                monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
            else:
                monkeypatch.setenv("TORCHELASTIC_RUN_ID", run_id)
            callback.on_train_begin(None, SimpleNamespace(is_world_process_zero=rank_zero), None)
            callback.on_train_end(None, None, None)
            lines = [line for line in capsys.readouterr().out.splitlines() if "the launcher kills" in line]
            assert len(lines) == said, lines
            if said:
                assert "30 s after SIGTERM (torch's default)" in lines[0]
                assert "TORCH_ELASTIC_SHUTDOWN_TIMEOUT=110" in lines[0]
        monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")
        monkeypatch.setenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "110")
        callback.on_train_begin(None, SimpleNamespace(is_world_process_zero=True), None)
        assert "the launcher kills" not in capsys.readouterr().out
    finally:
        callback.on_train_end(None, None, None)
