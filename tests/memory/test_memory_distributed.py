"""Real 2-process runs (shared with test_strategies.py through conftest): on every rank, the measured bytes of
parameters, gradients and optimizer states equal the estimator's prediction for the same run, per ZeRO stage,
with and without offload, in fp32 and in bf16 mixed precision; the report files are written."""

import json

import pytest
from support import ALIGNMENT, NO_DECAY_FP32, slack

from finetune.memory import model_shape

pytestmark = pytest.mark.distributed

STATES = ("params_bytes", "grads_bytes", "optimizer_bytes")
RUNS = ["zero0", "zero1", "zero2", "zero2_offload", "zero3", "zero3_offload", "zero2_bf16", "zero3_bf16"]


def memory_report(output_dir) -> list[dict]:
    return json.loads((output_dir / "memory_report.json").read_text())["ranks"]


@pytest.mark.parametrize("run", RUNS)
def test_measured_model_states_equal_the_prediction_on_every_rank(deepspeed_runs, run):
    ranks = memory_report(deepspeed_runs[run]["output_dir"])
    assert [record["rank"] for record in ranks] == [0, 1]
    stage = int(run[4])
    for record in ranks:
        assert record["world_size"] == 2
        assert record["strategy"].startswith(f"deepspeed_zero{stage}")
        measured, predicted = record["measured"], record["predicted"]
        for key in STATES:
            assert abs(measured[key] - predicted[key]) <= slack(key, run), (record["rank"], key, measured, predicted)
        assert measured["peak_bytes"] > 0 and measured["peak_kind"] == "cpu_max_rss"
        # No accumulation: nothing is held between micro-steps, and the step is the gradients' peak.
        assert measured["grads_between_micro_steps_bytes"] == predicted["grads_between_micro_steps_bytes"] == 0
        assert measured["grads_peak_bytes"] == measured["grads_bytes"]


def test_bf16_deepspeed_holds_an_fp32_gradient_copy_as_its_own_estimator_assumes(deepspeed_runs):
    """DeepSpeed's 18 bytes/param (2 bf16 grads + 4 fp32 grads + 4 master + 8 Adam) is what is held, not the
    ZeRO paper's 12 + 2: measured here, per rank, with Ψ/N = the tiny model's half."""
    half = model_shape("tiny").num_parameters / 2
    for run in ("zero2_bf16", "zero3_bf16"):
        for record in memory_report(deepspeed_runs[run]["output_dir"]):
            measured = record["measured"]
            assert measured["grads_bytes"] >= (2 + 4) * half - ALIGNMENT - NO_DECAY_FP32
            assert abs(measured["optimizer_bytes"] - (4 + 8) * half) <= ALIGNMENT
    zero2 = memory_report(deepspeed_runs["zero2_bf16"]["output_dir"])[0]["measured"]["params_bytes"]
    zero3 = memory_report(deepspeed_runs["zero3_bf16"]["output_dir"])[0]["measured"]["params_bytes"]
    assert abs(zero2 - 2 * 2 * half) <= ALIGNMENT and abs(zero3 - 2 * half) <= ALIGNMENT


def test_ddp_ledger_equals_the_prediction(ddp_run):
    for record in memory_report(ddp_run):
        assert record["strategy"] == "ddp"
        for key in STATES:
            assert abs(record["measured"][key] - record["predicted"][key]) <= ALIGNMENT


def test_a_run_above_its_plan_says_so_in_its_summary_with_the_number(ddp_run):
    """The run carries a plan predicting half the model states it holds (conftest.ddp_run): every rank is flagged,
    with the bytes, in eval_results.json and in what rank 0 prints."""
    plan = json.loads((ddp_run / "effective_config.json").read_text())["plan"]
    check = json.loads((ddp_run / "eval_results.json").read_text())["memory_against_plan"]
    assert check["against"] == "the launch plan" and check["what"] == "model states"
    assert [rank["rank"] for rank in check["over"]] == [0, 1]
    for rank, record in zip(check["over"], memory_report(ddp_run)):
        assert rank["predicted_bytes"] == plan["predicted"]["model_states_bytes"]
        assert rank["measured_bytes"] == sum(record["measured"][key] for key in STATES)
        assert rank["ratio"] == pytest.approx(2.0, rel=0.01) and rank["ratio"] > 1 + check["margin"]
    output = (ddp_run / "launcher_output.txt").read_text()
    assert output.count("% above the launch plan's") == 2 and "warning: rank 1 held" in output


def test_report_files_are_written_and_the_ledger_is_logged_once(deepspeed_runs):
    run = deepspeed_runs["zero3_offload"]
    output_dir = run["output_dir"]
    assert (output_dir / "memory_report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    markdown = (output_dir / "memory_report.md").read_text()
    assert "deepspeed_zero3+offload_optimizer=cpu+offload_param=cpu" in markdown
    assert markdown.count("| optimizer states |") == 2
    logged = [entry for entry in run["log_history"] if "memory/params_bytes" in entry]
    assert len(logged) == 1
    assert logged[0]["memory/params_bytes"] == memory_report(output_dir)[0]["measured"]["params_bytes"]
