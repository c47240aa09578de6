"""A resumable checkpoint of a model Transformers loaded sharded (tensor parallel, alone or with FSDP2): the model's
and the optimizer's DTensor slices in PyTorch's distributed checkpoint format, one folder every rank writes its own
slices to, beside the gathered weights Trainer saves for `from_pretrained` and export.

Trainer refuses to checkpoint such a run ("Resuming is not supported for models sharded at load time"): it saves the
optimizer with `torch.save`, which would keep each rank's DTensors half-written. PyTorch's `get_state_dict` /
`set_state_dict` (torch/distributed/checkpoint/state_dict.py) give and take the slices, fully qualified by name, and
`dcp.save` / `dcp.load` write and read them, resharding on load to the mesh of the run that resumes.
"""

from __future__ import annotations

from pathlib import Path

STATE_FOLDER = "tensor_parallel_state"  # its `.metadata` is checked like FSDP's (finetune.checkpoints.untrusted_files)


def save_sharded_state(model, optimizer, checkpoint: Path) -> None:
    """Every rank writes its slices of the model and of the optimizer's states: a collective."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optimizer_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=str(checkpoint / STATE_FOLDER))


def load_sharded_model(model, checkpoint: Path) -> None:
    """The model's slices from `checkpoint`, into the model as it is sharded now: a collective."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    state = {"model": get_model_state_dict(model)}
    dcp.load(state, checkpoint_id=str(checkpoint / STATE_FOLDER))
    set_model_state_dict(model, state["model"])


def load_sharded_optimizer(model, optimizer, checkpoint: Path) -> None:
    """The optimizer's states from `checkpoint` (created first where the optimizer has not stepped): a collective."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    state = {"optimizer": get_optimizer_state_dict(model, optimizer)}
    dcp.load(state, checkpoint_id=str(checkpoint / STATE_FOLDER))
    set_optimizer_state_dict(model, optimizer, state["optimizer"])
