"""Launches and one-process runs started by fork from a warm process, for the tests: the same commands the suite would
start as subprocesses, without paying the imports (torch, Transformers, Accelerate, datasets, peft, TRL, DeepSpeed,
finetune: 6-20 s a process) again in the launcher and in each rank.

One warm process per test process (`WarmLauncher`) imports everything a run imports and nothing else: no thread, no
torch op, no process group (`assert_fork_discipline`). For each command it forks a child that becomes the program:
- `python -m finetune ARGS` (or any `-m module` / script): the child runs the module as `__main__`, as the interpreter
  would, and exits with its status;
- `python -m finetune.launch.accelerate_launch ARGS` (`accelerate launch`): the child runs Accelerate's launcher itself,
  unchanged: it reads the config, computes every rank's environment with its own helpers (`prepare_multi_gpu_env`,
  `prepare_deepspeed_cmd_env`) and hands the launch to torch's elastic agent, which gives each rank its elastic
  variables (RANK, LOCAL_RANK, TORCHELASTIC_ERROR_FILE, ...). The one change (`_ranks_by_fork`): the agent starts the
  ranks by fork, each running the interpreter's arguments it would have exec'd (`-u -m finetune ...`) in the warm
  interpreter, instead of a new interpreter.
What a process reads from its environment at import (HF_HOME, OMP_NUM_THREADS, ...) is the warm process's: a command
whose environment changes such a variable runs as a subprocess instead (`read_at_import`).

The output (stdout and stderr, merged, as `finetune.testing.subprocesses.run` keeps it) goes to a file; the result
has the same fields (`args`, `returncode`, `output`, `stdout`). A timeout kills the child's process group.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

from finetune.errors import ChildTimedOut
from finetune.testing.subprocesses import OUTPUT_TAIL, child_environment

# What a run imports, loaded once in the warm process (a module's own imports follow it).
WARM_MODULES = (
    "torch", "torch.distributed.run", "torch.distributed.elastic.multiprocessing", "transformers",
    "transformers.trainer", "accelerate", "accelerate.commands.launch", "datasets", "peft", "trl", "deepspeed",
    "finetune.cli", "finetune.commands.train", "finetune.train.run",
)  # not the modules run as `__main__` (`-m finetune.launch.accelerate_launch`): runpy warns when one is loaded
# Classes behind Transformers' and TRL's lazy modules, loaded by first use.
WARM_ATTRIBUTES = (
    ("transformers", ("AutoModelForCausalLM", "AutoTokenizer", "LlamaForCausalLM", "Qwen2ForCausalLM",
                      "PreTrainedTokenizerFast", "Trainer", "TrainingArguments")),
    ("trl", ("SFTTrainer", "SFTConfig")),
)
# Environment variables read when a process starts or a library is imported (the C allocator's tunables, a cache
# folder, a thread count, offline mode): a command that changes one runs as a subprocess, where they are read afresh.
READ_AT_IMPORT = ("HF_", "HUGGINGFACE_", "TRANSFORMERS_", "DATASETS_", "TORCH", "PYTORCH_", "OMP_", "MKL_", "KMP_",
                  "TOKENIZERS_", "PYTHON", "DS_", "CUDA", "LD_", "MALLOC_", "GLIBC_", "XDG_", "TRITON_",
                  "ACCELERATE_")
READ_AT_CALL = ("HF_TOKEN", "ACCELERATE_")  # read each time they are needed
# Defaults libraries write into the environment when imported (DeepSpeed, torch's inductor), in the test process as in
# a fresh one: not a difference.
SET_BY_IMPORTS = ("PYTORCH_NVML_BASED_CUDA_CHECK", "TORCHINDUCTOR_CACHE_DIR", "KMP_DUPLICATE_LIB_OK",
                  "HF_XET_HIGH_PERFORMANCE")


# The interpreter arguments of Accelerate's launcher as finetune runs it: its ranks are forked
ACCELERATE_LAUNCH = ["-m", "finetune.launch.accelerate_launch"]


def read_at_import(env: dict[str, str], warm_env: dict[str, str]) -> list[str]:
    """The variables `env` sets differently from the warm process's environment that a library reads at import."""
    changed = {key for key in set(env) | set(warm_env) if env.get(key) != warm_env.get(key)}
    return sorted(key for key in changed if key.startswith(READ_AT_IMPORT) and not key.startswith(READ_AT_CALL)
                  and key not in SET_BY_IMPORTS)


def starts_python(command) -> bool:
    """A process of this interpreter, or a launcher or launch script: what pays the imports again."""
    command = [str(part) for part in command]
    name = os.path.basename(command[0]) if command else ""
    return (name.startswith("python") or command[:1] == [sys.executable]
            or name in ("torchrun", "accelerate", "srun", "finetune") or name.endswith(".sh"))


def count_processes_started(log: str | Path) -> None:
    """From now on, each process this one starts that pays the imports again appends its command to `log` (an audit
    hook: `subprocess` and `os.exec*` raise the events)."""
    def hook(event: str, args) -> None:
        if event == "subprocess.Popen" and starts_python(args[1]) or event == "os.exec" and starts_python(args[1]):
            with open(log, "a") as out:
                out.write(json.dumps({"command": [str(part) for part in args[1]],
                                      "test": os.environ.get("PYTEST_CURRENT_TEST", "")}) + "\n")

    sys.addaudithook(hook)


def forkable(command: list[str]) -> bool:
    """`python -m MODULE ARGS` or `python SCRIPT.py ARGS` with this interpreter."""
    command = [str(part) for part in command]
    return (len(command) >= 2 and command[0] == sys.executable
            and (command[1] == "-m" and len(command) >= 3 or command[1].endswith(".py")))


# ---------------------------------------------------------------------------------------------------- the warm side

def assert_fork_discipline() -> None:
    """Nothing that does not survive a fork: one thread (ours), no process group, no CUDA."""
    import threading

    import torch

    threads = [thread.name for thread in threading.enumerate()]
    assert threads == ["MainThread"], f"the warm process runs threads {threads}: a fork would copy their locks"
    assert not torch.distributed.is_initialized(), "the warm process holds a process group"
    assert not torch.cuda.is_initialized(), "the warm process initialized CUDA, which a fork cannot share"


def warm_up() -> dict[str, str]:
    """Imports what a run imports; returns the variables those imports set in the environment (DeepSpeed's
    PYTORCH_NVML_BASED_CUDA_CHECK), which a fresh interpreter's imports would set again."""
    import importlib
    import warnings

    before = dict(os.environ)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a rank's own imports would warn once each; the warm process keeps no record
        for name in WARM_MODULES:
            importlib.import_module(name)
        for module, attributes in WARM_ATTRIBUTES:
            for attribute in attributes:
                getattr(importlib.import_module(module), attribute)
    # The warnings filters and "warned once" records are the rank's to make, as in a fresh interpreter.
    for module in list(sys.modules.values()):
        registry = getattr(module, "__warningregistry__", None)
        if isinstance(registry, dict):
            registry.clear()
    warnings.onceregistry.clear()
    assert_fork_discipline()
    return {key: value for key, value in os.environ.items() if before.get(key) != value}


def fresh_signal_handlers() -> None:
    """The handlers a new interpreter starts with (a fork keeps its parent's: the elastic agent's SIGTERM handler would
    raise in a rank it stops, where a new interpreter just ends)."""
    for number in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGCHLD, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(number, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)  # as Python sets it at start-up


def run_as_python(argv: list[str]) -> int:
    """Runs the interpreter arguments `argv` (`[-u] -m MODULE ARGS` or `[-u] SCRIPT ARGS`) in this process, as
    `python ARGV` runs them, and returns the exit status: the program's `sys.exit`, 1 with the traceback printed for an
    uncaught exception; then what an interpreter does when it ends (waiting for threads, atexit)."""
    import atexit
    import runpy
    import threading
    import traceback

    argv = list(argv)
    unbuffered = os.environ.get("PYTHONUNBUFFERED") not in (None, "")
    while argv and argv[0] == "-u":
        unbuffered = True
        argv.pop(0)
    for stream in (sys.stdout, sys.stderr):
        stream.reconfigure(write_through=unbuffered, line_buffering=not unbuffered)
    tempfile.tempdir = None  # read TMPDIR afresh
    status = 0
    try:
        if argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]
            sys.path[0] = os.getcwd()
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = argv
            sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as stop:
        status = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
        if stop.code is not None and not isinstance(stop.code, int):
            print(stop.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - as the interpreter reports any uncaught exception
        traceback.print_exc()
        status = 1
    threading._shutdown()  # the interpreter's end: non-daemon threads first, then atexit
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    return status


def _ranks_by_fork(without: tuple[str, ...] = ()) -> None:
    """In the launcher: torch's elastic agent starts each rank by fork, running in it the interpreter arguments it
    would have exec'd. Everything else of the launch (its configuration, each rank's environment, the rendezvous,
    watching and stopping the ranks, the closing summary) is Accelerate's and torch's own code. `without`: variables
    taken out of each rank's environment (a planted difference, for the test that would see it)."""
    import logging

    import torch.distributed.run as distrib_run
    from torch.distributed.launcher.api import _get_entrypoint_name

    planned = distrib_run.config_from_args

    def config_from_args(args):
        config, command, command_args = planned(args)
        if command != sys.executable:
            return config, command, command_args  # not an interpreter (`--no_python`): exec'd as it is

        def rank(*argv: str):
            for name in without:
                os.environ.pop(name, None)
            fresh_signal_handlers()
            status = run_as_python(list(argv))
            if status != 0:
                raise SystemExit(status)  # the agent reads the rank's exit status, as it reads a binary's

        rank.__name__ = rank.__qualname__ = _get_entrypoint_name(command, command_args)  # the summary's title
        config.start_method = "fork"
        return config, rank, command_args

    distrib_run.config_from_args = config_from_args

    class AsForBinary(logging.Filter):
        """The agent's line about a failed rank as it reads for a binary (no traceback of its fork machinery)."""

        def filter(self, record: logging.LogRecord) -> bool:
            if isinstance(record.msg, str) and record.msg.startswith("failed (exitcode: %s) local_rank: %s (pid: %s)"
                                                                     " of fn: %s"):
                record.msg = "failed (exitcode: %s) local_rank: %s (pid: %s) of binary: %s"
                record.args = (*record.args[:3], sys.executable)
                record.exc_info = record.exc_text = None
            return True

    logging.getLogger("torch.distributed.elastic.multiprocessing.api").addFilter(AsForBinary())


def _watch(request: dict, connection: socket.socket) -> None:
    """In the forked child: start the program in a child of its own and report how it ended (its exit status, or minus
    the signal that ended it, as `subprocess` reports it), even when the program execs another (a self-launch)."""
    os.setpgid(0, 0)  # a timeout stops this process and every one the program starts
    fresh_signal_handlers()
    connection.sendall(f"group {os.getpid()}\n".encode())
    program = os.fork()
    if program == 0:
        connection.close()
        status = 1
        try:
            status = _become(request)
        finally:
            os._exit(status)
    _, wait_status = os.waitpid(program, 0)
    connection.sendall(f"status {os.waitstatus_to_exitcode(wait_status)}\n".encode())


def _become(request: dict) -> int:
    """Become the requested program, with its environment, folder and output; returns its exit status."""
    count_processes_started(request["processes"])  # the real launch a self-launch starts, say
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    for key, value in request["set_by_imports"].items():
        os.environ.setdefault(key, value)
    output = os.open(request["output"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(output, 1)
    os.dup2(output, 2)
    os.close(output)
    os.close(null)
    argv = request["argv"][1:]
    without = tuple(request.get("without", ()))
    if argv[:2] == ACCELERATE_LAUNCH:
        _ranks_by_fork(without)
    else:
        _launcher_in_place(without)
    return run_as_python(argv)


def _stop_tqdm_monitor() -> None:
    """Stops tqdm's monitor thread, which the first progress bar of a tqdm class starts (and keeps on that class)."""
    import threading

    for thread in threading.enumerate():
        if thread.name == "tqdm_monitor" and hasattr(thread, "tqdm_cls"):
            thread.exit()
            thread.tqdm_cls.monitor = None


def _launcher_in_place(without: tuple[str, ...]) -> None:
    """A self-launch (`finetune train --gpus N`) execs `python -m finetune.launch.accelerate_launch ...` in its own
    process (finetune.launch.self_launch.replace_with). From now on such an exec becomes that launcher here, forking
    its ranks, instead of a new interpreter that imports everything again: in the same process (the launch plan names
    its pid, which `execve` keeps), with the exec's environment, a new interpreter's signal handlers and no exit
    handler of the program it replaces. Any other exec, one whose environment changes a variable read at import, or
    one from a process running threads, execs for real."""
    import atexit
    import threading

    real_execve = os.execve

    def execve(path, args, env):
        args = [str(arg) for arg in args]
        _stop_tqdm_monitor()
        if (str(path) != sys.executable or args[1:3] != ACCELERATE_LAUNCH
                or read_at_import(dict(env), dict(os.environ)) or threading.active_count() != 1):
            return real_execve(path, args, env)
        os.environ.clear()
        os.environ.update(env)
        atexit._clear()
        fresh_signal_handlers()
        _ranks_by_fork(without)
        os._exit(run_as_python(args[1:]))

    os.execve = execve


def serve(address: str) -> None:
    """The warm process: warms up, says so on stdout, then forks a child for each request on `address` until the
    process that started it ends."""
    set_by_imports = warm_up()
    parent = os.getppid()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(address)
    listener.listen(8)
    print("ready", flush=True)
    while os.getppid() == parent:
        try:
            while os.waitpid(-1, os.WNOHANG)[0]:
                pass
        except ChildProcessError:
            pass
        if not select.select([listener], [], [], 0.1)[0]:
            continue
        connection, _ = listener.accept()
        request = json.loads(connection.makefile("r").readline()) | {"set_by_imports": set_by_imports}
        assert_fork_discipline()
        sys.stdout.flush()
        sys.stderr.flush()
        if os.fork() == 0:
            listener.close()
            try:
                _watch(request, connection)
            finally:
                os._exit(0)
        connection.close()


# -------------------------------------------------------------------------------------------------- the test's side

class WarmLauncher:
    """The client: starts the warm process on first use and runs commands through it."""

    def __init__(self):
        self._process: subprocess.Popen | None = None
        self._folder = Path(tempfile.mkdtemp(prefix="warm_launch_"))
        self._address = str(self._folder / "socket")
        self._warm_env: dict[str, str] = {}
        self.launches = 0  # commands forked
        self.processes_log = str(self._folder / "processes.jsonl")  # the processes they started (a self-launch's)

    def start(self) -> None:
        if self._process is not None and self._process.poll() is None:
            return
        self._warm_env = child_environment()
        if os.path.exists(self._address):
            os.unlink(self._address)
        self._process = subprocess.Popen([sys.executable, "-m", "finetune.testing.warm_launch", self._address],
                                         env=self._warm_env, stdout=subprocess.PIPE, text=True,
                                         stderr=open(self._folder / "warm.log", "w"))
        said = []
        for line in self._process.stdout:  # what the imports print (DeepSpeed's accelerator), then "ready"
            if line.strip() == "ready":
                return
            said.append(line)
        raise RuntimeError(f"the warm process did not start: {''.join(said)[-3000:]}"
                           f"{(self._folder / 'warm.log').read_text()[-3000:]}")

    def stop(self) -> None:
        if self._process is not None and self._process.poll() is None:
            self._process.kill()
            self._process.wait()

    def why_not(self, command: list[str], env: dict[str, str]) -> str | None:
        """Why `command` with `env` must run as a subprocess, or None."""
        if not forkable(command):
            return "not `python -m MODULE` or `python SCRIPT.py`"
        changed = read_at_import(env, self._warm_env or child_environment())
        return f"sets {', '.join(changed)}, read at import" if changed else None

    def run(self, command: list[str], timeout: float = 600, env: dict | None = None, cwd: str | Path | None = None,
            without: tuple[str, ...] = ()):
        """As `finetune.testing.subprocesses.run`, forked from the warm process; `without`: variables taken out of
        each launched rank's environment (a planted difference)."""
        self.start()
        child_env = child_environment(env)
        command = [str(part) for part in command]
        output_file = tempfile.NamedTemporaryFile(dir=self._folder, suffix=".out", delete=False).name
        request = {"argv": command, "env": child_env, "cwd": str(cwd or os.getcwd()), "output": output_file,
                   "without": list(without), "processes": self.processes_log}
        self.launches += 1
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as connection:
            connection.settimeout(timeout)  # the whole run: the two lines are its first and last words
            connection.connect(self._address)
            connection.sendall((json.dumps(request) + "\n").encode())
            lines = connection.makefile("r")
            group = int(lines.readline().split()[1])
            try:
                line = lines.readline()
            except TimeoutError:
                _kill_group(group)
                tail = _taken(output_file)[-OUTPUT_TAIL:]
                raise ChildTimedOut(f"timed out after {timeout}s: {' '.join(command)}\n{tail}") from None
        returncode = int(line.split()[1]) if line.startswith("status ") else -signal.SIGKILL  # killed before it said
        _wait_group_gone(group)
        output = _taken(output_file)
        return SimpleNamespace(args=command, returncode=returncode, output=output, stdout=output, forked=True)


def _taken(output_file: str) -> str:
    """A run's output, its file removed."""
    output = Path(output_file).read_text(errors="replace")
    os.unlink(output_file)
    return output


def _kill_group(group: int) -> None:
    try:
        os.killpg(group, signal.SIGKILL)
    except ProcessLookupError:
        pass
    _wait_group_gone(group)


def _wait_group_gone(group: int, timeout: float = 30) -> None:
    """Until no process of the run's group is left (a rank still closing)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.killpg(group, 0)
        except (ProcessLookupError, PermissionError):
            return
        time.sleep(0.05)


if __name__ == "__main__":
    serve(sys.argv[1])
