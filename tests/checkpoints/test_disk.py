"""A full disk during a save (finetune/checkpoints/disk.py): stopped before the save when the free space cannot hold
it, else
named in one line; the half-written checkpoint goes and the newest complete one stays. The real fault: a checkpoint
file that is a link to /dev/full, whose writes fail with ENOSPC through PyTorch's own writer."""

import errno
import os
import re
import traceback
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from support import DEMO_SHORT_RUN, finetune_command, run

from finetune import presets
from finetune.checkpoints.complete import COMPLETE_MARKER, is_complete, mark_complete, newest_complete_checkpoint
from finetune.checkpoints.disk import folder_bytes, is_disk_full, needed_checkpoint_bytes, saving_within_free_space
from finetune.errors import RecipeError

MiB = 1024**2


def little_free_space(monkeypatch, free: int) -> None:
    monkeypatch.setattr("shutil.disk_usage", lambda path: SimpleNamespace(total=10 * free, used=9 * free, free=free))


def fake_checkpoint(output_dir: Path, step: int, sizes: dict[str, int], complete: bool) -> Path:
    folder = output_dir / f"checkpoint-{step}"
    folder.mkdir(parents=True)
    for name, size in sizes.items():
        (folder / name).write_bytes(b"x" * size)
    if complete:
        mark_complete(folder, step, {"strategy": "ddp", "world_size": 1}, {})
    return folder


def test_too_little_free_space_stops_before_the_save_naming_the_folder_the_free_and_the_needed_bytes(tmp_path,
                                                                                                     monkeypatch):
    kept = fake_checkpoint(tmp_path, 2, {"model.safetensors": 10}, complete=True)
    little_free_space(monkeypatch, free=1536)
    folder = tmp_path / "checkpoint-4"
    saved = []
    with pytest.raises(RecipeError) as stopped:
        with saving_within_free_space(folder, needed_bytes=3 * MiB):
            saved.append(folder)
    assert str(stopped.value).startswith(f"no space left on {folder}: 1.5 KB free, checkpoint needs ~3.0 MB.")
    assert f"the newest complete checkpoint, {kept}, is untouched" in str(stopped.value)
    assert saved == [] and not folder.exists()  # the save never started


def test_enough_free_space_lets_the_save_run(tmp_path, monkeypatch):
    little_free_space(monkeypatch, free=3 * MiB)
    folder = tmp_path / "checkpoint-4"
    with saving_within_free_space(folder, needed_bytes=3 * MiB):
        folder.mkdir()
    assert folder.is_dir()


def test_the_next_checkpoint_needs_the_size_of_the_newest_complete_one_else_the_estimate(tmp_path):
    assert needed_checkpoint_bytes(tmp_path / "not_yet", fallback_bytes=7) == 7
    fake_checkpoint(tmp_path, 2, {"model.safetensors": 100}, complete=True)
    newest = fake_checkpoint(tmp_path, 4, {"model.safetensors": 1000, "optimizer.pt": 2000}, complete=True)
    fake_checkpoint(tmp_path, 6, {"model.safetensors": 50_000}, complete=False)  # interrupted: not a measure
    marker = (newest / COMPLETE_MARKER).stat().st_size
    assert folder_bytes(newest) == 3000 + marker
    assert needed_checkpoint_bytes(tmp_path, fallback_bytes=7) == 3000 + marker


def test_without_a_complete_checkpoint_the_estimate_is_needed(tmp_path):
    fake_checkpoint(tmp_path, 2, {"model.safetensors": 50_000}, complete=False)
    assert needed_checkpoint_bytes(tmp_path, fallback_bytes=7) == 7


def checkpoint_exception(failure: BaseException) -> BaseException:
    from torch.distributed.checkpoint.api import CheckpointException

    return CheckpointException("save failed", {0: (failure, traceback.StackSummary())})


@pytest.mark.parametrize("error", [
    ValueError("a bug of ours"),
    RuntimeError("CUDA error: an illegal memory access was encountered"),
    OSError(errno.EIO, "Input/output error"),
    KeyboardInterrupt(),
    checkpoint_exception(OSError(errno.EIO, "Input/output error")),
], ids=repr)
def test_errors_that_are_not_about_disk_space_pass_through_unchanged(tmp_path, error):
    folder = tmp_path / "checkpoint-4"
    with pytest.raises(type(error)) as raised:
        with saving_within_free_space(folder, needed_bytes=0):
            folder.mkdir()
            raise error
    assert raised.value is error
    assert folder.is_dir()  # not ours to judge: left for the traceback's reader


@pytest.mark.parametrize("error", [
    OSError(errno.ENOSPC, "No space left on device"),
    OSError(errno.EDQUOT, "Disk quota exceeded"),
    RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 64 vs 0"),
    RuntimeError("[enforce fail at inline_container.cc:626] . PytorchStreamWriter failed writing file data/0: file "
                 "write failed"),
    SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)"),
    checkpoint_exception(OSError(errno.ENOSPC, "No space left on device")),
], ids=repr)
def test_full_disk_errors_in_each_librarys_words_are_recognised(error):
    assert is_disk_full(error)


def write_onto_a_full_device(folder: Path, how: str) -> None:
    """A real failed write: a file of `folder` that links to /dev/full, written by PyTorch's zip writer or plainly.
    (Never write to /dev/full by name: a writer that renames a temporary file into place replaces the device.)"""
    os.symlink("/dev/full", folder / "optimizer.pt")
    if how == "torch.save":
        torch.save({"state": torch.zeros(1000)}, folder / "optimizer.pt")
    else:
        with open(folder / "optimizer.pt", "wb") as file:
            file.write(b"x" * 10)


@pytest.mark.parametrize("how", ["torch.save", "open"])
def test_a_real_failed_write_is_one_recipe_error_and_the_half_written_folder_goes(tmp_path, how):
    kept = fake_checkpoint(tmp_path, 2, {"model.safetensors": 10}, complete=True)
    folder = tmp_path / "checkpoint-4"
    message = (rf"^no space left on {re.escape(str(folder))}: .* free, checkpoint needs ~1\.0 KB\. .*the newest "
               rf"complete checkpoint, {re.escape(str(kept))}, is untouched")
    with pytest.raises(RecipeError, match=message) as stopped:
        with saving_within_free_space(folder, needed_bytes=1024):
            folder.mkdir()
            write_onto_a_full_device(folder, how)
    assert stopped.value.__suppress_context__  # `from None`: the user sees one line, not PyTorch's chain
    assert not folder.exists()
    assert newest_complete_checkpoint(tmp_path) == (kept, [])


def test_a_folder_that_existed_before_the_save_is_not_removed(tmp_path):
    folder = tmp_path / "checkpoint-4"
    folder.mkdir()
    (folder / "notes.txt").write_text("the user's")
    with pytest.raises(RecipeError, match="no earlier checkpoint was touched"):
        with saving_within_free_space(folder, needed_bytes=0):
            write_onto_a_full_device(folder, "torch.save")
    assert (folder / "notes.txt").read_text() == "the user's"


def test_the_final_model_save_is_checked_too(tmp_path, monkeypatch):
    from finetune.recipe.args import FinetuneTrainingArguments
    from finetune.train.trainer import FinetuneTrainer

    model = presets.build_model(presets.build_tokenizer(), seed=0)
    trainer = FinetuneTrainer(model=model, args=FinetuneTrainingArguments(str(tmp_path), use_cpu=True, report_to=[]))
    parameter_bytes = sum(parameter.numel() * parameter.element_size() for parameter in model.parameters())
    little_free_space(monkeypatch, free=parameter_bytes - 1)
    final = tmp_path / "final"
    message = rf"^no space left on {re.escape(str(final))}: .* free, the model needs ~2\.01 MB"
    with pytest.raises(RecipeError, match=message):
        trainer.save_model(str(final))
    assert not final.exists()


def test_a_full_disk_during_a_real_training_save_stops_in_one_line_keeping_the_previous_checkpoint(tmp_path):
    """checkpoint-4's optimizer.pt links to /dev/full: Trainer's own torch.save meets ENOSPC mid-run."""
    output_dir = tmp_path / "run"
    (output_dir / "checkpoint-4").mkdir(parents=True)
    os.symlink("/dev/full", output_dir / "checkpoint-4" / "optimizer.pt")
    result = run(finetune_command("train", "recipes/demo.yaml", "--output_dir", str(output_dir), *DEMO_SHORT_RUN,
                                  "--max_steps", "6", "--save_strategy", "steps", "--save_steps", "2",
                                  "--disable_tqdm", "true"), timeout=120)
    errors = [line for line in result.output.splitlines() if "no space left on" in line]
    assert result.returncode == 2, result.output[-3000:]
    assert len(errors) == 1 and errors[0].startswith(f"finetune: error: no space left on {output_dir}/checkpoint-4: ")
    assert "Traceback" not in result.output
    previous = output_dir / "checkpoint-2"
    assert is_complete(previous) and f"the newest complete checkpoint, {previous}, is untouched" in errors[0]
    weights = load_file(previous / "model.safetensors")  # loadable, and every parameter of the model is in it
    model = presets.build_model(presets.build_tokenizer(), seed=0)
    assert {name: tensor.shape for name, tensor in weights.items()} == {
        name: parameter.shape for name, parameter in model.named_parameters()}
    assert all(torch.isfinite(tensor).all() for tensor in weights.values())
    assert newest_complete_checkpoint(output_dir) == (previous, [output_dir / "checkpoint-4"])
