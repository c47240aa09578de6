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


# Keys whose change between a run and its resumption is expected, not worth a warning.
RESUME_KEYS_IGNORED = {"resume_from_checkpoint", "output_dir"}


def recipe_values(recipe) -> dict[str, str]:
    """The value of every key the user set (recipe file, command line or batch plan), as text."""
    values = {}
    for section in (recipe.model, recipe.data, recipe.lora, recipe.training):
        for key in recipe.sources:
            if hasattr(section, key) and key not in RESUME_KEYS_IGNORED:
                values[key] = str(getattr(section, key))
    return values


class CompleteCheckpointCallback(TrainerCallback):
    """Marks a checkpoint complete once every rank has saved its part of it, with the recipe it was trained by."""

    def __init__(self, recipe_values: dict[str, str] | None = None):
        self.recipe_values = recipe_values or {}

    def on_save(self, args, state, control, **kwargs):
        folder = Path(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
        PartialState().wait_for_everyone()
        if state.is_world_process_zero and folder.is_dir():
            marker = {"step": state.global_step, "world_size": args.world_size, "recipe": self.recipe_values}
            (folder / COMPLETE_MARKER).write_text(json.dumps(marker, indent=2) + "\n")


def recipe_changes(checkpoint: Path, now: dict[str, str]) -> list[str]:
    """`key: then → now` for every recipe key that differs from the one the checkpoint was trained with."""
    marker = checkpoint / COMPLETE_MARKER
    if not marker.is_file():
        return []
    then = json.loads(marker.read_text()).get("recipe", {})
    return [f"{key}: {then.get(key, 'default')} → {now.get(key, 'default')}"
            for key in sorted(set(then) | set(now)) if then.get(key) != now.get(key)]


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


# Globals Trainer's and DeepSpeed's own checkpoint files reference besides tensors (numpy RNG state, DeepSpeed's
# ZeRO stage enum and loss scaler). Anything else in a pickle could run code when loaded.
SAFE_GLOBALS = {"numpy.ndarray", "numpy.dtype", "numpy.core.multiarray._reconstruct",
                "numpy._core.multiarray._reconstruct", "deepspeed.utils.tensor_fragment.fragment_address"}
SAFE_GLOBAL_PREFIXES = ("numpy.dtypes.", "deepspeed.runtime.zero.config.", "deepspeed.runtime.fp16.loss_scaler.")
PICKLE_SUFFIXES = (".pt", ".pth", ".bin")


def check_checkpoint_files(folder: str | Path) -> None:
    """Refuses a checkpoint whose pickled files reference anything but tensors and the known state classes, read
    without unpickling (`torch.serialization.get_unsafe_globals_in_checkpoint`): DeepSpeed loads its own files
    with `weights_only=False`, so this is the check that keeps a planted payload from running."""
    import torch

    for path in sorted(Path(folder).rglob("*")):
        if path.suffix not in PICKLE_SUFFIXES or path.name == "training_args.bin":  # never loaded to resume
            continue
        try:
            names = torch.serialization.get_unsafe_globals_in_checkpoint(str(path))
        except Exception as error:  # not a torch zip file at all
            raise RecipeError(f"{path} is not a readable checkpoint file ({error}); refusing to resume from it.") from None
        unsafe = [name for name in names if name not in SAFE_GLOBALS and not name.startswith(SAFE_GLOBAL_PREFIXES)]
        if unsafe:
            raise RecipeError(f"{path} references {', '.join(unsafe[:3])}, which is not checkpoint state; refusing "
                              "to load it (a pickled file can run code). Resume from a checkpoint you trust.")
