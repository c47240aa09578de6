"""A pipeline-parallel run's checkpoint files (finetune.train.axes.pipeline.loop): each stage's weights, named as in
the whole model, and its optimizer and learning-rate schedule; and the whole model's weights put back together from
them."""

from __future__ import annotations

from pathlib import Path

import torch

from finetune.errors import RecipeError

STAGE_WEIGHTS = "pipeline_stage_{stage:02d}.safetensors"
STAGE_STATE = "pipeline_stage_{stage:02d}_state.pt"


def stage_checkpoint_files(stages: int) -> list[str]:
    """The files a complete checkpoint of `stages` stages holds, which its completeness marker lists (`files`,
    finetune.checkpoints.complete.files_a_resume_needs): each stage's weights and its optimizer and schedule."""
    return [name.format(stage=stage) for stage in range(stages) for name in (STAGE_WEIGHTS, STAGE_STATE)]


def stage_files(folder: Path) -> list[Path]:
    return sorted(folder.glob("pipeline_stage_[0-9][0-9].safetensors"))


def consolidated_state(folder: Path) -> dict[str, torch.Tensor]:
    """The whole model's weights from the stages' files in `folder` (a tied embedding appears in two: one copy)."""
    from safetensors.torch import load_file

    files = stage_files(folder)
    if not files:
        raise RecipeError(f"{folder} holds no pipeline stage weights ({STAGE_WEIGHTS.format(stage=0)}, ...).")
    state: dict[str, torch.Tensor] = {}
    for path in files:
        state.update(load_file(str(path)))
    return state
