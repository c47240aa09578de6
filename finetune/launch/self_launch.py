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

from finetune.errors import RecipeError
from finetune.launch.commands import as_typed
from finetune.launch.devices import Gpu

LAUNCH_PLAN_ENV = "FINETUNE_LAUNCH_PLAN"  # the plan a self-launch hands its ranks (JSON), read into effective_config
DEFAULT_MAIN_PORT = 29500
GiB = 1024**3


def under_a_launcher(environ=None) -> bool:
    """Whether a launcher started this process: torchrun and `accelerate launch` set WORLD_SIZE (one process under
    `accelerate launch` gets ACCELERATE_MIXED_PRECISION only), a self-launch its plan."""
    environ = os.environ if environ is None else environ
    return any(name in environ for name in ("WORLD_SIZE", "LOCAL_RANK", "ACCELERATE_MIXED_PRECISION", LAUNCH_PLAN_ENV))


def launch_plan(environ=None) -> dict | None:
    """The plan a self-launch handed this rank (None when the run was launched by hand)."""
    import json

    text = (os.environ if environ is None else environ).get(LAUNCH_PLAN_ENV)
    if not text:
        return None
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        raise RecipeError(f"{LAUNCH_PLAN_ENV} is set but is not the JSON a self-launch writes: unset it.") from None


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
    return options, rest


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
    wanted = options.gpus or (int(environ["SLURM_GPUS_ON_NODE"]) if slurm and environ.get("SLURM_GPUS_ON_NODE")
                              else None)
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
    nodes = options.nnodes or (int(environ.get("SLURM_NNODES", "1")) if slurm else 1)
    node_rank = options.node_rank if options.node_rank is not None else (
        int(environ.get("SLURM_NODEID", "0")) if slurm else 0)
    main_addr, main_port = options.main_addr, options.main_port
    if nodes > 1:
        main_addr = main_addr or (first_slurm_host(environ) if slurm else None)
        if main_addr is None:
            raise RecipeError(f"`--nnodes {nodes}` needs the main machine's address: `--main-addr HOST` (the same on "
                              "every node), or run under SLURM.")
        main_port = main_port or (int(environ["SLURM_JOB_ID"]) % 10000 + 20000 if slurm else DEFAULT_MAIN_PORT)
        if not 0 <= node_rank < nodes:
            raise RecipeError(f"`--node-rank {node_rank}` is not in 0..{nodes - 1} (`--nnodes {nodes}`).")
    return Machine(processes, gpus[0] if gpus else None, float(memory), source, host_gib if gpus else None, nodes,
                   node_rank, main_addr, main_port)


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


def replace_with(command: list[str], plan_json: str, machine: Machine, timeout: float) -> None:
    """Prints the command and becomes it: after the nodes' meeting (several nodes), this process is the launcher."""
    print(f"launch: {as_typed(command)}", flush=True)
    if machine.nodes > 1:
        from finetune.launch.rendezvous import meet

        names = meet(machine.main_addr, machine.main_port, machine.nodes, machine.node_rank, timeout)
        print(f"launch: all {machine.nodes} nodes arrived ({', '.join(names)})", flush=True)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(command[0], command, {**os.environ, LAUNCH_PLAN_ENV: plan_json})
