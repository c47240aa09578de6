"""The time a launcher leaves its ranks between SIGTERM and SIGKILL, which a run that saves on preemption
(finetune.checkpoints.preemption) needs for the rest of a step and a checkpoint.

Between passing SIGTERM on to the ranks and SIGKILLing them, torch's elastic agent (the launcher inside `accelerate
launch` and torchrun) waits its shutdown timeout: torchrun's `--shutdown-timeout` (PET_SHUTDOWN_TIMEOUT), else
TORCH_ELASTIC_SHUTDOWN_TIMEOUT, else 30 s (torch/distributed/launcher/api.py). `finetune train` launching itself and
scripts/slurm/finetune.sbatch give a run that saves on preemption PREEMPTION_GRACE: SLURM's `--signal=TERM@120` less
10 s for the launcher itself. Read without torch: planning a launch imports none.
"""

from __future__ import annotations

import os

from finetune.launch.strategies import is_true


def saves_on_preemption(value, environ=None) -> bool:
    """`save_on_preemption` as the recipe gives it (a flag as YAML or the command line spells it, or unset: on under
    SLURM)."""
    if value is None:
        return "SLURM_JOB_ID" in (os.environ if environ is None else environ)
    return is_true(value)


SHUTDOWN_TIMEOUT_VARIABLES = ("PET_SHUTDOWN_TIMEOUT", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT")
TORCH_SHUTDOWN_TIMEOUT = 30
PREEMPTION_GRACE = 110


def grace_named(environ=None) -> bool:
    """Whether the environment names the launcher's shutdown timeout (else torch's 30 s applies)."""
    environ = os.environ if environ is None else environ
    return any(name in environ for name in SHUTDOWN_TIMEOUT_VARIABLES)


def launcher_grace(environ=None) -> int | None:
    """Seconds this rank's launcher leaves it between SIGTERM and SIGKILL, as the environment it passed on says; None
    where no elastic agent started the process (one process run here, SLURM's own tasks)."""
    environ = os.environ if environ is None else environ
    if "TORCHELASTIC_RUN_ID" not in environ:
        return None
    for name in SHUTDOWN_TIMEOUT_VARIABLES:
        try:
            return int(environ[name])
        except (KeyError, ValueError):
            continue
    return TORCH_SHUTDOWN_TIMEOUT


def grace_for_launch(save_on_preemption_value, environ=None) -> dict[str, str]:
    """What a launch's environment adds for a run that saves on preemption: PREEMPTION_GRACE as the agent's shutdown
    timeout, unless the environment names one already (it wins)."""
    environ = os.environ if environ is None else environ
    if not saves_on_preemption(save_on_preemption_value, environ) or grace_named(environ):
        return {}
    return {SHUTDOWN_TIMEOUT_VARIABLES[1]: str(PREEMPTION_GRACE)}
