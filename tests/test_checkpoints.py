"""Resume: a run stopped at a checkpoint and resumed with `resume_from_checkpoint: auto` logs the same losses as
the uninterrupted run, under DDP, ZeRO-2 and ZeRO-3 on 2 CPU processes; `auto` skips a half-written checkpoint
and names it, and warns about recipe keys that changed; an explicit path to a missing or half-written
checkpoint stops with the recipe."""

import json
import shutil

import pytest

from finetune.args import parse_recipe
from finetune.checkpoints import COMPLETE_MARKER
from finetune.errors import RecipeError
from finetune.testing import CPU_LAUNCHES, assert_succeeded, launch_demo

RUN = ["--max_steps", "6", "--save_strategy", "steps", "--save_steps", "3", "--logging_steps", "1",
       "--warmup_steps", "2"]


def losses(output_dir) -> dict[int, float]:
    state = json.loads((output_dir / "trainer_state.json").read_text())
    return {entry["step"]: entry["loss"] for entry in state["log_history"] if "loss" in entry}


@pytest.mark.distributed
@pytest.mark.parametrize("name", sorted(CPU_LAUNCHES))
def test_resumed_run_logs_the_losses_of_the_uninterrupted_run(tmp_path, name):
    config, deepspeed_json = CPU_LAUNCHES[name]
    whole = tmp_path / "whole"
    assert_succeeded(launch_demo(config, whole, *RUN, deepspeed_json=deepspeed_json))
    resumed = tmp_path / "resumed"
    resumed.mkdir()
    assert (whole / "checkpoint-3" / COMPLETE_MARKER).is_file() and (whole / "checkpoint-6" / COMPLETE_MARKER).is_file()
    shutil.copytree(whole / "checkpoint-3", resumed / "checkpoint-3")  # as if the run had stopped after step 3...
    half_written = resumed / "checkpoint-6"  # ...while saving step 6: files there, but not all of them
    shutil.copytree(whole / "checkpoint-6", half_written)
    (half_written / COMPLETE_MARKER).unlink()
    (half_written / "trainer_state.json").unlink()
    with pytest.raises(RecipeError, match="checkpoint-6` is incomplete"):
        parse_recipe("recipes/demo.yaml", ["--resume_from_checkpoint", str(half_written)])
    result = launch_demo(config, resumed, *RUN, "--resume_from_checkpoint", "auto", "--generation_eval_samples", "5",
                         deepspeed_json=deepspeed_json)  # a changed key that leaves the losses alone
    assert_succeeded(result)
    assert "warning: the recipe differs from the one" in result.output
    assert "generation_eval_samples: 6 → 5" in result.output
    assert f"warning: skipping {half_written}: incomplete" in result.output
    assert f"resuming from {resumed / 'checkpoint-3'}" in result.output
    expected, got = losses(whole), losses(resumed)
    assert sorted(expected) == sorted(got) == [1, 2, 3, 4, 5, 6]
    for step in (4, 5, 6):  # same model, optimizer, schedule, RNG and data position
        assert got[step] == pytest.approx(expected[step], abs=1e-4), (step, expected, got)
    if name == "ddp":
        refuses_a_planted_payload(config, whole, tmp_path)


def refuses_a_planted_payload(config, run_dir, tmp_path):
    """A checkpoint file carrying a pickle payload is refused, not executed."""
    import torch

    checkpoint = run_dir / "checkpoint-3"
    proof = tmp_path / "payload-ran"
    torch.save({"rng": Payload(proof)}, checkpoint / "rng_state_1.pth")
    result = launch_demo(config, run_dir, *RUN, "--resume_from_checkpoint", str(checkpoint))
    assert result.returncode != 0 and not proof.exists()
    assert result.output.count(f"finetune: error: {checkpoint / 'rng_state_1.pth'} references io.open, which is "
                               "not checkpoint state; refusing to load it") == 1


def test_an_explicit_checkpoint_that_does_not_exist_is_an_error(tmp_path):
    with pytest.raises(RecipeError, match="is not a checkpoint directory; give one, or auto"):
        parse_recipe("recipes/demo.yaml", ["--resume_from_checkpoint", str(tmp_path / "checkpoint-9")])


class Payload:
    """Unpickling this would create a file: the proof that a checkpoint load ran code."""

    def __init__(self, proof):
        self.proof = str(proof)

    def __reduce__(self):
        return (open, (self.proof, "w"))
