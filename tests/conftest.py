import json
import os
import sys
import tempfile
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

# Tests never reach a hub; everything they load is built in code or written to a temporary directory.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Under pytest-xdist (`make test`: one worker a core) a worker's in-process training and every run it starts take one
# thread a process: two workers' OpenMP pools on two cores would spin against each other.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
# DeepSpeed compiles its CPU ops (the shared-memory collective, CPU Adam) on first use, about a minute each, into
# torch's extension folder, and compiles them again whenever the folder holds a build against another environment's
# torch: a folder inside the environment keeps two checkouts on one machine from rebuilding each other's ops at every
# launch, and is where `make install` builds CPU Adam beforehand on a machine without a GPU (scripts/install.sh).
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path(sys.prefix) / "torch_extensions"))
# Every child finds this environment's tools first, as an activated environment would: the `ninja` those ops compile
# with included. Two ninja versions (the environment's and the system's) hash a build command differently, so runs
# alternating between them would recompile both ops at each switch.
os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"


# The session fixtures that launch training runs: the tests reading one share its runs, so under pytest-xdist
# (`make test` runs two workers, one per core: a launch leaves a core idle while its launcher and ranks start and stop)
# the test files reading the same one go to the same worker, and each file stays whole on one worker for its
# module-scoped runs.
# The demo run is not among them: it is trained once for every worker (`demo_run`), so its readers (chat, and every
# method that starts from the SFT'd model) spread over the workers instead of queueing on one.
LAUNCHING_SESSION_FIXTURES = ("deepspeed_runs", "ddp_run", "lora_runs", "checkpointed_runs")


def worker_groups(items) -> dict[str, str]:
    """Test file -> its worker group: files joined while they read a launching session fixture in common."""
    group = {item.path: item.path for item in items}

    def root(path):
        while group[path] != path:
            path = group[path]
        return path

    first_reader: dict[str, Any] = {}
    for item in items:
        for name in LAUNCHING_SESSION_FIXTURES:
            if name in item.fixturenames:
                other = first_reader.setdefault(name, item.path)
                group[root(item.path)] = root(other)
    return {path: root(path).relative_to(Path(__file__).parent).as_posix() for path in group}


def launch_weight(item) -> float:
    """What a test costs, roughly: a launch for each distributed test or reader of a launching fixture."""
    launches = item.get_closest_marker("distributed") is not None or any(
        name in item.fixturenames for name in LAUNCHING_SESSION_FIXTURES)
    return 1.0 if launches else 0.05


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Marks each test with its worker group (pytest-xdist's `--dist loadgroup`) and puts the costliest groups first,
    so the last group to start is a short one and both workers end together."""
    groups = worker_groups(items)
    weight: dict[str, float] = {}
    for item in items:
        weight[groups[item.path]] = weight.get(groups[item.path], 0.0) + launch_weight(item)
        item.add_marker(pytest.mark.xdist_group(groups[item.path]))
    items.sort(key=lambda item: -weight[groups[item.path]])  # stable: a group's tests keep their order


# Every process a test starts that pays the imports again (a launch, `python -m finetune`, a launch script) is
# counted, by the test file that started it; the suite's summary says how many, against the launches forked.
def pytest_configure(config):
    from finetune.testing.warm_launch import count_processes_started

    if os.environ.get("PYTEST_XDIST_WORKER") or not config.pluginmanager.hasplugin("xdist") or \
            config.getoption("numprocesses", None) in (None, 0):
        config.processes_log = Path(tempfile.mkdtemp(prefix="processes_")) / "started.jsonl"
        count_processes_started(config.processes_log)
    config.processes = {"forked": 0, "started": [], "real": []}


def processes_of_this_session(config) -> dict:
    import support

    started = []
    for log in (getattr(config, "processes_log", None), support.warm_launcher().processes_log if support._warm else
                None):
        if log is not None and Path(log).is_file():
            started += [json.loads(line) for line in Path(log).read_text().splitlines()]
    started = [entry for entry in started if "finetune.testing.warm_launch" not in entry["command"]]
    return {"forked": support._warm.launches if support._warm else 0, "started": started, "real": support.REAL_RUNS}


def pytest_sessionfinish(session):
    if hasattr(session.config, "workeroutput"):  # a pytest-xdist worker: its counts go to the controller
        session.config.workeroutput["processes"] = json.dumps(processes_of_this_session(session.config))
    elif getattr(session.config, "processes_log", None) is not None:
        session.config.processes = processes_of_this_session(session.config)


def pytest_testnodedown(node, error):
    worker = json.loads(getattr(node, "workeroutput", {}).get("processes", '{"forked": 0, "started": [], "real": []}'))
    for key in ("forked", "started", "real"):
        node.config.processes[key] += worker[key]


def pytest_terminal_summary(terminalreporter, config):
    counts = config.processes
    by_file: dict[str, int] = {}
    for entry in counts["started"]:
        name = entry["test"].split("::")[0] or "(a session fixture)"
        by_file[name] = by_file.get(name, 0) + 1
    terminalreporter.write_sep("-", f"{len(counts['started'])} processes started that import again (launches, "
                                    f"`python -m finetune`, launch scripts); {counts['forked']} forked from the warm "
                                    "process")
    why: dict[str, set] = {}
    for entry in counts["real"]:  # the runs support.run did not fork; the others are the tests' own subprocesses
        why.setdefault(entry["test"].split("::")[0], set()).add(entry["why"])
    for name, count in sorted(by_file.items(), key=lambda item: -item[1]):
        reasons = "; ".join(sorted(why.get(name, ()))) or "started by the test itself"
        terminalreporter.write_line(f"{count:4d}  {name} ({reasons})")


@pytest.fixture(autouse=True)
def launcher_tier(request):
    """Tests marked `launcher` start real launches (support.run); the others fork them from the warm process."""
    import support

    support.LAUNCHER_TIER = request.node.get_closest_marker("launcher") is not None
    yield
    support.LAUNCHER_TIER = False


class LaunchedOnRead(Mapping):
    """Session runs by name, each launched the first time its key is read and kept: a test asking for one run pays
    for that run only. A launch that failed fails every test that reads it, without launching again."""

    def __init__(self, launchers: dict[str, Callable[[], Any]]):
        self._launchers = launchers
        self._results: dict[str, tuple[bool, Any]] = {}

    def __getitem__(self, key: str) -> Any:
        if key not in self._results:
            launch = self._launchers[key]  # an unknown key is a KeyError, as in any mapping
            try:
                self._results[key] = (True, launch())
            except Exception as error:  # kept and raised again for each reader
                self._results[key] = (False, error)
        succeeded, value = self._results[key]
        if not succeeded:
            raise value
        return value

    def __iter__(self) -> Iterator[str]:
        return iter(self._launchers)

    def __len__(self) -> int:
        return len(self._launchers)


# One 2-process demo run per CPU-runnable DeepSpeed config (fp32, the CPU default), plus two in bf16 mixed
# precision, shared by the strategy and memory tests so the start-up cost is paid once per config.
BF16_RUNS = ["zero2", "zero3"]
# The fp32 ZeRO-3 run also leaves a checkpoint (ZeRO shards) for the export tests.
# It also scores the final model with lm-eval when training ends (tests/train/test_harness.py).
EXTRA_ARGS = {"zero3": ("--save_strategy", "steps", "--save_steps", "3", "--eval_harness_tasks", "synthetic_add")}
SELF_LAUNCHED = {"zero3"}  # launched by `finetune train --strategy zero3` itself, not typed


@pytest.fixture(scope="session")
def deepspeed_runs(tmp_path_factory):
    """`deepspeed_runs[key]`: the run's effective config, losses, log history, output_dir and launcher output; keys
    are the CPU-runnable DeepSpeed configs and `zero2_bf16`, `zero3_bf16`. Each is typed as `accelerate launch`, but
    `zero3`, which `finetune train --gpus 2 --strategy zero3` launches itself (tests/launch/test_self_launch.py)."""
    from support import CPU_RUNNABLE_DEEPSPEED, DEMO_SHORT_RUN, assert_succeeded, launch_demo, run

    from finetune.launch.commands import finetune_command

    def launcher(name: str, key: str, extra: tuple[str, ...]):
        def launch() -> dict:
            output_dir = tmp_path_factory.mktemp(key)
            if key in SELF_LAUNCHED:
                result = run(finetune_command("train", "recipes/demo.yaml", "--gpus", "2", "--strategy", name,
                                              "--output_dir", str(output_dir), *DEMO_SHORT_RUN, *extra,
                                              *EXTRA_ARGS.get(key, ())))
            else:
                result = launch_demo("accelerate_configs/cpu_deepspeed_zero2.yaml", output_dir, *extra,
                                     *EXTRA_ARGS.get(key, ()), deepspeed_json=f"deepspeed_configs/{name}.json")
            assert_succeeded(result)
            state = json.loads((output_dir / "trainer_state.json").read_text())
            return {
                "effective": json.loads((output_dir / "effective_config.json").read_text()),
                "losses": [entry["loss"] for entry in state["log_history"] if "loss" in entry],
                "log_history": state["log_history"],
                "output_dir": output_dir,
                "output": result.output,
            }
        return launch

    runs = [*((name, name, ()) for name in CPU_RUNNABLE_DEEPSPEED),
            *((name, f"{name}_bf16", ("--bf16", "true")) for name in BF16_RUNS)]
    return LaunchedOnRead({key: launcher(name, key, extra) for name, key, extra in runs})


@pytest.fixture(scope="session")
def ddp_run(tmp_path_factory):
    """A short 2-process DDP run (gloo) with an fp16 gradient-compression hook, carrying a deliberately tight launch
    plan (the real plan of this run with half its model states), as a self-launch hands its ranks one; returns its
    output_dir, where `launcher_output.txt` keeps what the launch printed."""
    from support import DEMO_SHORT_RUN, assert_succeeded, run

    from finetune.launch.commands import Launch
    from finetune.launch.self_launch import LAUNCH_PLAN_ENV, Machine
    from finetune.plan.launch import plan_launch

    output_dir = tmp_path_factory.mktemp("ddp")
    _, plan, _ = plan_launch("recipes/demo.yaml", [*DEMO_SHORT_RUN, "--ddp_comm_hook", "fp16", "--strategy", "ddp"],
                             Machine(2, None, 16.0, "the test", None))
    plan["predicted"]["model_states_bytes"] //= 2
    # handed as a self-launch hands it: naming the launcher process, whose ranks alone trust it
    command = Launch("accelerate_configs/cpu_ddp.yaml").command(
        "train", "recipes/demo.yaml", "--output_dir", str(output_dir), *DEMO_SHORT_RUN, "--ddp_comm_hook", "fp16")
    become_launcher = ("import json, os, sys; plan = json.loads(sys.argv[1]) | {'launcher_pid': os.getpid()}; "
                       f"os.execve(sys.argv[2], sys.argv[2:], {{**os.environ, {LAUNCH_PLAN_ENV!r}: json.dumps(plan)}})")
    result = run([sys.executable, "-c", become_launcher, json.dumps(plan), *command])
    assert_succeeded(result)
    (output_dir / "launcher_output.txt").write_text(result.output)
    return output_dir


@pytest.fixture(scope="session")
def lora_runs(tmp_path_factory):
    """Short 2-process LoRA runs of the demo recipe under DDP, ZeRO-2 and ZeRO-3 (`lora_runs[name]`: its output_dir,
    with what the launch printed beside it in `<output_dir>.log`), each launched when first read."""
    from support import CPU_LAUNCHES, LORA_DEMO_RUN, PLANTED_TOKEN, assert_succeeded, launch_demo

    def launcher(name: str):
        def launch():
            output_dir = tmp_path_factory.mktemp(f"lora_{name}")
            # The DDP run's log is read for library warnings, some of which a fresh interpreter prints as it imports
            # (test_self_launch.py): its processes are real.
            result = launch_demo(CPU_LAUNCHES[name], output_dir, *LORA_DEMO_RUN, env={"HF_TOKEN": PLANTED_TOKEN},
                                 real=name == "ddp")
            assert_succeeded(result)
            assert PLANTED_TOKEN not in result.output
            output_dir.with_name(f"{output_dir.name}.log").write_text(result.output)  # outside the run's own files
            return output_dir
        return launch

    return LaunchedOnRead({name: launcher(name) for name in CPU_LAUNCHES})


@pytest.fixture(scope="session")
def checkpointed_runs(tmp_path_factory):
    """`checkpointed_runs[name]`: the output_dir of a 2-process run of the demo recipe under CPU_LAUNCHES[name] with
    complete checkpoints at steps 3 and 6 (support.CHECKPOINTED_RUN), shared by the resume and untrusted-checkpoint
    tests: read it, copy it before changing anything in it."""
    from support import CHECKPOINTED_RUN, CPU_LAUNCHES, assert_succeeded, launch_demo

    def launcher(name: str):
        def launch():
            output_dir = tmp_path_factory.mktemp(f"checkpointed_{name}")
            assert_succeeded(launch_demo(CPU_LAUNCHES[name], output_dir, *CHECKPOINTED_RUN))
            return output_dir
        return launch

    return LaunchedOnRead({name: launcher(name) for name in CPU_LAUNCHES})


@pytest.fixture(scope="session")
def hub_model_dir(tmp_path_factory):
    """A hub-like checkpoint (tests/hub_fixtures.py): Qwen2-shaped, bf16 safetensors, BPE tokenizer, ChatML template
    with tools."""
    from hub_fixtures import save_hub_model

    return save_hub_model(tmp_path_factory.mktemp("hub_chatml"), "chatml")


def shared_folder(tmp_path_factory) -> Path:
    """A folder every pytest-xdist worker of this session sees (their base folders' parent; without xdist, the
    session's own)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@pytest.fixture(scope="session")
def demo_run(tmp_path_factory):
    """The main job exactly as `make demo` runs it on a machine without GPUs: `finetune train recipes/demo.yaml --gpus
    2`, which launches itself on 2 CPU processes under the recipe's DeepSpeed ZeRO-2, 1500 steps. Returns its
    output_dir and the launcher's output. Trained once for the session: the first worker to ask trains it under a lock
    (both cores busy with its 2 processes), the others wait and read it."""
    from filelock import FileLock
    from support import run

    from finetune.launch.commands import finetune_command

    shared = shared_folder(tmp_path_factory)
    output_dir, record = shared / "demo", shared / "demo_run.json"
    with FileLock(str(shared / "demo_run.lock")):
        if not record.is_file():
            command = finetune_command("train", "recipes/demo.yaml", "--gpus", "2", "--output_dir", str(output_dir))
            result = run(command, timeout=900)
            record.write_text(json.dumps({"args": [str(arg) for arg in result.args], "returncode": result.returncode,
                                          "output": result.output}))
    return SimpleNamespace(output_dir=output_dir, result=SimpleNamespace(**json.loads(record.read_text())))


@pytest.fixture(scope="session")
def trained_demo(demo_run):
    """The demo's trained model (reverse exact match >= 0.9 on the eval split): chat answers with it (test_chat.py),
    DPO starts from it (test_dpo.py), as a user's preference run starts from their SFT run."""
    from support import assert_succeeded

    assert_succeeded(demo_run.result)
    return demo_run.output_dir
