"""The launch half of `finetune train RECIPE.yaml` with no launcher around it: this machine (its GPUs, or CPU processes
standing in for them, and its place among several nodes), the options that say so, and Accelerate's own launcher
that this process becomes.

The command (`finetune.plan.launch` chooses the strategy, plans it and builds the command with the shipped files) is
what a user could type by hand, `accelerate launch --config_file ... -m finetune train RECIPE.yaml ...`; it is
printed and then replaces this process (`os.execve`: signals and the exit status are the launcher's). The plan
reaches every rank in `LAUNCH_PLAN_ENV`.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from dataclasses import dataclass

from finetune.errors import RecipeError, launched_rank
from finetune.launch.commands import as_typed
from finetune.launch.devices import Gpu

LAUNCH_PLAN_ENV = "FINETUNE_LAUNCH_PLAN"  # the plan a self-launch hands its ranks (JSON), read into effective_config
DEFAULT_MAIN_PORT = 29500
GiB = 1024**3


# What a launcher sets in its ranks that a shell's leftover exports do not: torchrun's elastic agent (under `accelerate
# launch` too) its run id, `accelerate launch` of one process its precision, DeepSpeed's launcher its node rank, MPI
# its world size. A self-launch becomes `accelerate launch`, so its ranks carry the first two.
LAUNCHER_MARKERS = ("TORCHELASTIC_RUN_ID", "ACCELERATE_MIXED_PRECISION", "CROSS_RANK", "OMPI_COMM_WORLD_SIZE",
                    "PMI_SIZE")
RANK_VARIABLES = ("WORLD_SIZE", "RANK", "LOCAL_RANK")  # any of them makes Trainer start a process group
RENDEZVOUS_VARIABLES = (*RANK_VARIABLES, "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT")


def under_a_launcher(environ=None) -> bool:
    """Whether a launcher started this process: torchrun and `accelerate launch` set WORLD_SIZE (one process under
    `accelerate launch` gets ACCELERATE_MIXED_PRECISION only), a self-launch its plan (this launch's: `launch_plan`).
    Variables no launcher set are `stray_rendezvous_variables`."""
    environ = os.environ if environ is None else environ
    return any(name in environ for name in ("WORLD_SIZE", "LOCAL_RANK", "ACCELERATE_MIXED_PRECISION")) \
        or launch_plan(environ) is not None


def stray_rendezvous_variables(environ=None) -> list[str]:
    """The rendezvous variables in an environment no launcher made (left over from another job's shell: `WORLD_SIZE=2
    RANK=0` makes Trainer wait `ddp_timeout` for ranks nobody starts); none under a launcher, or srun starting the
    job step's tasks itself."""
    environ = os.environ if environ is None else environ
    if not any(name in environ for name in RANK_VARIABLES) or any(name in environ for name in LAUNCHER_MARKERS):
        return []
    if "SLURM_STEP_ID" in environ and environ.get("SLURM_STEP_NUM_TASKS") == environ.get("WORLD_SIZE"):
        return []  # `srun -n N python -m finetune train ...` with RANK from SLURM_PROCID: srun is the launcher
    return [name for name in RENDEZVOUS_VARIABLES if name in environ]


def check_no_stray_rendezvous(environ=None) -> None:
    """Stops a `finetune train` whose environment asks for a process group that no launcher started."""
    environ = os.environ if environ is None else environ
    stray = stray_rendezvous_variables(environ)
    if stray:
        raise RecipeError(
            f"{' '.join(f'{name}={environ[name]}' for name in stray)} set, but no launcher started this process (left "
            f"from another job?): unset them (`unset {' '.join(stray)}`) to run here, or launch with `accelerate "
            "launch` or torchrun, which set them for every rank.")


def launch_plan(environ=None) -> dict | None:
    """The plan a self-launch handed this rank: None when the run was launched by hand, or when the plan in the
    environment is not this launch's (one left in a shell: its launcher is neither this process nor its parent)."""
    import json

    text = (os.environ if environ is None else environ).get(LAUNCH_PLAN_ENV)
    if not text:
        return None
    try:
        plan = json.loads(text)
    except json.JSONDecodeError:
        raise RecipeError(f"{LAUNCH_PLAN_ENV} is set but is not the JSON a self-launch writes: unset it.") from None
    return plan if is_this_launchs_plan(plan) else None


def is_this_launchs_plan(plan) -> bool:
    """A self-launch's plan names its launcher's process: the one `finetune train` became (`os.execve` keeps the
    pid; its ranks are its children) or, for one process run here, this very process."""
    return isinstance(plan, dict) and plan.get("launcher_pid") in (os.getpid(), os.getppid())


def drop_a_stray_launch_plan(environ=None) -> None:
    """A plan in the environment that no self-launch of this run wrote is named and dropped, not recorded as the
    run's plan."""
    environ = os.environ if environ is None else environ
    if environ.get(LAUNCH_PLAN_ENV) and launch_plan(environ) is None:
        del environ[LAUNCH_PLAN_ENV]
        if launched_rank() == 0:
            print(f"warning: ignoring {LAUNCH_PLAN_ENV} from the environment: no self-launch of this run wrote it "
                  f"(left from another run?); `unset {LAUNCH_PLAN_ENV}` to silence this.", flush=True)


def add_launch_options(parser) -> None:
    """The options of a self-launch (on `finetune train`'s parser too, for its --help); every other `--key value`
    on the command line is a recipe key."""
    parser.add_argument("--gpus", type=int, help="processes on this machine: its GPUs (default: all it sees); on a "
                                                 "machine without GPUs, CPU processes standing in for them (default: "
                                                 "1, run here without a launcher)")
    parser.add_argument("--gpu-memory", type=float, metavar="GiB",
                        help="memory per GPU that `strategy: auto` plans for (default: the GPU's; on CPU processes, "
                             "the machine's RAM shared among them)")
    parser.add_argument("--nnodes", type=int, help="machines in the launch (default: SLURM_NNODES, else 1)")
    parser.add_argument("--node-rank", type=int, help="this machine's rank, 0 on the main one (default: SLURM_NODEID)")
    parser.add_argument("--main-addr", help="the main machine's address (default: the first host of SLURM's list)")
    parser.add_argument("--main-port", type=int,
                        help=f"the main machine's port (default: one per SLURM job, else {DEFAULT_MAIN_PORT})")
    parser.add_argument("--rendezvous-timeout", type=float, default=300.0,
                        help="seconds every node has to arrive before the launch (several nodes; default 300)")
    parser.add_argument("--dry-run", action="store_true", help="print the plan and the launch command, run nothing")


def launch_options_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    add_launch_options(parser)
    return parser


def split_launch_options(overrides: list[str], given: argparse.Namespace | None = None
                         ) -> tuple[argparse.Namespace, list[str]]:
    """The self-launch options among the recipe overrides, and the overrides without them; `given`: those already
    parsed before the recipe (`finetune train --gpus 2 R.yaml`), which argparse keeps unless repeated."""
    options, rest = launch_options_parser().parse_known_args(overrides, namespace=given)
    for name in ("gpus", "nnodes"):
        value = getattr(options, name)
        if value is not None and value < 1:
            raise RecipeError(f"`--{name} {value}` must be at least 1.")
    if options.gpu_memory is not None and options.gpu_memory <= 0:
        raise RecipeError(f"`--gpu-memory {options.gpu_memory:g}` must be positive (GiB per GPU).")
    if options.main_port is not None:
        check_port(options.main_port, "--main-port")
    return options, rest


def check_port(port: int, option: str) -> None:
    """A TCP port a node listens on or connects to (Accelerate and c10d's store otherwise fail deep inside)."""
    if not 1 <= port <= 65535:
        raise RecipeError(f"`{option} {port}` is not a TCP port: give one in 1..65535 (e.g. {DEFAULT_MAIN_PORT}).")


def slurm_number(environ, name: str, default: int | None = None) -> int | None:
    """A whole number SLURM put in the environment (SLURM_NNODES, SLURM_NODEID, ...), named when it is not one."""
    text = environ.get(name)
    if not text:
        return default
    try:
        return int(text)
    except ValueError:
        raise RecipeError(f"{name}={text!r} is not a whole number: fix or unset it, or give the launch option "
                          "itself (`--nnodes`, `--node-rank`, `--gpus`, `--main-port`).") from None


def launch_requested(options: argparse.Namespace) -> bool:
    return any(getattr(options, name) is not None for name in ("gpus", "gpu_memory", "nnodes", "node_rank",
                                                               "main_addr", "main_port")) or options.dry_run


@dataclass(frozen=True)
class Machine:
    """Where a self-launch runs: processes on this machine, over how many machines, and the memory each process
    is planned with."""

    processes_per_node: int
    gpu: Gpu | None                # None: CPU processes stand in for GPUs
    memory_gib: float              # per process, for the plan
    memory_source: str
    host_memory_gib: float | None  # RAM of this machine, for offload and loading (GPU machines)
    nodes: int = 1
    node_rank: int = 0
    main_addr: str | None = None
    main_port: int | None = None
    visible_gpus: int = 0          # GPUs this process sees (CUDA_VISIBLE_DEVICES)

    @property
    def cpu(self) -> bool:
        return self.gpu is None

    @property
    def processes(self) -> int:
        return self.processes_per_node * self.nodes

    def describe(self) -> str:
        where = (f"{self.processes_per_node} CPU process(es) standing in for GPUs" if self.cpu
                 else f"{self.processes_per_node} × {self.gpu.name}")
        return where + (f" on each of {self.nodes} nodes (this is node {self.node_rank})" if self.nodes > 1 else "")


def this_machine(options: argparse.Namespace, environ=None) -> Machine:
    """The machine a self-launch runs on, from its options, SLURM's variables and what torch sees."""
    import psutil

    from finetune.launch.devices import visible_gpus

    environ = os.environ if environ is None else environ
    gpus = visible_gpus()
    slurm = "SLURM_JOB_ID" in environ
    wanted = options.gpus or (slurm_number(environ, "SLURM_GPUS_ON_NODE") if slurm else None)
    if gpus and wanted is not None and wanted > len(gpus):
        raise RecipeError(f"`--gpus {wanted}` but this machine sees {len(gpus)} GPU(s) ({gpus[0].name}); give at most "
                          f"{len(gpus)}, or check CUDA_VISIBLE_DEVICES.")
    processes = wanted or len(gpus) or 1
    host_gib = psutil.virtual_memory().total / GiB
    if gpus:
        memory, source = (options.gpu_memory, "--gpu-memory") if options.gpu_memory else (gpus[0].memory_gib,
                                                                                       f"the {gpus[0].name}")
    else:
        memory, source = (options.gpu_memory, "--gpu-memory") if options.gpu_memory else (
            host_gib / processes, f"this machine's {host_gib:.1f} GiB of RAM over {processes} process(es)")
    nodes = options.nnodes or (slurm_number(environ, "SLURM_NNODES", 1) if slurm else 1)
    node_rank = options.node_rank if options.node_rank is not None else (
        slurm_number(environ, "SLURM_NODEID", 0) if slurm else 0)
    if not 0 <= node_rank < nodes:
        raise RecipeError(f"`--node-rank {node_rank}` is not in 0..{nodes - 1} (`--nnodes {nodes}`): node ranks count "
                          "from 0 on the main node.")
    main_addr, main_port = options.main_addr, options.main_port
    if nodes > 1:
        main_addr = main_addr or (first_slurm_host(environ) if slurm else None)
        if main_addr is None:
            raise RecipeError(f"`--nnodes {nodes}` needs the main machine's address: `--main-addr HOST` (the same on "
                              "every node), or run under SLURM.")
        main_port = main_port or (slurm_number(environ, "SLURM_JOB_ID") % 10000 + 20000 if slurm else DEFAULT_MAIN_PORT)
    return Machine(processes, gpus[0] if gpus else None, float(memory), source, host_gib if gpus else None, nodes,
                   node_rank, main_addr, main_port, len(gpus))


def first_slurm_host(environ) -> str | None:
    """The first host of the job's node list, as `scontrol show hostnames` expands it (the main node)."""
    node_list = environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST")
    if not node_list:
        return None
    try:
        names = subprocess.run(["scontrol", "show", "hostnames", node_list], capture_output=True, text=True,
                               check=True, timeout=30).stdout.split()
    except (OSError, subprocess.SubprocessError):
        raise RecipeError(f"cannot expand SLURM's node list `{node_list}` with `scontrol show hostnames`: give "
                          "`--main-addr HOST`.") from None
    return names[0] if names else None


def replace_with(command: list[str], plan_json: str, machine: Machine, timeout: float,
                 environment: dict[str, str] | None = None) -> None:
    """Prints the command and becomes it, with `environment` added to this process's: after the nodes' meeting
    (several nodes), this process is the launcher."""
    environment = environment or {}
    print(f"launch: {as_typed(command, environment)}", flush=True)
    if machine.nodes > 1:
        from finetune.launch.rendezvous import meet

        names = meet(machine.main_addr, machine.main_port, machine.nodes, machine.node_rank, timeout)
        print(f"launch: all {machine.nodes} nodes arrived ({', '.join(names)})", flush=True)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(command[0], command, {**os.environ, **environment, LAUNCH_PLAN_ENV: plan_json})


def first_visible_gpu(environ=None) -> str:
    """The GPU a one-process run on a machine with several takes: the first CUDA_VISIBLE_DEVICES names (an index, a
    UUID or a MIG id, as given), else 0."""
    environ = os.environ if environ is None else environ
    named = [entry.strip() for entry in environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if entry.strip()]
    return named[0] if named else "0"


def run_here_on_one_gpu(command: list[str], plan_json: str, gpu: str) -> None:
    """Becomes `command` (`finetune train` with the recipe) seeing only `gpu`: CUDA reads CUDA_VISIBLE_DEVICES when
    a process first asks it about devices, which planning already did, so the run starts anew (`os.execve`: the same
    pid, which the plan names)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(command[0], command, {**os.environ, "CUDA_VISIBLE_DEVICES": gpu, LAUNCH_PLAN_ENV: plan_json})
