"""Preemption that saves: on SIGTERM (a preempted node, a SLURM job reaching its time limit) every rank saves a
complete checkpoint at the step it is at and the run exits, to be resumed with `resume_from_checkpoint: auto`.

The launcher forwards SIGTERM to its workers and SIGKILLs them after its shutdown timeout (torch.distributed.elastic:
`TORCH_ELASTIC_SHUTDOWN_TIMEOUT`, 30 s by default; `finetune train --gpus N` and the SLURM script raise it to
PREEMPTION_GRACE for a run that saves on preemption, and rank 0 says so when a launch left it at torch's default);
SLURM signals every process of the job step itself. Ranks receive
it at slightly different moments, so at each step's end they all-reduce (MAX) a one-int "stop requested" flag and
agree on the step; then Trainer's control flags make them save together (the mixin's `_save_checkpoint` marks the
checkpoint complete once every rank has written its part) and stop. Without `save_on_preemption` SIGTERM keeps its
default action: the run stops and the newest complete checkpoint stays as it was.

Either way, and on Ctrl-C, the run ends in one line (`Interrupted`, from rank 0; the others exit quietly) naming the
newest complete checkpoint and how to resume, with the status a shell gives a process the signal ended (128 + its
number: 130 for Ctrl-C, 143 for SIGTERM), instead of a traceback from every rank.
"""

from __future__ import annotations

import contextlib
import signal
import threading

from transformers import TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from finetune.errors import RecipeError
from finetune.launch.grace import (
    PREEMPTION_GRACE,
    SHUTDOWN_TIMEOUT_VARIABLES,
    TORCH_SHUTDOWN_TIMEOUT,
    grace_named,
    launcher_grace,
    saves_on_preemption,
)

RESUME = "--resume_from_checkpoint auto"  # the recipe key `resume_from_checkpoint: auto` on the command line
SIGNAL_NAMES = {signal.SIGINT: "Ctrl-C (SIGINT)", signal.SIGTERM: "SIGTERM"}


class Interrupted(RecipeError):
    """A signal ended the run; `exit_status` is what a shell reports for a process that signal ended."""

    def __init__(self, message: str, signum: int = signal.SIGTERM):
        super().__init__(message)
        self.exit_status = 128 + int(signum)


class Preempted(Interrupted):
    """The run was asked to stop (SIGTERM) and saved a checkpoint to resume from."""


class _Stop(BaseException):
    """SIGTERM, raised where the rank is as Ctrl-C raises KeyboardInterrupt (not an Exception: nothing catches it on
    the way out)."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def _raise_stop(signum, frame):
    raise _Stop(signum)


@contextlib.contextmanager
def ending_in_one_line_on_signals(output_dir: str, rank: int):
    """Ctrl-C or SIGTERM inside the block ends the run in one line on rank 0, naming the newest complete checkpoint
    in `output_dir` and the resume key; the other ranks exit with the same status and print nothing. (SIGTERM under
    `save_on_preemption` saves first: `PreemptionCallback` holds the signal while training.)"""
    on_main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _raise_stop) if on_main_thread else None
    try:
        yield
    except Interrupted as said:  # preempted: rank 0 says it
        if rank != 0:
            raise SystemExit(said.exit_status) from None
        raise
    except KeyboardInterrupt:
        signum = signal.SIGINT
    except _Stop as stop:
        signum = stop.signum
    else:
        return
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    _leave_process_group()
    if rank != 0:
        raise SystemExit(128 + int(signum))
    raise Interrupted(stopped_message(SIGNAL_NAMES.get(signum, f"signal {signum}"), output_dir), signum) from None


def stopped_message(by: str, output_dir: str) -> str:
    from finetune.checkpoints.complete import newest_complete_checkpoint

    newest, _ = newest_complete_checkpoint(output_dir)
    if newest is None:
        return f"stopped by {by}: no complete checkpoint in {output_dir} yet, so a new run starts from the beginning."
    return f"stopped by {by}: {newest} is the newest complete checkpoint; resume from it with `{RESUME}`."


def _leave_process_group() -> None:
    """A group left alive aborts the interpreter at exit (gloo's threads)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def save_on_preemption(args) -> bool:
    """`save_on_preemption`, on by default under SLURM, whose time limit ends a job with SIGTERM."""
    return saves_on_preemption(args.save_on_preemption)


class PreemptionCallback(TrainerCallback):
    """Turns SIGTERM into a checkpoint at the step every rank agrees on, and then a `Preempted` error."""

    def __init__(self):
        self.requested = False
        self.stop_step: int | None = None
        self.previous_handler = None

    def request_stop(self, signum, frame) -> None:
        self.requested = True  # acted on at the next step's end: a signal handler must not enter a collective

    def on_train_begin(self, args, state, control, **kwargs):
        if threading.current_thread() is threading.main_thread():
            self.previous_handler = signal.signal(signal.SIGTERM, self.request_stop)
        if state.is_world_process_zero and launcher_grace() is not None and not grace_named():
            print(f"warning: save_on_preemption: the launcher kills the ranks {TORCH_SHUTDOWN_TIMEOUT} s after "
                  "SIGTERM (torch's default), and the rest of a step and a checkpoint must fit in that: set "
                  f"{SHUTDOWN_TIMEOUT_VARIABLES[1]}={PREEMPTION_GRACE} in the launcher's environment (`finetune train "
                  "RECIPE.yaml --gpus N` and scripts/slurm/finetune.sbatch do) and have SIGTERM sent that long before "
                  "the end (SLURM: `--signal=TERM@120`).", flush=True)

    def on_train_end(self, args, state, control, **kwargs):
        if self.previous_handler is not None:
            signal.signal(signal.SIGTERM, self.previous_handler)
            self.previous_handler = None

    def on_step_end(self, args, state, control, **kwargs):
        if self.stop_requested_on_any_rank(args):
            self.stop_step = state.global_step
            control.should_save = True
            control.should_training_stop = True
        return control

    def stop_requested_on_any_rank(self, args) -> bool:
        if args.world_size < 2:
            return self.requested
        import torch
        import torch.distributed as dist

        flag = torch.tensor([int(self.requested)], device=args.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)  # one int a step: every rank stops at the same step
        return bool(flag.item())

    def on_save(self, args, state, control, **kwargs):
        if self.stop_step is None or state.global_step != self.stop_step:
            return control
        if args.world_size > 1:
            import torch.distributed as dist

            dist.barrier()  # the checkpoint is marked complete (on every node that saves) before any rank exits
            dist.destroy_process_group()  # a group left alive aborts the interpreter at exit (gloo's threads)
        self.on_train_end(args, state, control)
        raise Preempted(f"preempted at step {state.global_step}: {PREFIX_CHECKPOINT_DIR}-{state.global_step} saved in "
                        f"{args.output_dir}; resume with `{RESUME}`.")
