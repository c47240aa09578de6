"""A checkpoint's files read as untrusted input, before any loader opens them: every file Trainer's, DeepSpeed's and
PyTorch's loaders will open (symlinks followed as they follow them) must read as what its name says, and no pickle may
reference anything but tensors and known state. Nothing here unpickles or loads a tensor.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from finetune.errors import RecipeError

CHECKPOINT_NAME = re.compile(rf"^{PREFIX_CHECKPOINT_DIR}-(\d+)$")


# Globals Trainer's and DeepSpeed's own checkpoint files reference besides tensors (numpy RNG state, DeepSpeed's
# ZeRO stage enum and loss scaler). Anything else in a pickle could run code when loaded.
SAFE_GLOBALS = {"numpy.ndarray", "numpy.dtype", "numpy.core.multiarray._reconstruct",
                "numpy._core.multiarray._reconstruct", "deepspeed.utils.tensor_fragment.fragment_address"}
SAFE_GLOBAL_PREFIXES = ("numpy.dtypes.", "deepspeed.runtime.zero.config.", "deepspeed.runtime.fp16.loss_scaler.")
PICKLE_SUFFIXES = (".pt", ".pth", ".bin")
# What the `.metadata` of PyTorch's distributed checkpoint (FSDP's shards) references: its loader reads it with
# plain `pickle.load` (torch/distributed/checkpoint/filesystem.py), so it is held to these.
DCP_METADATA = ".metadata"
DCP_SAFE_GLOBALS = {"torch.Size", "torch.serialization._get_layout", "pathlib.PosixPath", "pathlib.WindowsPath",
                    "collections.OrderedDict"}
DCP_SAFE_GLOBAL_PREFIXES = ("torch.distributed.checkpoint.",)
NEVER_LOADED = {"training_args.bin"}  # Trainer writes it; no resume, export or chat reads it back


class UnsafeCheckpointFile(RecipeError):
    """A checkpoint file that could run code when loaded: refused, never skipped over."""


def files_loaders_open(folder: str | Path, skip_checkpoints: bool = False) -> list[Path]:
    """Every file under `folder` as Trainer's, DeepSpeed's and PyTorch's loaders see it: symlinked folders and files
    followed (a `Path.rglob` would not descend into a linked folder), each real folder once (a link back to a folder
    above does not loop). `skip_checkpoints` leaves out the checkpoint-N folders of a run's output_dir."""
    files, seen = [], set()
    for root, folders, names in os.walk(folder, followlinks=True):
        real = os.path.realpath(root)
        if real in seen:
            folders[:] = []
            continue
        seen.add(real)
        if skip_checkpoints and Path(root) == Path(folder):
            folders[:] = [name for name in folders if not CHECKPOINT_NAME.match(name)]
        folders.sort()
        files.extend(Path(root, name) for name in sorted(names) if name not in NEVER_LOADED)
    return files


def pickle_globals(path: Path) -> list[str]:
    """The globals a plain pickle references, read without unpickling it: the pickle machine's stack is followed
    opcode by opcode (`pickletools`), so a global's module and name are the strings really on the stack when it is
    looked up; one built from anything but plain strings is returned as `?`."""
    import pickletools

    mark = object()
    names, stack, memo = [], [], {}
    with open(path, "rb") as stream:
        for opcode, arg, _ in pickletools.genops(stream):
            name, before = opcode.name, opcode.stack_before
            if name in ("MEMOIZE", "PUT", "BINPUT", "LONG_BINPUT"):
                memo[len(memo) if name == "MEMOIZE" else arg] = stack[-1] if stack else None
                continue
            if name in ("GLOBAL", "INST"):
                names.append(arg.replace(" ", "."))
            elif name == "STACK_GLOBAL":
                parts = stack[-2:]
                names.append(".".join(parts) if len(parts) == 2 and all(isinstance(p, str) for p in parts) else "?")
            pushed = (memo.get(arg) if name in ("GET", "BINGET", "LONG_BINGET") else stack[-1] if name == "DUP" and
                      stack else arg if "UNICODE" in name else mark if name == "MARK" else None)
            if pickletools.markobject in before:  # pops down to the last MARK, then what lies under it
                while stack and stack[-1] is not mark:
                    stack.pop()
                del stack[-1:]
                before = before[:before.index(pickletools.markobject)]
            del stack[len(stack) - len(before):]
            stack.extend([pushed] * len(opcode.stack_after))
    return names


def dcp_metadata_is_safe(name: str) -> bool:
    import torch

    if name in DCP_SAFE_GLOBALS or name.startswith(DCP_SAFE_GLOBAL_PREFIXES):
        return True
    module, _, attribute = name.rpartition(".")
    return module == "torch" and isinstance(getattr(torch, attribute, None), (torch.dtype, torch.layout,
                                                                               torch.memory_format))


def unsafe_globals(path: Path) -> list[str]:
    """The globals a pickled file references beyond tensors and known state, read without unpickling it
    (`torch.serialization.get_unsafe_globals_in_checkpoint` for torch's zip files). Raises on an unreadable file."""
    import torch

    if path.name == DCP_METADATA:
        return [name for name in pickle_globals(path) if not dcp_metadata_is_safe(name)]
    names = torch.serialization.get_unsafe_globals_in_checkpoint(str(path))
    return [name for name in names if name not in SAFE_GLOBALS and not name.startswith(SAFE_GLOBAL_PREFIXES)]


def file_damage(path: Path) -> str | None:
    """Why `path` cannot be read as the file its name says (None when it reads): safetensors whose header does not
    parse or whose size does not match it (`safe_open`, no tensor loaded), JSON that does not parse, a pickle that
    is not a readable torch file, a sharded index naming a missing shard. Raises UnsafeCheckpointFile for a pickle
    referencing anything but checkpoint state."""
    if not path.exists():
        return "is a broken link" if path.is_symlink() else "is missing"
    if not path.is_file():  # a FIFO or a device behind a link would block or never end a read
        return "is not a regular file"
    if path.suffix == ".safetensors":
        from safetensors import safe_open

        try:
            with safe_open(str(path), "pt"):
                pass
        except Exception as error:  # SafetensorError: a truncated or foreign file
            return f"is not a whole safetensors file ({error})"
    elif path.suffix == ".json":
        try:
            record = json.loads(path.read_text())
        except (ValueError, OSError) as error:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
            return f"is not valid JSON ({error})"
        if path.name.endswith(".index.json") and isinstance(record, dict):
            missing = sorted({shard for shard in record.get("weight_map", {}).values()
                              if not (path.parent / shard).is_file()})
            if missing:
                return f"names shards that are missing ({', '.join(missing[:3])})"
    elif path.suffix in PICKLE_SUFFIXES or path.name == DCP_METADATA:
        try:
            unsafe = unsafe_globals(path)
        except Exception as error:  # not a torch zip file (truncated, or something else)
            return f"is not a readable checkpoint file ({error})"
        if unsafe:
            raise UnsafeCheckpointFile(
                f"{path} references {', '.join(unsafe[:3])}, which is not checkpoint state; refusing to load it (a "
                "pickled file can run code). Use a checkpoint you trust.")
    return None


def check_checkpoint_files(folder: str | Path, skip_checkpoints: bool = False) -> None:
    """Refuses, in one line naming the file, a checkpoint (or a run's output_dir) holding a file its loaders would
    open that is damaged or could run code: DeepSpeed loads its own files with `weights_only=False` and PyTorch's
    distributed checkpoint its `.metadata` with `pickle.load`, so this is the check that keeps a planted payload from
    running. Called before anything is unpickled."""
    for path in files_loaders_open(folder, skip_checkpoints):
        damage = file_damage(path)
        if damage is not None:
            raise RecipeError(f"{path} {damage}: it cannot be loaded. Use another checkpoint, or copy the file again "
                              "from where it was written.")
    tag_problem = deepspeed_tag_problem(Path(folder))
    if tag_problem is not None:
        raise RecipeError(f"{tag_problem}. Use another checkpoint.")


def deepspeed_tag_problem(folder: Path) -> str | None:
    """DeepSpeed loads `folder/<tag>` for the tag `latest` names: a tag that is not a folder of this checkpoint
    (`..`, a path elsewhere) would load files no check has read."""
    for pointer in ("latest", "latest_universal"):
        if not (folder / pointer).is_file():
            continue
        tag = (folder / pointer).read_text(errors="replace").strip()
        if not tag or tag in (".", "..") or "/" in tag or os.sep in tag or not (folder / tag).is_dir():
            return f"{folder / pointer} names {tag!r}, which is not a folder of {folder}"
    return None
