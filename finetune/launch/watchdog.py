"""Bounded hangs and orphaned ranks: a rank that stops answering ends the run within `ddp_timeout`, named; a rank
whose launcher died stops at once instead of training on as an orphan that holds the run lock.

Why a run could hang for good: Transformers gives `ddp_timeout` to the process group on GPUs only; on CPU
(`use_cpu`, gloo) `TrainingArguments._setup_devices` leaves it out and gloo waits its 30-minute default.
`start_process_group` passes it on every device. A rank frozen whole (SIGSTOP, a process stuck holding the
interpreter) also freezes its collectives' peers until that timeout, and the timeout error names no rank: each rank
therefore beats a counter into the launcher's c10d store (torchrun's agent holds it at MASTER_ADDR:MASTER_PORT, so it
answers while any rank is stopped) from a thread, and watches its two ring neighbours. A neighbour silent for
`ddp_timeout` is named in one line and this rank exits non-zero; the launcher then stops the others (SIGTERM, then
SIGKILL after its shutdown timeout). With a ring, every rank is watched by two others and the store serves O(world
size) reads per beat.

Orphans: a launcher killed with SIGKILL cannot stop its workers. Each rank asks the kernel for SIGKILL when its parent
dies (prctl PR_SET_PDEATHSIG, Linux) and, elsewhere, the beat thread sees the parent change. The kernel drops the run
lock's flock with the process (finetune.checkpoints.run_lock).
"""

from __future__ import annotations

import ctypes
import datetime
import os
import signal
import sys
import threading
import time
from contextlib import contextmanager

from finetune.errors import RecipeError, launched_rank

PR_SET_PDEATHSIG = 1  # linux/prctl.h
# Beats per timeout: a neighbour is called silent after its counter stood still for the whole timeout, checked this
# many times over it (at least every second, at most every 10 s).
BEATS_PER_TIMEOUT = 10


def start_process_group(args) -> None:
    """Starts the process group with `ddp_timeout` where Transformers would start it without (CPU launches: gloo);
    Transformers then finds it started and uses it. A no-op on GPUs, for single processes and once started."""
    import torch.distributed as dist
    from accelerate import PartialState
    from accelerate.utils import str_to_bool

    on_cpu = args.use_cpu or str_to_bool(os.environ.get("ACCELERATE_USE_CPU", "False"))
    if not on_cpu or int(os.environ.get("WORLD_SIZE", "1")) < 2 or not dist.is_available() or dist.is_initialized():
        return
    PartialState(cpu=True, backend=args.ddp_backend, timeout=args.ddp_timeout_delta)


def die_with_parent() -> int:
    """Asks the kernel to SIGKILL this process when its parent (the launcher) dies; returns the parent's pid, which
    the beat thread compares with where prctl is missing."""
    parent = os.getppid()
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    # The launcher died while the request was made: nothing would ever send the signal. (A parent of pid 1 may be the
    # launcher itself, as in a container.)
    if os.getppid() != parent:
        print(f"finetune: error: the launcher of rank {launched_rank()} is gone: stopping this orphaned rank.",
              file=sys.stderr, flush=True)
        os._exit(1)
    return parent


class RankWatchdog:
    """A thread that beats this rank's counter into the launcher's store and watches its ring neighbours'."""

    def __init__(self, store, rank: int, world_size: int, timeout: float, parent: int):
        self.store, self.rank, self.world_size, self.timeout, self.parent = store, rank, world_size, timeout, parent
        self.interval = min(max(timeout / BEATS_PER_TIMEOUT, 1.0), 10.0)
        self.neighbours = sorted({(rank - 1) % world_size, (rank + 1) % world_size} - {rank})
        self.seen: dict[int, tuple[bytes, float]] = {}  # neighbour -> (its last beat, when it last changed)
        self.beats = 0
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self.run, name="finetune-rank-watchdog", daemon=True)

    def run(self) -> None:
        while not self.stopped.wait(self.interval):
            if os.getppid() != self.parent:  # where PR_SET_PDEATHSIG is missing
                self.end(f"the launcher (pid {self.parent}) of rank {self.rank} is gone: stopping this orphaned rank.")
            try:
                self.beat()
                silent = self.silent_neighbours(self.timeout)
            except (RuntimeError, OSError) as error:  # c10d raises DistStoreError (a RuntimeError) on a lost store
                self.end(f"rank {self.rank} lost the launcher's store at {store_address()} "
                         f"({str(error).splitlines()[0]}): the launcher or its node is gone; stopping this rank.")
            if silent:
                self.end(self.silence_message(silent))

    def beat(self) -> None:
        self.beats += 1
        self.store.set(str(self.rank), str(self.beats))

    def silent_neighbours(self, threshold: float) -> list[int]:
        """The neighbours whose beat stood still for `threshold` seconds (a neighbour that ended its run is not)."""
        now, silent = time.monotonic(), []
        present = [rank for rank in self.neighbours if self.store.check([str(rank)])]
        for rank, value in zip(present, self.store.multi_get([str(rank) for rank in present]) if present else []):
            if value == b"done":
                self.seen.pop(rank, None)
                continue
            last, since = self.seen.get(rank, (None, now))
            if value != last:
                since = now
            self.seen[rank] = (value, since)
            if now - since >= threshold:
                silent.append(rank)
        return silent

    def silence_message(self, ranks: list[int]) -> str:
        who = ", ".join(f"rank {rank}" for rank in ranks)
        return (f"{who} stopped answering: no heartbeat for {self.timeout:g} s (ddp_timeout {self.timeout:g}), as a "
                f"stopped process, a wedged GPU or a stalled filesystem read leaves it; ending the run from rank "
                f"{self.rank}. Look at that rank's host (dmesg, nvidia-smi, the filesystem), then resume with "
                f"`resume_from_checkpoint: auto`.")

    def end(self, message: str) -> None:
        """Ends this rank from the beat thread (the main thread may be blocked in a collective for good); the
        launcher then stops the other ranks."""
        print(f"finetune: error: {message}", file=sys.stderr, flush=True)
        os._exit(1)

    def stop(self) -> None:
        self.stopped.set()
        self.thread.join(timeout=self.interval + 1)
        try:
            self.store.set(str(self.rank), "done")  # its neighbours, still finishing, do not wait for it
        except (RuntimeError, OSError):
            pass


def store_address() -> str:
    return f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"


def open_store(timeout: float):
    """A client of the launcher's c10d store, its keys under this run's own prefix (torchrun's run id and restart
    count, so a restarted worker group does not read the beats of the one before)."""
    from torch.distributed import PrefixStore, TCPStore

    store = TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                     timeout=datetime.timedelta(seconds=timeout), wait_for_workers=False)
    run = f"{os.environ.get('TORCHELASTIC_RUN_ID', 'run')}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    return PrefixStore(f"finetune/watchdog/{run}/", store)


@contextmanager
def watching_ranks(args):
    """While the block runs on a launched rank: it dies with its launcher, and a ring neighbour silent for
    `ddp_timeout` ends it in one line. A collective that raises meanwhile (the backend's own timeout) is named the
    same way when a neighbour is silent. A no-op for a single process."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size < 2 or "MASTER_ADDR" not in os.environ or "LOCAL_RANK" not in os.environ:
        yield None
        return
    parent = die_with_parent()
    try:
        store = open_store(args.ddp_timeout)
    except (RuntimeError, OSError) as error:
        raise RecipeError(f"rank {launched_rank()} cannot reach the launcher's store at {store_address()} "
                          f"({str(error).splitlines()[0]}): start the run with `accelerate launch` or torchrun."
                          ) from None
    watchdog = RankWatchdog(store, launched_rank(), world_size, float(args.ddp_timeout), parent)
    watchdog.beat()
    watchdog.thread.start()
    try:
        yield watchdog
    except RecipeError:
        raise
    except Exception as error:
        # The backend's timeout fires at about the time the beats say who is silent: name the silent rank rather
        # than print the backend's message, which names none.
        try:
            silent = watchdog.silent_neighbours(3 * watchdog.interval)
        except (RuntimeError, OSError):
            silent = []
        if silent:
            raise RecipeError(f"{watchdog.silence_message(silent)} ({type(error).__name__}: "
                              f"{str(error).splitlines()[0] if str(error) else ''})") from error
        raise
    finally:
        watchdog.stop()
