"""Checkpoints that resume safely: a checkpoint counts as complete only once every rank has finished saving it.

Trainer writes a checkpoint's files in place, so a run killed mid-save leaves a folder that looks like a
checkpoint. After each save, all ranks meet and rank 0 writes `finetune_complete.json` into the folder;
`resume_from_checkpoint: auto` takes the newest folder that has it and names each newer one it skips.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from accelerate import PartialState
from transformers import TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from finetune.errors import RecipeError

COMPLETE_MARKER = "finetune_complete.json"
CHECKPOINT_NAME = re.compile(rf"^{PREFIX_CHECKPOINT_DIR}-(\d+)$")


class CompleteCheckpointCallback(TrainerCallback):
    """Marks a checkpoint complete once every rank has saved its part of it."""

    def on_save(self, args, state, control, **kwargs):
        folder = Path(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
        PartialState().wait_for_everyone()
        if state.is_world_process_zero and folder.is_dir():
            marker = {"step": state.global_step, "world_size": args.world_size}
            (folder / COMPLETE_MARKER).write_text(json.dumps(marker) + "\n")


def checkpoints_newest_first(output_dir: str | Path) -> list[Path]:
    folders = [p for p in Path(output_dir).iterdir() if p.is_dir() and CHECKPOINT_NAME.match(p.name)]
    return sorted(folders, key=lambda p: int(CHECKPOINT_NAME.match(p.name).group(1)), reverse=True)


def newest_complete_checkpoint(output_dir: str | Path) -> tuple[Path | None, list[Path]]:
    """The newest complete checkpoint in `output_dir` (or None) and the newer, incomplete ones skipped."""
    if not os.path.isdir(output_dir):
        return None, []
    skipped = []
    for folder in checkpoints_newest_first(output_dir):
        if (folder / COMPLETE_MARKER).is_file():
            return folder, skipped
        skipped.append(folder)
    return None, skipped


def check_explicit_checkpoint(path: str) -> None:
    """An explicit `resume_from_checkpoint` must be a checkpoint Trainer finished writing."""
    folder = Path(path)
    if not folder.is_dir():
        raise RecipeError(f"`resume_from_checkpoint: {path}` is not a checkpoint directory; give one, or auto.")
    if not (folder / "trainer_state.json").is_file() and not (folder / COMPLETE_MARKER).is_file():
        raise RecipeError(f"`resume_from_checkpoint: {path}` is incomplete (no trainer_state.json): its save was "
                          "interrupted. Resume from an earlier checkpoint, or use auto to pick the newest complete one.")
