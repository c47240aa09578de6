"""Checkpoints read as untrusted input, and whole: a pickle planted behind a symlink is refused by resume, export and
chat before anything is unpickled; a damaged checkpoint is skipped by name on `auto` (the newest whole one is taken)
and refused by name when named; export never writes over its source or a user's files; a run still training or a
half-written checkpoint is named with the checkpoints to use instead; a LoRA run on `tiny` is rebuilt with its own
seed."""

import hashlib
import json
import os
import shlex
import shutil

import pytest
import torch
from support import CHECKPOINTED_RUN, CPU_LAUNCHES, PROJECT_ROOT, assert_succeeded, finetune_command, launch_demo, run

from finetune import presets
from finetune.checkpoints.complete import (
    COMPLETE_MARKER,
    agree_on_newest_complete,
    check_checkpoint_files,
    why_incomplete,
)
from finetune.cli import main
from finetune.errors import RecipeError
from finetune.recipe.parse import parse_recipe

ZERO2_RUN = CHECKPOINTED_RUN  # the arguments of conftest's `checkpointed_runs`, which a resume of one repeats
INPUT = torch.tensor([[10, 20, 30, 40, 50, 60, 70]])


class Payload:
    """Unpickling this runs a shell command that only creates a file: the proof that a load ran code."""

    def __init__(self, proof):
        self.proof = str(proof)

    def __reduce__(self):
        return (os.system, (f"touch {shlex.quote(self.proof)}",))


def losses(output_dir) -> dict[int, float]:
    state = json.loads((output_dir / "trainer_state.json").read_text())
    return {entry["step"]: entry["loss"] for entry in state["log_history"] if "loss" in entry}


def one_error_line(capsys) -> str:
    output = capsys.readouterr()
    lines = [line for line in output.err.strip().splitlines() if line.startswith("finetune: error:")]
    assert len(lines) == 1, output.err
    return lines[0]


def logits(model):
    with torch.no_grad():
        return model.eval()(input_ids=INPUT).logits


@pytest.fixture(scope="module")
def zero2_run(checkpointed_runs):
    """A 2-process ZeRO-2 run of the demo recipe with checkpoints at steps 3 and 6 (shared: copied before changed)."""
    output_dir = checkpointed_runs["zero2"]
    assert all((output_dir / f"checkpoint-{step}" / COMPLETE_MARKER).is_file() for step in (3, 6))
    return output_dir


@pytest.fixture(scope="module")
def lora_seed7(tmp_path_factory):
    """A one-process LoRA run on `tiny` with seed 7 and checkpoints at steps 2 and 4."""
    output_dir = tmp_path_factory.mktemp("lora_seed7")
    assert_succeeded(run(finetune_command(
        "train", "recipes/demo.yaml", "--output_dir", str(output_dir), "--use_lora", "true", "--lora_r", "8",
        "--learning_rate", "1e-2", "--seed", "7", "--max_steps", "4", "--save_strategy", "steps", "--save_steps", "2",
        "--logging_steps", "2", "--eval_on_start", "false", "--generation_eval_samples", "0", "--max_eval_samples",
        "10", "--report_to", "none", "--disable_tqdm", "true"), cwd=PROJECT_ROOT))
    return output_dir


def copy_run(source, destination):
    shutil.copytree(source, destination, symlinks=False)
    return destination


def plant_behind_symlink(run_dir, proof):
    """checkpoint-6's DeepSpeed folder moved elsewhere in the run and linked back, its model states replaced by a
    pickle whose loading runs a command."""
    linked = run_dir / "checkpoint-6" / "global_step6"
    moved = run_dir / "elsewhere" / "global_step6"
    moved.parent.mkdir()
    shutil.move(linked, moved)
    linked.symlink_to(moved, target_is_directory=True)
    planted = linked / "mp_rank_00_model_states.pt"
    torch.save({"module": Payload(proof)}, planted)
    return planted


# 1. A payload behind a symlink: refused by each entry point before anything is unpickled.

@pytest.mark.distributed
def test_a_payload_behind_a_symlinked_folder_is_refused_by_auto_resume_on_every_rank(zero2_run, tmp_path):
    run_dir, proof = copy_run(zero2_run, tmp_path / "run"), tmp_path / "payload-ran"
    planted = plant_behind_symlink(run_dir, proof)
    result = launch_demo(CPU_LAUNCHES["zero2"], run_dir, *ZERO2_RUN, "--max_steps", "8", "--resume_from_checkpoint",
                         "auto")
    assert result.returncode != 0 and not proof.exists(), result.output[-3000:]
    errors = [line for line in result.output.splitlines() if line.startswith("finetune: error:")]
    assert len(errors) == 1 and errors[0].startswith(f"finetune: error: {planted} references posix.system, which is "
                                                     "not checkpoint state; refusing to load it"), result.output[-3000:]
    assert f'File "{PROJECT_ROOT / "finetune"}' not in result.output  # no traceback of ours (the launcher's only)


def test_export_refuses_a_payload_behind_a_symlinked_folder(zero2_run, tmp_path, capsys):
    run_dir, proof = copy_run(zero2_run, tmp_path / "run"), tmp_path / "payload-ran"
    planted = plant_behind_symlink(run_dir, proof)
    assert main(["export", str(run_dir / "checkpoint-6"), str(tmp_path / "out")]) == 2
    assert one_error_line(capsys).startswith(f"finetune: error: {planted} references posix.system")
    assert not proof.exists() and not (tmp_path / "out").exists()


def test_chat_refuses_a_payload_behind_a_symlinked_folder_once_the_safetensors_weights_are_gone(zero2_run, tmp_path,
                                                                                               capsys):
    run_dir, proof = copy_run(zero2_run, tmp_path / "run"), tmp_path / "payload-ran"
    planted = plant_behind_symlink(run_dir, proof)
    (run_dir / "checkpoint-6" / "model.safetensors").unlink()
    assert main(["chat", str(run_dir / "checkpoint-6"), "--prompt", "reverse abc"]) == 2
    assert one_error_line(capsys).startswith(f"finetune: error: {planted} references posix.system")
    assert not proof.exists()


def test_a_symlinked_payload_file_in_a_linked_folder_with_a_link_loop_is_found_without_hanging(tmp_path):
    proof = tmp_path / "payload-ran"
    checkpoint = tmp_path / "run" / "checkpoint-6"
    elsewhere = tmp_path / "elsewhere"
    checkpoint.mkdir(parents=True)
    elsewhere.mkdir()
    (checkpoint / "global_step6").symlink_to(elsewhere, target_is_directory=True)
    (elsewhere / "loop").symlink_to(checkpoint, target_is_directory=True)  # a link back up
    planted = tmp_path / "planted.pt"
    torch.save({"module": Payload(proof)}, planted)
    (elsewhere / "mp_rank_00_model_states.pt").symlink_to(planted)  # a linked file in a linked folder
    with pytest.raises(RecipeError, match=r"global_step6/mp_rank_00_model_states\.pt references posix\.system"):
        check_checkpoint_files(checkpoint)
    assert not proof.exists()


def test_a_weights_link_to_a_fifo_is_named_instead_of_blocking_export(lora_seed7, tmp_path, capsys):
    run_dir = copy_run(lora_seed7, tmp_path / "run")
    os.mkfifo(tmp_path / "fifo")
    weights = run_dir / "checkpoint-4" / "adapter_model.safetensors"
    weights.unlink()
    weights.symlink_to(tmp_path / "fifo")
    assert main(["export", str(run_dir / "checkpoint-4"), str(tmp_path / "out")]) == 2
    assert one_error_line(capsys).startswith(f"finetune: error: {weights} is not a regular file")
    assert agree_on_newest_complete(run_dir, 1) == (run_dir / "checkpoint-2", [run_dir / "checkpoint-4"])


def test_a_latest_tag_pointing_outside_the_checkpoint_is_refused(zero2_run, tmp_path):
    run_dir = copy_run(zero2_run, tmp_path / "run")
    shutil.move(run_dir / "checkpoint-6" / "global_step6", tmp_path / "outside")
    (run_dir / "checkpoint-6" / "latest").write_text("../../outside")
    with pytest.raises(RecipeError, match=r"checkpoint-6/latest names '\.\./\.\./outside', which is not a folder of"):
        check_checkpoint_files(run_dir / "checkpoint-6")
    assert agree_on_newest_complete(run_dir, 1)[0] == run_dir / "checkpoint-3"


def test_a_payload_in_the_metadata_of_a_distributed_checkpoint_is_refused(tmp_path):
    import pickle

    checkpoint = tmp_path / "checkpoint-2"
    (checkpoint / "pytorch_model_fsdp_0").mkdir(parents=True)
    proof = tmp_path / "payload-ran"
    (checkpoint / "pytorch_model_fsdp_0" / ".metadata").write_bytes(pickle.dumps(Payload(proof)))
    with pytest.raises(RecipeError, match=r"pytorch_model_fsdp_0/\.metadata references posix\.system"):
        check_checkpoint_files(checkpoint)
    assert not proof.exists()


# 2. and 3. Checkpoints read whole: a damaged one is skipped on auto, refused when named, refused by export.

@pytest.mark.distributed
def test_auto_resume_skips_a_damaged_newest_checkpoint_by_name_and_continues_from_the_whole_one(zero2_run, tmp_path):
    run_dir = copy_run(zero2_run, tmp_path / "run")
    for name in ("trainer_state.json", "model.safetensors", "eval_results.json"):  # as if the run had stopped at 6
        (run_dir / name).unlink(missing_ok=True)
    damaged = run_dir / "checkpoint-6" / "global_step6" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    damaged.write_bytes(damaged.read_bytes()[:1000])  # a copy cut short
    state = json.loads((run_dir / "checkpoint-3" / "trainer_state.json").read_text())
    result = launch_demo(CPU_LAUNCHES["zero2"], run_dir, *ZERO2_RUN, "--resume_from_checkpoint", "auto")
    assert_succeeded(result)
    assert f"warning: skipping {run_dir / 'checkpoint-6'}: damaged: {damaged} is not a readable checkpoint file" \
        in result.output
    assert f"resuming from {run_dir / 'checkpoint-3'}" in result.output
    assert state["global_step"] == 3
    expected, got = losses(zero2_run), losses(run_dir)
    for step in (4, 5, 6):  # the same model, optimizer, schedule and data position as the uninterrupted run
        assert got[step] == pytest.approx(expected[step], abs=1e-4), (step, expected, got)


def damage(path, how: str) -> None:
    if how == "truncate":
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    elif how == "corrupt":
        path.write_text('{"global_step": 4, "log_history": [')
    else:
        path.unlink()


@pytest.mark.parametrize(("name", "how", "why"), [
    ("adapter_model.safetensors", "truncate", "is not a whole safetensors file"),
    ("trainer_state.json", "corrupt", "is not valid JSON"),
    ("optimizer.pt", "delete", "is missing (a resume needs it"),
    ("scheduler.pt", "truncate", "is not a readable checkpoint file"),
    ("rng_state.pth", "delete", "is missing (a resume needs it"),
])
def test_a_damaged_checkpoint_is_skipped_by_auto_naming_the_file_and_refused_when_named(lora_seed7, tmp_path, name,
                                                                                        how, why):
    run_dir = copy_run(lora_seed7, tmp_path / "run")
    newest = run_dir / "checkpoint-4"
    damage(newest / name, how)
    assert agree_on_newest_complete(run_dir, 1) == (run_dir / "checkpoint-2", [newest])
    assert why_incomplete(newest).startswith(f"damaged: {newest / name} {why}")
    with pytest.raises(RecipeError, match=rf"`resume_from_checkpoint: {newest}` is damaged: {newest / name} "):
        parse_recipe("recipes/demo.yaml", ["--resume_from_checkpoint", str(newest), "--output_dir", str(run_dir)])


def test_a_truncated_full_weights_file_skips_the_zero_checkpoint_and_export_names_it(zero2_run, tmp_path, capsys):
    run_dir = copy_run(zero2_run, tmp_path / "run")
    weights = run_dir / "checkpoint-6" / "model.safetensors"
    damage(weights, "truncate")
    assert agree_on_newest_complete(run_dir, 1) == (run_dir / "checkpoint-3", [run_dir / "checkpoint-6"])
    assert main(["export", str(run_dir / "checkpoint-6"), str(tmp_path / "out")]) == 2
    assert one_error_line(capsys).startswith(f"finetune: error: {weights} is not a whole safetensors file")
    assert not (tmp_path / "out").exists()


def test_export_of_a_truncated_adapter_names_the_file(lora_seed7, tmp_path, capsys):
    run_dir = copy_run(lora_seed7, tmp_path / "run")
    damage(run_dir / "adapter_model.safetensors", "truncate")
    assert main(["export", str(run_dir), str(tmp_path / "out"), "--merge-lora"]) == 2
    assert one_error_line(capsys).startswith(
        f"finetune: error: {run_dir / 'adapter_model.safetensors'} is not a whole safetensors file")


# 4. Export never destroys its source, nor a user's files.

def digest(folder) -> dict[str, str]:
    return {str(path.relative_to(folder)): hashlib.sha256(path.read_bytes()).hexdigest()
            for path in sorted(folder.rglob("*")) if path.is_file()}


def test_export_refuses_the_source_a_folder_inside_it_or_one_holding_it(lora_seed7, tmp_path, capsys):
    run_dir = copy_run(lora_seed7, tmp_path / "run")
    before = digest(run_dir)
    (tmp_path / "link").symlink_to(run_dir, target_is_directory=True)
    cases = [(run_dir, run_dir, "is"), (run_dir, tmp_path / "link", "is"), (run_dir / "checkpoint-4", run_dir, "holds"),
             (run_dir, run_dir / "checkpoint-4", "is inside"), (run_dir, run_dir / "exported", "is inside")]
    for source, destination, where in cases:
        assert main(["export", str(source), str(destination), "--dtype", "bf16", "--force"]) == 2
        assert one_error_line(capsys) == (f"finetune: error: the export destination {destination} {where} the source "
                                          f"{source}: writing there would replace or mix with the weights it is read "
                                          "from. Give a directory outside the run.")
    other_checkpoint = run_dir / "checkpoint-2"
    assert main(["export", str(run_dir / "checkpoint-4"), str(other_checkpoint), "--force"]) == 2
    assert one_error_line(capsys) == (f"finetune: error: the export destination {other_checkpoint} is a checkpoint of "
                                      f"the training run {run_dir}: exporting there would replace the weights a "
                                      "resume or chat reads. Give a directory outside the run.")
    assert digest(run_dir) == before


def test_export_writes_into_a_users_folder_only_with_force_and_replaces_an_earlier_export(lora_seed7, tmp_path,
                                                                                          capsys):
    users = tmp_path / "users"
    users.mkdir()
    (users / "model.safetensors").write_text("the user's own file")
    assert main(["export", str(lora_seed7), str(users), "--merge-lora"]) == 2
    assert one_error_line(capsys) == (f"finetune: error: the export destination {users} is not empty and holds no "
                                      "earlier export (finetune_export.json): give a new or empty directory, or pass "
                                      "--force to write into it.")
    assert (users / "model.safetensors").read_text() == "the user's own file"
    assert main(["export", str(lora_seed7), str(users), "--merge-lora", "--force"]) == 0
    exported = tmp_path / "exported"
    assert main(["export", str(lora_seed7), str(exported), "--merge-lora"]) == 0
    assert (exported / "model.safetensors").is_file()
    assert main(["export", str(lora_seed7), str(exported)]) == 0  # again, as a standalone adapter
    assert (exported / "adapter_model.safetensors").is_file() and not (exported / "model.safetensors").exists()


# 5. A run still training, a half-written checkpoint: named, with the checkpoints to use instead.

def test_a_run_still_training_is_named_with_its_complete_checkpoints(lora_seed7, tmp_path, capsys):
    import socket

    from finetune.checkpoints.run_lock import acquire, release

    run_dir = copy_run(lora_seed7, tmp_path / "run")
    (run_dir / "checkpoint-4" / COMPLETE_MARKER).unlink()  # being saved now
    lock = acquire(run_dir, "live-run")
    try:
        live = f"pid {os.getpid()} on host {socket.gethostname()}"
        for command in (["export", str(run_dir), str(tmp_path / "out")], ["chat", str(run_dir), "--prompt", "hi"]):
            assert main(command) == 2
            error = one_error_line(capsys)
            assert error.startswith(f"finetune: error: {run_dir} is still being trained by {live}"), error
            assert error.endswith(f"use one of its complete checkpoints: {run_dir / 'checkpoint-2'}, or wait for the "
                                  "run to end.")
        assert main(["chat", str(run_dir / "checkpoint-4"), "--prompt", "hi"]) == 2
        error = one_error_line(capsys)
        assert error.startswith(f"finetune: error: {run_dir / 'checkpoint-4'} is incomplete (its save was "
                                f"interrupted); {run_dir} is still being trained by {live}"), error
        assert error.endswith(f"use one of its complete checkpoints: {run_dir / 'checkpoint-2'}.")
    finally:
        release(lock)
    assert main(["export", str(run_dir / "checkpoint-4"), str(tmp_path / "out")]) == 2  # half-written, run ended
    assert one_error_line(capsys) == (f"finetune: error: {run_dir / 'checkpoint-4'} is incomplete (its save was "
                                      f"interrupted): use one of its complete checkpoints: "
                                      f"{run_dir / 'checkpoint-2'}.")


# 6. A LoRA run on `tiny` is rebuilt with the seed it trained with.

def test_a_lora_run_with_seed_7_exports_and_chats_with_the_trained_model(lora_seed7, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from finetune.train.trained_model import load_with_tokenizer

    trained = PeftModel.from_pretrained(presets.build_model(presets.build_tokenizer(), seed=7), lora_seed7)
    other_seed = PeftModel.from_pretrained(presets.build_model(presets.build_tokenizer(), seed=0), lora_seed7)
    assert not torch.allclose(logits(trained), logits(other_seed), atol=1e-3)  # the seed decides the model
    for source in (lora_seed7, lora_seed7 / "checkpoint-4"):
        destination = tmp_path / source.name
        assert main(["export", str(source), str(destination), "--merge-lora"]) == 0
        exported = AutoModelForCausalLM.from_pretrained(destination)
        torch.testing.assert_close(logits(exported), logits(trained), atol=1e-5, rtol=1e-5)
    chatted, _ = load_with_tokenizer(lora_seed7)  # what `finetune chat` loads
    torch.testing.assert_close(logits(chatted), logits(trained), atol=1e-5, rtol=1e-5)
