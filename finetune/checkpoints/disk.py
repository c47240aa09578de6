"""Saves that meet a full disk, or a folder that stops accepting files (permissions taken away, a file system
remounted read-only): stopped before they start when the free space cannot hold them, else named in one line, with
the half-written folder removed so that the newest complete checkpoint stays the newest.

Why: PyTorch's zip writer reports a full disk in its own words. A checkpoint whose optimizer.pt lands on a full
device (measured, torch.save through Trainer) ends in `RuntimeError: [enforce fail at inline_container.cc:672] .
unexpected pos 64 vs 0`, raised while handling `RuntimeError: basic_ios::clear: iostream error`: never "no space
left". safetensors quotes the OSError inside a `SafetensorError`, and PyTorch's distributed checkpoint (FSDP) wraps
each rank's failure in a `CheckpointException`.
"""

from __future__ import annotations

import errno
import shutil
from contextlib import contextmanager
from pathlib import Path

from accelerate.utils import convert_bytes as human_bytes

from finetune.checkpoints.complete import (
    CHECKPOINT_NAME,
    checkpoints_newest_first,
    is_complete,
    newest_complete_checkpoint,
)
from finetune.errors import RecipeError

DISK_FULL_ERRNOS = {errno.ENOSPC, errno.EDQUOT}
# How a failed write reads once a library has turned the OSError into text: PyTorch's zip writer
# (caffe2/serialize/inline_container.cc) and its iostream, the OS message safetensors and others quote, and numpy's
# short write (`ndarray.tofile`, GGUF's tensors: an OSError without errno, "4096 requested and 2000 written").
FAILED_WRITE_TEXTS = ("unexpected pos", "file write failed", "PytorchStreamWriter failed writing", "basic_ios::clear",
                      "No space left on device", "Disk quota exceeded", " requested and ")
# A folder that refuses files: permissions (EACCES; EPERM for an immutable file or folder) or a read-only mount.
UNWRITABLE_ERRNOS = {errno.EACCES, errno.EPERM, errno.EROFS}
UNWRITABLE_TEXTS = ("Permission denied", "Operation not permitted", "Read-only file system")


def folder_bytes(folder: str | Path) -> int:
    """The bytes of the files under `folder` (symbolic links not followed); 0 when it does not exist."""
    files = (path for path in Path(folder).rglob("*") if path.is_file() and not path.is_symlink())
    return sum(path.stat().st_size for path in files)


def trainable_parameter_bytes(model) -> int:
    """A cheap lower bound of what a save writes from this rank: its trainable parameters (with LoRA the adapters
    only; a full checkpoint adds the optimizer states)."""
    return sum(parameter.numel() * parameter.element_size() for parameter in model.parameters()
               if parameter.requires_grad)


def needed_checkpoint_bytes(output_dir: str | Path, fallback_bytes: int) -> int:
    """What the next checkpoint will take: the size of the newest complete one in `output_dir`, else the caller's
    estimate `fallback_bytes`."""
    newest, _ = newest_complete_checkpoint(output_dir)
    return folder_bytes(newest) if newest is not None else fallback_bytes


def free_bytes(folder: Path) -> int:
    """The free space of the filesystem that holds `folder`, read at its nearest existing parent."""
    existing = folder.absolute()
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    return shutil.disk_usage(existing).free


def _failed_write(error: BaseException, errnos: set[int], texts: tuple[str, ...]) -> str | None:
    """How a write failed, when it failed with one of `errnos` (or, once a library turned the OSError into text, one
    of `texts`): the OS's words; else None."""
    if isinstance(error, OSError) and error.errno is not None:
        return (error.strerror or str(error)) if error.errno in errnos else None
    if type(error).__name__ == "CheckpointException":  # torch.distributed.checkpoint: one failure per rank
        failures = (_failed_write(failure, errnos, texts) for failure, _ in getattr(error, "failures", {}).values())
        return next((reason for reason in failures if reason), None)
    if isinstance(error, (RuntimeError, OSError)) or type(error).__name__ == "SafetensorError":
        return next((text for text in texts if text in str(error)), None)
    return None


def is_disk_full(error: BaseException) -> bool:
    """Whether `error` is a write that failed for want of space, in the words of the OS or of the library that
    wrapped it."""
    return _failed_write(error, DISK_FULL_ERRNOS, FAILED_WRITE_TEXTS) is not None


def unwritable_reason(error: BaseException) -> str | None:
    """Why the folder refused the write ("Permission denied", "Read-only file system", ...), else None."""
    return _failed_write(error, UNWRITABLE_ERRNOS, UNWRITABLE_TEXTS)


def newest_kept_checkpoint(folder: Path) -> Path | None:
    """The newest complete checkpoint other than `folder`, beside it (a checkpoint) or in it (an output_dir)."""
    checkpoints_dir = folder.parent if CHECKPOINT_NAME.match(folder.name) else folder
    if not checkpoints_dir.is_dir():
        return None
    return next((checkpoint for checkpoint in checkpoints_newest_first(checkpoints_dir)
                 if checkpoint != folder and is_complete(checkpoint)), None)


def what_was_kept(folder: Path) -> str:
    newest = newest_kept_checkpoint(folder)
    return (f"the newest complete checkpoint, {newest}, is untouched (`resume_from_checkpoint: auto` continues from "
            "it)" if newest is not None else "no earlier checkpoint was touched")


def no_space_error(folder: Path, needed_bytes: int, what: str) -> RecipeError:
    return RecipeError(f"no space left on {folder}: {human_bytes(free_bytes(folder))} free, {what} needs "
                       f"~{human_bytes(needed_bytes)}. Free space there or lower `save_total_limit`; "
                       f"{what_was_kept(folder)}.")


def unwritable_error(folder: Path, reason: str, what: str) -> RecipeError:
    return RecipeError(f"cannot save {what} in {folder}: {reason.lower()} (the folder or its file system stopped "
                       "accepting files). Make it writable again (permissions, a read-only mount), or train into "
                       f"another `output_dir`; {what_was_kept(folder)}.")


@contextmanager
def saving_within_free_space(folder: str | Path, needed_bytes: int, what: str = "checkpoint"):
    """Around a save into `folder`: stops before it when the disk has less than `needed_bytes` free, and turns a
    write that fails for want of space into the same one-line RecipeError, and one the folder refuses (permissions, a
    read-only file system) into one naming that, after removing `folder` if the save created it. Any other error
    passes through as it is."""
    folder = Path(folder)
    if free_bytes(folder) < needed_bytes:
        raise no_space_error(folder, needed_bytes, what)
    existed = folder.exists()
    try:
        yield
    except BaseException as error:  # CheckpointException derives from BaseException
        full, refused = is_disk_full(error), unwritable_reason(error)
        if not full and not refused:
            raise
        if not existed:  # a half-written checkpoint: would look like the newest, and holds the space
            shutil.rmtree(folder, ignore_errors=True)
        if full:
            raise no_space_error(folder, needed_bytes, what) from None
        raise unwritable_error(folder, refused, what) from None
