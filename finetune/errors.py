"""The one exception type for user mistakes, and the helper that prints it once.

A `RecipeError` names the key, file or value at fault and the fix. The CLI prints it in one line and
exits with status 2; tracebacks are kept for the toolkit's own bugs.
"""

from __future__ import annotations

import difflib
import os
import sys
import time


class RecipeError(ValueError):
    """A mistake in what the user asked for: a bad key, file, value or combination."""


def did_you_mean(name: str, choices) -> str:
    matches = difflib.get_close_matches(name, list(choices), n=1, cutoff=0.75)
    return f" (did you mean `{matches[0]}`?)" if matches else ""


def launched_rank() -> int:
    """The global rank a launcher gave this process, readable before any process group exists."""
    return int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")))


# How long a rank other than 0 waits before reporting an error itself. When every rank hits the same error, rank 0
# reports it and exits at once, and the launcher stops the others meanwhile: the error is printed once. Exiting at
# once instead, a rank could make the launcher kill rank 0 before it printed anything.
OTHER_RANKS_WAIT_SECONDS = 5.0


def report_user_error(error: Exception) -> int:
    """Prints the error once (by rank 0 of a launched job; by another rank only if rank 0 did not stop it first, as
    when the error is that rank's alone) and returns the exit status."""
    rank = launched_rank()
    if rank != 0:
        time.sleep(OTHER_RANKS_WAIT_SECONDS)
    print(f"finetune: error: {'' if rank == 0 else f'(rank {rank}) '}{error}", file=sys.stderr, flush=True)
    return getattr(error, "exit_status", 2)  # a run a signal stopped: 128 + the signal (checkpoints.preemption)


class TrainingDiverged(RecipeError):
    """The loss or gradient norm became NaN or infinite: the learning rate, the precision or the data need changing."""


class ChildTimedOut(RuntimeError):
    """A launched child process (a test's or the bench's run) ran past its timeout; the message holds its output."""
