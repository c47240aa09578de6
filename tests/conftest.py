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


# Under pytest-xdist (`make test` runs two workers, one a core) each test file stays whole on one worker, for its
# module-scoped runs; the runs many files read are the catalogue's (tests/catalogue.py), trained once for every
# worker, so their readers spread over the workers instead of queueing on one. The costliest files start first, so
# the last to start is a short one and both workers end together.
LAUNCHING_FIXTURES = ("deepspeed_runs", "ddp_run", "lora_runs", "checkpointed_runs", "catalogue", "trained_demo",
                      "demo_run")


def launch_weight(item) -> float:
    """What a test costs, roughly: a launch for each distributed test or reader of a catalogue row."""
    launches = item.get_closest_marker("distributed") is not None or any(
        name in item.fixturenames for name in LAUNCHING_FIXTURES)
    return 1.0 if launches else 0.05


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Marks each test with its file as its worker group (pytest-xdist's `--dist loadgroup`) and puts the costliest
    files first."""
    weight: dict[Path, float] = {}
    for item in items:
        weight[item.path] = weight.get(item.path, 0.0) + launch_weight(item)
        item.add_marker(pytest.mark.xdist_group(item.path.relative_to(Path(__file__).parent).as_posix()))
    items.sort(key=lambda item: -weight[item.path])  # stable: a file's tests keep their order


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


@pytest.fixture(scope="session")
def catalogue(tmp_path_factory):
    """The session's shared runs (tests/catalogue.py), each trained once for every worker: `catalogue[name]`."""
    from catalogue import Catalogue

    return Catalogue(shared_folder(tmp_path_factory))


def read_run(entry) -> dict:
    """A catalogue row as the DeepSpeed runs' readers take it: effective config, losses, log history, output_dir and
    what the launch printed."""
    from support import assert_succeeded

    assert_succeeded(entry)
    state = json.loads((entry.output_dir / "trainer_state.json").read_text())
    return {
        "effective": json.loads((entry.output_dir / "effective_config.json").read_text()),
        "losses": [record["loss"] for record in state["log_history"] if "loss" in record],
        "log_history": state["log_history"],
        "output_dir": entry.output_dir,
        "output": entry.output,
        "steps": entry.steps,
    }


@pytest.fixture(scope="session")
def deepspeed_runs(catalogue):
    """`deepspeed_runs[key]`: the run's effective config, losses, log history, output_dir, launcher output and step
    count; keys are the CPU-runnable DeepSpeed configs and `zero2_bf16`, `zero3_bf16` (the catalogue's `deepspeed/`
    rows). Each is typed as `accelerate launch`, but `zero3`, which `finetune train --gpus 2 --strategy zero3` launches
    itself (tests/launch/test_self_launch.py); `zero2` is also `checkpointed_runs["zero2"]`."""
    from catalogue import ROWS

    keys = [name.split("/", 1)[1] for name in ROWS if name.startswith("deepspeed/")]
    return LaunchedOnRead({key: (lambda key=key: read_run(catalogue[f"deepspeed/{key}"])) for key in keys})


@pytest.fixture(scope="session")
def ddp_run(catalogue):
    """A short 2-process DDP run (gloo) with an fp16 gradient-compression hook, carrying a deliberately tight launch
    plan (the real plan of this run with half its model states), as a self-launch hands its ranks one; returns its
    output_dir, where `launcher_output.txt` keeps what the launch printed."""
    from support import assert_succeeded

    entry = catalogue["ddp/tight_plan"]
    assert_succeeded(entry)
    return entry.output_dir


@pytest.fixture(scope="session")
def lora_runs(catalogue):
    """Short 2-process LoRA runs of the demo recipe under DDP, ZeRO-2 and ZeRO-3 (`lora_runs[name]`: its output_dir,
    with what the launch printed beside it in `<output_dir>.log`), each launched when first read."""
    from support import CPU_LAUNCHES, PLANTED_TOKEN, assert_succeeded

    def read(name: str) -> Path:
        entry = catalogue[f"lora/{name}"]
        assert_succeeded(entry)
        assert PLANTED_TOKEN not in entry.output
        return entry.output_dir

    return LaunchedOnRead({name: (lambda name=name: read(name)) for name in CPU_LAUNCHES})


@pytest.fixture(scope="session")
def checkpointed_runs(catalogue):
    """`checkpointed_runs[name]`: the output_dir of a 2-process run of the demo recipe under CPU_LAUNCHES[name] with
    complete checkpoints at steps 3 and 6 (support.CHECKPOINTED_RUN), shared by the resume and untrusted-checkpoint
    tests: read it, copy it before changing anything in it."""
    from support import CPU_LAUNCHES, assert_succeeded

    def read(name: str) -> Path:
        entry = catalogue[f"checkpointed/{name}"]
        assert_succeeded(entry)
        return entry.output_dir

    return LaunchedOnRead({name: (lambda name=name: read(name)) for name in CPU_LAUNCHES})


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
def demo_run(catalogue):
    """The main job exactly as `make demo` runs it on a machine without GPUs (the catalogue's `demo` row): its
    output_dir and the launch's result (returncode, output)."""
    entry = catalogue["demo"]
    return SimpleNamespace(output_dir=entry.output_dir, result=entry)


@pytest.fixture(scope="session")
def trained_demo(demo_run):
    """The demo's trained model (reverse exact match >= 0.9 on the eval split): chat answers with it (test_chat.py),
    DPO starts from it (test_dpo.py), as a user's preference run starts from their SFT run."""
    from support import assert_succeeded

    assert_succeeded(demo_run.result)
    return demo_run.output_dir
