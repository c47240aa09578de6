"""Resume edge cases on 2 CPU processes: a rank killed with SIGKILL mid-save and mid-run (rerunning with `auto`
continues from the last complete checkpoint, finishes, and loses nothing older), a checkpoint past an epoch boundary
(data order continues, nothing seen twice), and a changed world size (DDP continues; a ZeRO checkpoint continues
through DeepSpeed's universal format). Faults are injected by tests/fault_injection.py."""

import json
import re
import shutil
import sys
from collections import Counter

import pytest
from support import CPU_LAUNCHES, DEMO_SHORT_RUN, assert_succeeded, launch_demo, run

from finetune.checkpoints.complete import COMPLETE_MARKER

FAULTS = ("tests/fault_injection.py",)
SAVE_EVERY_2 = ["--max_steps", "6", "--save_strategy", "steps", "--save_steps", "2", "--save_total_limit", "1",
                "--logging_steps", "1", "--warmup_steps", "2", "--global_batch_size", "32"]


def kill_rank_1(where: str, step: int) -> dict:
    return {"FAULT_KILL_RANK": "1", "FAULT_KILL_STEP": str(step), "FAULT_KILL_IN": where}


def logged_losses(output_dir) -> dict[int, float]:
    state = json.loads((output_dir / "trainer_state.json").read_text())
    return {entry["step"]: entry["loss"] for entry in state["log_history"] if "loss" in entry}


def printed_losses(output: str) -> list[float]:
    """The losses rank 0 printed, in order (Trainer prints 4 significant digits)."""
    return [float(value) for value in re.findall(r"\{'loss': '([0-9.]+)'", output)]


def checkpoints(output_dir) -> dict[str, bool]:
    """Each checkpoint folder and whether it is complete."""
    return {folder.name: (folder / COMPLETE_MARKER).is_file()
            for folder in sorted(output_dir.glob("checkpoint-*"))}


@pytest.fixture(scope="module")
def crashed_zero2(tmp_path_factory):
    """ZeRO-2 with save_total_limit 1: rank 1 killed while saving step 4, rerun with auto and rank 1 killed starting
    step 5, rerun with auto to the end. Records what was on disk after each run. The killed runs are real processes:
    the test reads which rank the launcher names, which torch's elastic agent finds by time among real ranks (forked
    ranks it finds in their order)."""
    launch = CPU_LAUNCHES["zero2"]
    root = tmp_path_factory.mktemp("crash")
    out, record = root / "run", {}
    record["mid_save"] = launch_demo(launch, out, *SAVE_EVERY_2, program=FAULTS, env=kill_rank_1("save", 4),
                                     real=True)
    record["after_mid_save"] = checkpoints(out)
    record["model_written_mid_save"] = (out / "checkpoint-4" / "model.safetensors").is_file()
    shutil.copytree(out / "checkpoint-2", root / "kept" / "checkpoint-2")  # for the world-size test
    record["mid_run"] = launch_demo(launch, out, *SAVE_EVERY_2, "--resume_from_checkpoint", "auto", program=FAULTS,
                                    env=kill_rank_1("step", 5), real=True)
    record["after_mid_run"] = checkpoints(out)
    record["rerun"] = launch_demo(launch, out, *SAVE_EVERY_2, "--resume_from_checkpoint", "auto")
    return root, out, record


@pytest.mark.distributed
def test_a_rank_killed_mid_save_and_mid_run_then_auto_continues_and_finishes(crashed_zero2):
    _, out, record = crashed_zero2
    mid_save, mid_run, rerun = record["mid_save"], record["mid_run"], record["rerun"]
    assert mid_save.returncode != 0 and "Signal 9 (SIGKILL)" in mid_save.output
    # Rank 0 had written checkpoint-4's model when rank 1 died: the folder exists, incomplete, and with
    # save_total_limit 1 the complete checkpoint-2 is still there.
    assert record["model_written_mid_save"]
    assert record["after_mid_save"] == {"checkpoint-2": True, "checkpoint-4": False}

    assert mid_run.returncode != 0 and "Signal 9 (SIGKILL)" in mid_run.output
    assert f"warning: skipping {out / 'checkpoint-4'}: incomplete" in mid_run.output
    assert f"resuming from {out / 'checkpoint-2'}" in mid_run.output
    assert record["after_mid_run"] == {"checkpoint-4": True}  # re-saved whole; checkpoint-2 rotated only then

    assert_succeeded(rerun)
    assert f"resuming from {out / 'checkpoint-4'}" in rerun.output
    assert checkpoints(out) == {"checkpoint-6": True}
    assert json.loads((out / "trainer_state.json").read_text())["global_step"] == 6
    assert (out / "eval_results.json").is_file() and (out / "model.safetensors").is_file()
    losses = logged_losses(out)
    assert sorted(losses) == [1, 2, 3, 4, 5, 6]
    # Steps 3-4 were trained again after the crash: the same losses the crashed run printed for them.
    assert [losses[step] for step in (1, 2, 3, 4)] == pytest.approx(printed_losses(mid_save.output), rel=1e-3)


def assert_continues_on_one_rank(name: str, two_ranks, one_rank, made: str = "converted now") -> None:
    """Resumes the complete checkpoint-2 copied into `one_rank` on one process; losses as on 2 ranks."""
    launch = CPU_LAUNCHES[name]
    result = launch_demo(launch, one_rank, *SAVE_EVERY_2, "--resume_from_checkpoint", "auto", num_processes=1)
    assert_succeeded(result)
    stage = {"zero2": 2, "zero3": 3}[name]
    assert (f"{one_rank / 'checkpoint-2'} was saved by DeepSpeed ZeRO-{stage} on 2 rank(s); continuing on DeepSpeed "
            f"ZeRO-{stage} on 1 rank(s) through DeepSpeed's universal checkpoint format ({made})") in result.output
    assert checkpoints(one_rank) == {"checkpoint-6": True}  # the converted checkpoint-2 rotated out as usual
    assert json.loads((one_rank / "checkpoint-6" / COMPLETE_MARKER).read_text())["world_size"] == 1
    expected, got = logged_losses(two_ranks), logged_losses(one_rank)
    for step in (3, 4, 5, 6):  # 16 sequences × 2 steps of accumulation on one rank, 16 × 2 ranks before
        assert got[step] == pytest.approx(expected[step], abs=1e-4), (step, expected, got)


@pytest.mark.distributed
def test_a_zero2_checkpoint_converted_before_the_relaunch_continues_on_one_rank(crashed_zero2, capsys):
    """`finetune universal` converts with several processes before the launch; the run then loads that conversion
    (the ZeRO-3 test below converts inside the run)."""
    from finetune.cli import main

    root, out, _ = crashed_zero2
    kept = root / "kept"
    assert main(["universal", str(kept), "--workers", "2"]) == 0  # an output_dir: its newest complete checkpoint
    said = capsys.readouterr().out
    assert f"converted {kept / 'checkpoint-2'} to DeepSpeed's universal format (global_step2_universal, 2 worker(s)" \
        in said
    assert (kept / "checkpoint-2" / "latest_universal").read_text() == "global_step2_universal"
    assert main(["universal", str(kept / "checkpoint-2")]) == 0 and "already in the universal format" in \
        capsys.readouterr().out
    assert_continues_on_one_rank("zero2", out, kept, made="converted before this launch (finetune universal)")


@pytest.mark.distributed
def test_a_zero3_checkpoint_continues_on_one_rank_through_the_universal_format(tmp_path):
    launch = CPU_LAUNCHES["zero3"]
    two_ranks = tmp_path / "two-ranks"
    assert_succeeded(launch_demo(launch, two_ranks, *SAVE_EVERY_2, "--save_total_limit", "3"))
    shutil.copytree(two_ranks / "checkpoint-2", tmp_path / "one-rank" / "checkpoint-2")
    assert_continues_on_one_rank("zero3", two_ranks, tmp_path / "one-rank")


# 64 examples, 32 a step: an epoch is 2 steps; checkpoint-3 lies one step into the second epoch.
EPOCHS = ["--max_steps", "6", "--save_strategy", "steps", "--save_steps", "3", "--logging_steps", "1",
          "--warmup_steps", "2", "--global_batch_size", "32", "--generation_eval_samples", "0"]


def batches(log_dir) -> dict[tuple[int, int], list[str]]:
    """(step, rank) → the digests of the rows that rank trained on in that step."""
    seen = {}
    for log in sorted(log_dir.glob("rank-*.jsonl")):
        rank = int(log.stem.split("-")[1])
        for line in log.read_text().splitlines():
            entry = json.loads(line)
            seen.setdefault((entry["step"], rank), []).extend(entry["rows"])
    return seen


@pytest.fixture(scope="module")
def epoch_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("epochs")
    train_file = root / "train.jsonl"
    train_file.write_text("".join(json.dumps({"instruction": f"copy {i}", "input": "", "output": str(i)}) + "\n"
                                  for i in range(64)))
    launch = CPU_LAUNCHES["ddp"]
    extra = [*EPOCHS, "--train_file", str(train_file)]
    (root / "whole-log").mkdir()
    assert_succeeded(launch_demo(launch, root / "whole", *extra, program=FAULTS,
                                 env={"FAULT_BATCH_LOG": str(root / "whole-log")}))
    return root, launch, extra


@pytest.mark.distributed
def test_resuming_past_an_epoch_boundary_sees_each_example_once_per_epoch(epoch_run):
    root, launch, extra = epoch_run
    whole = batches(root / "whole-log")
    for epoch_steps in ((1, 2), (3, 4), (5, 6)):
        rows = Counter(row for (step, _), step_rows in whole.items() if step in epoch_steps for row in step_rows)
        assert len(rows) == 64 and set(rows.values()) == {1}, epoch_steps  # every example once an epoch
    resumed = root / "resumed"
    shutil.copytree(root / "whole" / "checkpoint-3", resumed / "checkpoint-3")
    (root / "resumed-log").mkdir()
    assert_succeeded(launch_demo(launch, resumed, *extra, "--resume_from_checkpoint", "auto", program=FAULTS,
                                 env={"FAULT_BATCH_LOG": str(root / "resumed-log")}))
    assert batches(root / "resumed-log") == {key: rows for key, rows in whole.items() if key[0] > 3}
    expected, got = logged_losses(root / "whole"), logged_losses(resumed)
    assert [got[step] for step in (4, 5, 6)] == pytest.approx([expected[step] for step in (4, 5, 6)], abs=1e-4)


@pytest.mark.distributed
def test_a_ddp_checkpoint_continues_on_one_process_with_the_same_data(epoch_run):
    root, _, extra = epoch_run
    one_process = root / "one-process"
    shutil.copytree(root / "whole" / "checkpoint-3", one_process / "checkpoint-3")
    (root / "one-process-log").mkdir()
    command = [sys.executable, *FAULTS, "train", "recipes/demo.yaml", "--output_dir", str(one_process),
               *DEMO_SHORT_RUN, *extra, "--resume_from_checkpoint", "auto"]
    assert_succeeded(run(command, env={"FAULT_BATCH_LOG": str(root / "one-process-log")}))
    whole, one = batches(root / "whole-log"), batches(root / "one-process-log")
    assert sorted(one) == [(4, 0), (5, 0), (6, 0)]  # 2 micro-batches of accumulation a step on one process
    for step in (4, 5, 6):
        assert sorted(one[step, 0]) == sorted(whole[step, 0] + whole[step, 1])
    expected, got = logged_losses(root / "whole"), logged_losses(one_process)
    assert [got[step] for step in (4, 5, 6)] == pytest.approx([expected[step] for step in (4, 5, 6)], abs=1e-4)
