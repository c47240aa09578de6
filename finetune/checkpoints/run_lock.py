"""One run per `output_dir`: a second run started on a folder a live run holds stops with one line naming that run,
instead of both exiting 0 with their checkpoints interleaved.

The lock is `flock` on `OUTPUT_DIR/.finetune_run.lock` (`outputs.RUN_LOCK`). The kernel drops a flock when its process
dies, however it dies (SIGKILL and OOM kills included), so a lock is never left held by a dead run; the file also holds
a JSON record of its holder (pid, host, start time, run id, command line) for the message. A run that ends empties the
record, so a non-empty record under a free flock is the trace of a killed run, taken over aloud. The file is never
unlinked: a process that opened it before the unlink would lock a file the next run no longer sees (flock locks the
open file, not the name). Where the filesystem has no flock (some NFS and FUSE mounts: ENOLCK, EOPNOTSUPP, ENOSYS,
EINVAL), the record alone decides, with a warning: a run it names is taken to be alive unless its pid is gone on this
very host.

Under a launcher, the ranks that save (global rank 0, or each node's first process under `save_on_each_node`, whose
node may have its own disk) take the lock, rank 0 first; a node that finds this same run's record (a disk the nodes
share) goes on without it. Every rank then raises the same error if any rank failed, so none enters a collective alone.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import shlex
import socket
import sys
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from accelerate.utils import broadcast_object_list, gather_object, wait_for_everyone

from finetune import outputs
from finetune.errors import RecipeError

# The error numbers of a filesystem without flock (an NFS mount without a lock manager, some FUSE filesystems).
FLOCK_UNSUPPORTED = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL}
# A holder writes its record just after taking the flock: a reader finding it empty or half-written looks again,
# ten times over about a second.
RECORD_ATTEMPTS = 10
RECORD_RETRY_SECONDS = 0.1


@dataclass
class RunLock:
    """The lock file this process holds open; `flocked` is False under the record-only fallback."""

    path: Path
    fd: int
    flocked: bool


@contextmanager
def output_dir_lock(args):
    """Holds `args.output_dir` for this run while the block runs, on every rank of the launch: the saving ranks take
    the lock (rank 0 first), and every rank raises the same RecipeError when one of them could not."""
    run_id = shared_run_id(args)
    lock, failure = None, None
    if args.should_save and args.process_index == 0:
        lock, failure = try_acquire(args.output_dir, run_id)
    if args.world_size > 1:
        wait_for_everyone()  # rank 0 holds the lock (and wrote this run's id in it) before another node looks
    if args.should_save and args.process_index != 0:
        lock, failure = try_acquire(args.output_dir, run_id)
    failures = gather_object([failure]) if args.world_size > 1 else [failure]
    first_failure = next((text for text in failures if text), None)
    if first_failure is not None:
        if lock is not None:
            release(lock)
        raise RecipeError(first_failure)
    try:
        yield
    finally:
        if lock is not None:
            release(lock)


def shared_run_id(args) -> str:
    """A fresh id made by rank 0 and known to every rank: a node meeting it in the lock record knows it is this run."""
    run_id = [uuid.uuid4().hex]
    if args.world_size > 1:
        broadcast_object_list(run_id, from_process=0)
    return run_id[0]


def try_acquire(output_dir, run_id: str) -> tuple[RunLock | None, str | None]:
    """(the lock or None, None) when this rank may go on; (None, the message) when it may not: the message travels to
    every rank."""
    try:
        return acquire(output_dir, run_id), None
    except RecipeError as error:
        return None, str(error)
    except OSError as error:  # the folder or the lock file cannot be made or opened
        return None, (f"cannot lock {lock_path(output_dir)}: {error.strerror or error}. Give this run an output_dir "
                      "it can write.")


def lock_path(output_dir) -> Path:
    return Path(output_dir, outputs.RUN_LOCK)


def acquire(output_dir, run_id: str) -> RunLock | None:
    """Holds `output_dir` for the run `run_id`, or raises a RecipeError naming the run that holds it; None when that
    run is this one (another node of it, on a shared disk): it goes on without holding the lock."""
    path = lock_path(output_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)  # never O_TRUNC: the holder's record is read first
    try:
        lock = hold_or_refuse(fd, path, output_dir, run_id)
    except BaseException:
        os.close(fd)
        raise
    if lock is None:
        os.close(fd)
    return lock


def hold_or_refuse(fd: int, path: Path, output_dir, run_id: str) -> RunLock | None:
    """On the open lock file: the flock (or, on a filesystem without it, the record alone decides), then this run's
    record; a RecipeError naming the holder when another run has it."""
    record_only = False
    try:
        free, holder = flock_or_holder(fd)
    except OSError as error:
        if error.errno not in FLOCK_UNSUPPORTED:
            raise
        print(f"warning: the filesystem of {output_dir} does not support flock ({os.strerror(error.errno)}): "
              f"the run lock falls back to its record {path} alone, which cannot tell whether a run on another host "
              "is still running.", flush=True)
        record_only, holder = True, patient_read(fd)
        free = not holder or stale_without_flock(holder)
    if not free:
        if holder.get("run_id") == run_id:
            return None
        raise RecipeError(refusal(output_dir, path, holder, record_only))
    if holder:
        print(f"taking over the lock left by {name_of(holder)}, which is no longer running", flush=True)
    write_holder(fd, run_id)
    return RunLock(path, fd, flocked=not record_only)


def live_holder(output_dir) -> dict | None:
    """The record of the run holding `output_dir`'s lock now, or None (for readers such as export and chat, which
    take no lock): a shared flock cannot be taken while a run holds it; when it can, it is let go at once."""
    path = lock_path(output_dir)
    if not path.is_file():
        return None
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    except BlockingIOError:
        return read_holder(fd)
    except OSError:  # no flock on this filesystem: nothing tells a live run from a finished one
        return None
    finally:
        os.close(fd)


def flock_or_holder(fd: int) -> tuple[bool, dict]:
    """(True, the record left in the file) once this process holds the flock; (False, the holder's record) while
    another process holds it. An OSError when the filesystem has no flock."""
    holder: dict = {}
    for _ in range(RECORD_ATTEMPTS):
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True, read_holder(fd)
        except BlockingIOError:
            holder = read_holder(fd)
            if complete(holder):
                return False, holder
            time.sleep(RECORD_RETRY_SECONDS)  # held, but the holder is still writing its record (or releasing)
    return False, holder


def patient_read(fd: int) -> dict:
    """The record, read again while it is half-written (the record-only fallback has no flock to wait on)."""
    holder = read_holder(fd)
    for _ in range(RECORD_ATTEMPTS - 1):
        if not holder or complete(holder):
            break
        time.sleep(RECORD_RETRY_SECONDS)
        holder = read_holder(fd)
    return holder


def read_holder(fd: int) -> dict:
    """The JSON record in the lock file: {} when it is empty, {"unreadable": text} when it is not a whole record."""
    text = os.pread(fd, os.fstat(fd).st_size, 0).decode(errors="replace").strip()
    if not text:
        return {}
    try:
        record = json.loads(text)
    except json.JSONDecodeError:
        return {"unreadable": text[:200]}
    return record if isinstance(record, dict) else {"unreadable": text[:200]}


def complete(holder: dict) -> bool:
    return "pid" in holder and "unreadable" not in holder


def stale_without_flock(holder: dict) -> bool:
    """Under the record-only fallback, a record is stale only when its pid is gone on this same host."""
    return complete(holder) and holder.get("host") == socket.gethostname() and not process_is_running(holder["pid"])


def process_is_running(pid) -> bool:
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    except (OverflowError, ValueError):
        return False
    return True


def write_holder(fd: int, run_id: str) -> None:
    record = {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "started": datetime.now().astimezone().isoformat(timespec="seconds"),
        "run_id": run_id,
        "command": command_line(),
    }
    os.ftruncate(fd, 0)  # only now, holding the lock: a waiting run read the old record before
    os.pwrite(fd, (json.dumps(record) + "\n").encode(), 0)
    os.fsync(fd)


def release(lock: RunLock) -> None:
    """Empties the record (the next run then takes the lock without calling this run stale), unlocks and closes;
    the file stays."""
    try:
        os.ftruncate(lock.fd, 0)
        os.fsync(lock.fd)
        if lock.flocked:
            fcntl.flock(lock.fd, fcntl.LOCK_UN)
    finally:
        os.close(lock.fd)


def command_line() -> str:
    """This process's command line, `python -m finetune` shown as `finetune`."""
    argv = list(sys.argv)
    if argv and Path(argv[0]).name == "__main__.py":
        argv[0] = Path(argv[0]).parent.name
    return shlex.join(argv)


def name_of(holder: dict) -> str:
    """'pid P on host H (started T)', or what is known of a holder whose record is missing."""
    if not complete(holder):
        return "a run whose record is " + ("empty" if not holder else f"unreadable ({holder['unreadable']!r})")
    return f"pid {holder['pid']} on host {holder.get('host', '?')} (started {holder.get('started', '?')})"


def refusal(output_dir, path: Path, holder: dict, record_only: bool) -> str:
    if complete(holder):
        who = f"pid {holder['pid']} on host {holder.get('host', '?')}, started {holder.get('started', '?')}"
        if holder.get("command"):
            who += f" ({holder['command']})"
    else:
        who = name_of(holder)
    message = (f"{output_dir} is in use by another run: {who}. Wait for it to finish, or give this run another "
               "output_dir.")
    if record_only:
        message += (f" This filesystem has no flock, so the record in {path} alone marks the folder as in use: if "
                    "that run is gone, delete the file.")
    return message
