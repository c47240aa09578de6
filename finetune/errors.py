"""The one exception type for user mistakes, and the helper that prints it once.

A `RecipeError` names the key, file or value at fault and the fix. The CLI prints it in one line and
exits with status 2; tracebacks are kept for the toolkit's own bugs.
"""

from __future__ import annotations

import difflib
import os
import sys


class RecipeError(ValueError):
    """A mistake in what the user asked for: a bad key, file, value or combination."""


def did_you_mean(name: str, choices) -> str:
    matches = difflib.get_close_matches(name, list(choices), n=1, cutoff=0.75)
    return f" (did you mean `{matches[0]}`?)" if matches else ""


def launched_rank() -> int:
    """The global rank a launcher gave this process, readable before any process group exists."""
    return int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")))


def report_user_error(error: Exception) -> int:
    """Prints the error once (on rank 0 of a launched job) and returns the exit status."""
    if launched_rank() == 0:
        print(f"finetune: error: {error}", file=sys.stderr, flush=True)
    return 2


class TrainingDiverged(RecipeError):
    """The loss or gradient norm became NaN or infinite: the learning rate, the precision or the data need changing."""
