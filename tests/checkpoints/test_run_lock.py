"""One run per output_dir (finetune/checkpoints/run_lock.py): a run holding the folder refuses a second one by name, a
killed run's
lock is taken over aloud, a finished run's is taken quietly, the record-only fallback (no flock) decides by pid and
host, the ranks of a launch agree; and end to end, a 2-process run started on a busy folder stops at once while the
first run finishes intact."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
import torch
from support import CPU_LAUNCHES, PROJECT_ROOT, error_lines, finetune_command, launch_demo

from finetune import outputs
from finetune.checkpoints import run_lock
from finetune.checkpoints.complete import COMPLETE_MARKER
from finetune.checkpoints.run_lock import acquire, output_dir_lock, release
from finetune.errors import RecipeError

# The launcher tier (two runs on one folder at once: the real launcher and its ranks):
# launches are real processes, not forked (tests/support.py).
pytestmark = pytest.mark.launcher

# A process that takes the lock through the module, says so, and holds it until killed.
HOLDER = """
import sys, time
from finetune.checkpoints.run_lock import acquire

acquire(sys.argv[1], sys.argv[2])
print("held", flush=True)
time.sleep(120)
"""
HOST = socket.gethostname()


@pytest.fixture
def holder(tmp_path):
    """Starts another process holding tmp_path's lock under run id "holder-run"; yields (process, its record)."""
    process = subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path), "holder-run"], cwd=PROJECT_ROOT,
                               stdout=subprocess.PIPE, text=True)
    try:
        assert process.stdout.readline().strip() == "held"
        yield process, record(tmp_path)
    finally:
        if process.poll() is None:
            process.kill()
        process.wait()
        process.stdout.close()


def record(output_dir) -> dict:
    text = (output_dir / outputs.RUN_LOCK).read_text()
    return json.loads(text) if text else {}


def one_process(output_dir, **overrides) -> SimpleNamespace:
    """The fields of our TrainingArguments that the lock reads, for a run of one process."""
    return SimpleNamespace(**{"output_dir": str(output_dir), "process_index": 0, "local_process_index": 0,
                              "world_size": 1, "should_save": True, "save_on_each_node": False, **overrides})


def test_a_lock_held_by_a_live_run_is_refused_naming_its_pid_host_and_start(tmp_path, holder):
    process, held = holder
    assert (held["pid"], held["host"], held["run_id"]) == (process.pid, HOST, "holder-run")
    with pytest.raises(RecipeError) as refused:
        with output_dir_lock(one_process(tmp_path)):
            pytest.fail("entered a folder another run holds")
    assert str(refused.value) == (
        f"{tmp_path} is in use by another run: pid {process.pid} on host {HOST}, started {held['started']} "
        f"({held['command']}). Wait for it to finish, or give this run another output_dir.")
    assert record(tmp_path) == held  # the refused run wrote nothing
    # Another node of the same run, on a disk the nodes share, goes on without holding it.
    assert acquire(tmp_path, "holder-run") is None
    assert record(tmp_path) == held


def test_a_lock_left_by_a_killed_run_is_taken_over_naming_it(tmp_path, holder, capsys):
    process, held = holder
    process.send_signal(signal.SIGKILL)  # no release: the record stays, the kernel drops the flock
    process.wait()
    assert record(tmp_path) == held
    lock = acquire(tmp_path, "next-run")
    try:
        assert (f"taking over the lock left by pid {process.pid} on host {HOST} (started {held['started']}), which "
                "is no longer running") in capsys.readouterr().out
        assert (record(tmp_path)["pid"], record(tmp_path)["run_id"]) == (os.getpid(), "next-run")
    finally:
        release(lock)


def test_a_released_lock_leaves_an_empty_file_and_is_taken_quietly(tmp_path, capsys):
    lock = acquire(tmp_path / "new" / "run", "first-run")  # the folder is made, parents too
    with pytest.raises(RecipeError, match="is in use by another run: pid"):
        acquire(tmp_path / "new" / "run", "second-run")  # flock refuses a second open file in this process too
    release(lock)
    path = tmp_path / "new" / "run" / outputs.RUN_LOCK
    assert path.is_file() and path.read_text() == ""
    with pytest.raises(ZeroDivisionError):
        with output_dir_lock(one_process(tmp_path / "new" / "run")):
            assert record(tmp_path / "new" / "run")["pid"] == os.getpid()
            1 / 0  # a run that fails releases the lock too
    assert path.read_text() == ""
    release(acquire(tmp_path / "new" / "run", "third-run"))
    assert "taking over" not in capsys.readouterr().out


def write_record(output_dir, pid: int, host: str = HOST) -> dict:
    held = {"pid": pid, "host": host, "started": "2025-01-01T00:00:00+00:00", "run_id": "earlier-run",
            "command": "finetune train recipes/demo.yaml"}
    (output_dir / outputs.RUN_LOCK).write_text(json.dumps(held))
    return held


def test_without_flock_the_record_refuses_a_live_or_remote_holder_and_takes_over_a_dead_one(tmp_path, monkeypatch,
                                                                                        capsys):
    def no_flock(fd, operation):
        raise OSError(run_lock.errno.ENOLCK, "No locks available")

    monkeypatch.setattr(run_lock.fcntl, "flock", no_flock)
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    try:
        for pid, host in ((live.pid, HOST), (dead.pid, "another-host")):
            held = write_record(tmp_path, pid, host)
            with pytest.raises(RecipeError) as refused:
                acquire(tmp_path, "this-run")
            assert f"in use by another run: pid {pid} on host {host}, started {held['started']}" in str(refused.value)
            assert "if that run is gone, delete the file" in str(refused.value)
            assert record(tmp_path) == held
        assert "does not support flock (No locks available)" in capsys.readouterr().out
    finally:
        live.kill()
        live.wait()
    write_record(tmp_path, dead.pid)  # gone, on this host
    lock = acquire(tmp_path, "this-run")
    assert (f"taking over the lock left by pid {dead.pid} on host {HOST} (started 2025-01-01T00:00:00+00:00), which is "
            "no longer running") in capsys.readouterr().out
    assert (record(tmp_path)["pid"], lock.flocked) == (os.getpid(), False)
    release(lock)  # empties the record without calling flock
    assert record(tmp_path) == {}


def test_every_rank_raises_the_error_of_the_rank_that_could_not_lock(tmp_path, monkeypatch):
    """Rank 0 locks its node's disk; the first process of node 1 (save_on_each_node) could not: rank 0 raises node
    1's error too, and releases its own lock; a rank that does not save never touches the folder."""
    monkeypatch.setattr(run_lock, "broadcast_object_list", lambda items, from_process: items)
    monkeypatch.setattr(run_lock, "wait_for_everyone", lambda: None)
    node_1_error = "/node1/run is in use by another run: pid 7 on host node1, started T (finetune train)."
    monkeypatch.setattr(run_lock, "gather_object", lambda items: [*items, node_1_error])
    ranks = {"world_size": 2, "save_on_each_node": True}
    with pytest.raises(RecipeError) as refused:
        with output_dir_lock(one_process(tmp_path / "rank0", **ranks)):
            pytest.fail("went on while another rank failed")
    assert str(refused.value) == node_1_error
    assert record(tmp_path / "rank0") == {}  # released
    monkeypatch.setattr(run_lock, "gather_object", lambda items: [None, *items])
    with output_dir_lock(one_process(tmp_path / "rank1", process_index=1, local_process_index=1, should_save=False,
                                     **ranks)):
        pass
    assert not (tmp_path / "rank1").exists()


# Run A: one process, 100 steps, a checkpoint every 25 steps, all kept.
FIRST_RUN = ["--max_steps", "100", "--save_strategy", "steps", "--save_steps", "25", "--logging_steps", "25",
             "--eval_on_start", "false", "--generation_eval_samples", "0", "--disable_tqdm", "true"]
FIRST_RUN_CHECKPOINTS = [25, 50, 75, 100]


def wait_for_holder(output_dir, pid: int, process, timeout: float = 90) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert process.poll() is None, "the first run ended before taking the lock"
        path = output_dir / outputs.RUN_LOCK
        try:
            held = json.loads(path.read_text()) if path.is_file() else {}
        except json.JSONDecodeError:  # being written
            held = {}
        if held.get("pid") == pid:
            return held
        time.sleep(0.2)
    raise AssertionError(f"no lock record of pid {pid} in {output_dir} after {timeout}s")


@pytest.mark.distributed
def test_a_second_run_on_a_busy_output_dir_stops_naming_the_first_which_finishes_intact(tmp_path):
    from safetensors.torch import load_file

    output_dir = tmp_path / "run"
    log = tmp_path / "first.log"
    with log.open("w") as first_output:
        first = subprocess.Popen(finetune_command("train", "recipes/demo.yaml", "--output_dir", str(output_dir),
                                                  *FIRST_RUN),
                                 cwd=PROJECT_ROOT, stdout=first_output, stderr=subprocess.STDOUT,
                                 env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        wait_for_holder(output_dir, first.pid, first)
        # The first run is suspended while the second starts, so however fast it trains it still holds the folder
        # when the second run asks for it; a stop and continue is all a single-process run sees of it.
        first.send_signal(signal.SIGSTOP)
        try:
            started = time.monotonic()
            second = launch_demo(CPU_LAUNCHES["ddp"], output_dir, timeout=120)  # 2 processes; a hung rank times out
            second_seconds = time.monotonic() - started
        finally:
            first.send_signal(signal.SIGCONT)
        assert first.poll() is None, "the first run ended before the second was refused"
        first.wait(timeout=240)
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    first_log = log.read_text()
    assert second.returncode != 0, second.output[-3000:]
    assert len(error_lines(second.output)) == 1, second.output[-3000:]
    assert f"{output_dir} is in use by another run: pid {first.pid} on host {HOST}" in second.output
    # No traceback, the rank's or the launcher's: the launcher ends with its summary of the failed ranks.
    assert f'File "{PROJECT_ROOT / "finetune"}' not in second.output, second.output[-3000:]
    assert "Traceback" not in second.output and "Root Cause" in second.output, second.output[-3000:]
    assert second_seconds < 90, second_seconds
    assert first.returncode == 0, first_log[-3000:]

    checkpoints = sorted(output_dir.glob("checkpoint-*"), key=lambda folder: int(folder.name.split("-")[1]))
    assert [int(folder.name.split("-")[1]) for folder in checkpoints] == FIRST_RUN_CHECKPOINTS
    for folder in checkpoints:
        marker = json.loads((folder / COMPLETE_MARKER).read_text())
        assert (marker["step"], marker["world_size"]) == (int(folder.name.split("-")[1]), 1)
        state = json.loads((folder / "trainer_state.json").read_text())
        assert state["global_step"] == marker["step"] and state["max_steps"] == 100
    final, last = load_file(output_dir / "model.safetensors"), load_file(checkpoints[-1] / "model.safetensors")
    assert final.keys() == last.keys() and len(final) > 10
    assert all(torch.equal(final[name], last[name]) for name in final)
    assert (output_dir / outputs.RUN_LOCK).read_text() == ""  # released
