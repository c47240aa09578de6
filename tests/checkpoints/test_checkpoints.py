"""Resume: a run stopped at a checkpoint and resumed with `resume_from_checkpoint: auto` logs the same losses as
the uninterrupted run, under DDP, ZeRO-2 and ZeRO-3 on 2 CPU processes; `auto` skips a half-written checkpoint
and names it, and warns about recipe keys that changed; an explicit path to a missing or half-written
checkpoint stops with the recipe."""

import json
import re
import shutil

import pytest
from support import CHECKPOINTED_RUN, CPU_LAUNCHES, assert_succeeded, launch_demo

from finetune.checkpoints.complete import COMPLETE_MARKER
from finetune.errors import RecipeError
from finetune.recipe.parse import parse_recipe

RUN = CHECKPOINTED_RUN  # the arguments of conftest's `checkpointed_runs`, which a resume of one repeats


def losses(output_dir) -> dict[int, float]:
    state = json.loads((output_dir / "trainer_state.json").read_text())
    return {entry["step"]: entry["loss"] for entry in state["log_history"] if "loss" in entry}


@pytest.mark.distributed
@pytest.mark.parametrize("name", sorted(CPU_LAUNCHES))
def test_resumed_run_logs_the_losses_of_the_uninterrupted_run(checkpointed_runs, tmp_path, name):
    launch = CPU_LAUNCHES[name]
    whole = checkpointed_runs[name]  # the uninterrupted run: launch_demo(launch, whole, *RUN), shared, read only
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
    # a changed key that leaves the losses alone
    result = launch_demo(launch, resumed, *RUN, "--resume_from_checkpoint", "auto", "--generation_eval_samples", "5")
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
        refuses_a_planted_payload(launch, shutil.copytree(whole, tmp_path / "planted"), tmp_path)


def refuses_a_planted_payload(launch, run_dir, tmp_path):
    """A checkpoint file carrying a pickle payload is refused, not executed."""
    import torch

    checkpoint = run_dir / "checkpoint-3"
    proof = tmp_path / "payload-ran"
    torch.save({"rng": Payload(proof)}, checkpoint / "rng_state_1.pth")
    result = launch_demo(launch, run_dir, *RUN, "--resume_from_checkpoint", str(checkpoint))
    assert result.returncode != 0 and not proof.exists()
    # once, by the rank that refused (the launcher's closing summary quotes it again, after `traceback : `)
    refusal = (f"finetune: error: {checkpoint / 'rng_state_1.pth'} references io.open, which is not checkpoint "
               "state; refusing to load it")
    assert [line.startswith(refusal) for line in result.output.splitlines()].count(True) == 1
    assert f"traceback : {refusal}" in result.output


def test_an_explicit_checkpoint_that_does_not_exist_is_an_error(tmp_path):
    with pytest.raises(RecipeError, match="is not a checkpoint directory; give one, or auto"):
        parse_recipe("recipes/demo.yaml", ["--resume_from_checkpoint", str(tmp_path / "checkpoint-9")])


class Payload:
    """Unpickling this would create a file: the proof that a checkpoint load ran code."""

    def __init__(self, proof):
        self.proof = str(proof)

    def __reduce__(self):
        return (open, (self.proof, "w"))


def make_checkpoints(output_dir, complete_steps, incomplete_steps=(), layout=None):
    for step in [*complete_steps, *incomplete_steps]:
        folder = output_dir / f"checkpoint-{step}"
        folder.mkdir(parents=True)
        (folder / "trainer_state.json").write_text("{}")
        if step in complete_steps:
            (folder / COMPLETE_MARKER).write_text(json.dumps({"step": step, **(layout or {})}))


def surviving(output_dir):
    return sorted(int(folder.name.split("-")[1]) for folder in output_dir.iterdir())


def test_rotation_keeps_the_newest_complete_and_the_best_checkpoint_and_ignores_half_written_ones(tmp_path):
    from transformers.trainer_utils import rotate_checkpoints

    from finetune.checkpoints.complete import rotate_complete_checkpoints

    # Steps 2-8 complete; 10 was being saved when a rank died. Trainer's own rotation counts the half-written
    # folder as the newest checkpoint and deletes the last complete one:
    trainers = tmp_path / "trainer"
    make_checkpoints(trainers, [2, 4, 6, 8], [10])
    rotate_checkpoints(str(trainers), save_total_limit=1)
    assert surviving(trainers) == [10]  # nothing left to resume from
    ours = tmp_path / "ours"
    make_checkpoints(ours, [2, 4, 6, 8], [10])
    deleted = rotate_complete_checkpoints(ours, save_total_limit=1)
    assert surviving(ours) == [8, 10] and sorted(folder.name for folder in deleted) == ["checkpoint-2", "checkpoint-4",
                                                                                        "checkpoint-6"]
    best = tmp_path / "best"
    make_checkpoints(best, [2, 4, 6, 8], [10])
    rotate_complete_checkpoints(best, save_total_limit=2, best=str(best / "checkpoint-4"))
    assert surviving(best) == [4, 6, 8, 10]
    rotate_complete_checkpoints(best, save_total_limit=None)
    assert surviving(best) == [4, 6, 8, 10]


ZERO2_ON_2 = {"world_size": 2, "zero_stage": 2, "sequences_per_step": 32, "round_robin_gradients": False}
FSDP_ON_2 = {"world_size": 2, "strategy": "fsdp", "zero_stage": None, "fsdp_sharding": "full_shard",
             "sequences_per_step": 32}


@pytest.mark.parametrize(("saved", "now", "outcome"), [
    (ZERO2_ON_2, ZERO2_ON_2, False),
    ({**ZERO2_ON_2, "zero_stage": None}, {**ZERO2_ON_2, "world_size": 1, "zero_stage": None}, False),
    (ZERO2_ON_2, {**ZERO2_ON_2, "world_size": 1}, True),
    ({**ZERO2_ON_2, "zero_stage": 3}, {**ZERO2_ON_2, "zero_stage": 3, "world_size": 4}, True),
    (ZERO2_ON_2, {**ZERO2_ON_2, "sequences_per_step": 16}, "trained with 32 sequences a step and this run takes 16: "
                                                           "Trainer would resume at another place in the data. Set "
                                                           "`global_batch_size: 32`"),
    ({**ZERO2_ON_2, "zero_stage": None}, ZERO2_ON_2, "saved by DDP or one process on 2 rank.s. and this run is "
                                                     "DeepSpeed ZeRO-2 on 2 rank.s.: the optimizer states of the two "
                                                     "do not convert. Resume under DDP"),
    (ZERO2_ON_2, {**ZERO2_ON_2, "zero_stage": 3}, "saved by DeepSpeed ZeRO-2 on 2 rank.s. and this run is DeepSpeed "
                                                  "ZeRO-3 on 2 rank.s.: the optimizer states of the two do not "
                                                  "convert"),
    ({**ZERO2_ON_2, "zero_stage": 0}, {**ZERO2_ON_2, "zero_stage": 0, "world_size": 1}, "cover ZeRO-1/2/3 only"),
    ({**ZERO2_ON_2, "round_robin_gradients": True}, {**ZERO2_ON_2, "world_size": 1}, "round_robin_gradients: true"),
    (FSDP_ON_2, {**FSDP_ON_2, "world_size": 1}, False),  # PyTorch's distributed checkpoint reshards
    (FSDP_ON_2, {**FSDP_ON_2, "strategy": "ddp", "fsdp_sharding": None}, "saved by FSDP full_shard on 2 rank.s. and "
                                                                         "this run is DDP or one process on 2 rank.s."),
    (FSDP_ON_2, ZERO2_ON_2, "saved by FSDP full_shard on 2 rank.s. and this run is DeepSpeed ZeRO-2"),
    (ZERO2_ON_2, FSDP_ON_2, "saved by DeepSpeed ZeRO-2 on 2 rank.s. and this run is FSDP full_shard"),
])
def test_a_checkpoint_from_another_launch_continues_converts_or_stops_with_what_to_do(tmp_path, saved, now, outcome):
    from finetune.checkpoints.complete import resume_needs_universal

    make_checkpoints(tmp_path, [2], layout=saved)
    checkpoint = tmp_path / "checkpoint-2"
    if isinstance(outcome, bool):
        assert resume_needs_universal(checkpoint, now) is outcome
    else:
        with pytest.raises(RecipeError, match=outcome) as error:
            resume_needs_universal(checkpoint, now)
        if "optimizer states" in outcome:
            export = f"finetune export {checkpoint} WEIGHTS_DIR` then `model_name_or_path: WEIGHTS_DIR`"
            assert export in str(error.value)


def test_a_checkpoint_without_a_recorded_layout_is_resumed_as_saved(tmp_path):
    from finetune.checkpoints.complete import resume_needs_universal

    make_checkpoints(tmp_path, [2])
    assert resume_needs_universal(tmp_path / "checkpoint-2", ZERO2_ON_2) is False


@pytest.mark.parametrize(("saved", "refusal"), [
    ({**ZERO2_ON_2, "zero_stage": None, "strategy": "ddp"}, "saved by DDP or one process on 2 rank.s.: only DeepSpeed "
                                                             "ZeRO checkpoints need the universal format"),
    (FSDP_ON_2, "saved by FSDP full_shard on 2 rank.s.: only DeepSpeed"),
    ({**ZERO2_ON_2, "zero_stage": 0}, "cover ZeRO-1/2/3 only"),
    ({**ZERO2_ON_2, "round_robin_gradients": True}, "round_robin_gradients: true"),
])
def test_finetune_universal_refuses_what_the_conversion_cannot_take_saying_why(tmp_path, capsys, saved, refusal):
    from finetune.cli import main

    make_checkpoints(tmp_path, [2], layout=saved)
    (tmp_path / "checkpoint-2" / "latest").write_text("global_step2")
    assert main(["universal", str(tmp_path / "checkpoint-2")]) == 2
    assert re.search(refusal, capsys.readouterr().err)
    assert not (tmp_path / "checkpoint-2" / "latest_universal").exists()
    assert main(["universal", str(tmp_path / "nothing-here")]) == 2
    assert "is not a directory" in capsys.readouterr().err


def test_a_resume_converts_outside_any_collective_the_other_ranks_waiting_for_its_file(tmp_path, monkeypatch):
    """The main process converts in a child process; the others wait for `latest_universal` (written last) without a
    collective, so no `ddp_timeout` bounds a long conversion; a failed conversion stops the main process, naming it."""
    import threading

    from finetune.checkpoints import complete

    make_checkpoints(tmp_path, [2], layout={**ZERO2_ON_2, "zero_stage": None, "strategy": "ddp"})
    checkpoint = tmp_path / "checkpoint-2"
    monkeypatch.setattr(complete, "CONVERSION_POLL_SECONDS", 0.05)
    threading.Timer(0.5, (checkpoint / "latest_universal").write_text, ["global_step2_universal"]).start()
    complete.converted_outside_the_process_group(checkpoint, is_main=False)  # returns once the file is there
    (checkpoint / "latest_universal").unlink()
    with pytest.raises(RecipeError, match=r"converting .*checkpoint-2 to DeepSpeed's universal format failed:\n.*"
                                          r"only DeepSpeed ZeRO checkpoints need the universal format"):
        complete.converted_outside_the_process_group(checkpoint, is_main=True)
