"""The notebooks' helpers: loss curves, memory-plan bars, the walked decision tree and the results row."""

import json

import matplotlib
import pytest

from finetune.errors import RecipeError
from finetune.memory.estimate import GiB
from finetune.plan.decision_tree import PlanRequest, decision_path, make_plan
from finetune.plots import loss_history, plot_estimates, plot_loss_curves, plot_plans, run_results

matplotlib.use("Agg")


def write_run(output_dir, log_history, before=5.0, after=2.0):
    output_dir.mkdir(parents=True, exist_ok=True)
    (output_dir / "trainer_state.json").write_text(json.dumps({"log_history": log_history}))
    summary = {"before": {"eval_loss": before, "exact_match": {"add": 0.0, "sort": 0.0}},
               "after": {"eval_loss": after, "exact_match": {"add": 0.5, "sort": 1.0}}, "train_loss": 3.0}
    (output_dir / "eval_results.json").write_text(json.dumps(summary))
    return output_dir


LOG = [{"step": 0, "eval_loss": 5.0}, {"step": 10, "loss": 4.0}, {"step": 20, "loss": 3.0},
       {"step": 20, "eval_loss": 2.5}, {"step": 20, "train_loss": 3.5}]


def test_loss_curves_plot_exactly_the_logged_losses(tmp_path):
    run = write_run(tmp_path / "run", LOG)
    assert loss_history(run) == {"train": [(10, 4.0), (20, 3.0)], "eval": [(0, 5.0), (20, 2.5)]}
    figure = plot_loss_curves({"full": run}, tmp_path / "loss.png")
    train_line, eval_line = figure.axes[0].get_lines()
    assert list(train_line.get_ydata()) == [4.0, 3.0] and list(eval_line.get_xdata()) == [0, 20]
    assert (tmp_path / "loss.png").stat().st_size > 1000


def test_results_row_reads_the_run_files(tmp_path):
    run = write_run(tmp_path / "run", LOG)
    (run / "throughput.json").write_text(json.dumps({"tokens_per_second": 1234.0, "mfu": 0.41}))
    measured = {"params_bytes": GiB, "grads_bytes": GiB, "optimizer_bytes": 2 * GiB, "peak_bytes": 5 * GiB,
                "peak_kind": "cuda_max_allocated"}
    predicted = {"params_bytes": GiB, "grads_bytes": GiB, "optimizer_bytes": GiB,
                 "estimate": {"trainable_parameters": 7}}
    (run / "memory_report.json").write_text(json.dumps({"ranks": [{"measured": measured, "predicted": predicted}]}))
    row = run_results(run)
    assert row["eval loss before"] == 5.0 and row["eval loss after"] == 2.0
    assert row["exact match after"] == 0.75
    assert row["tokens/s"] == 1234.0 and row["MFU"] == 0.41
    assert row["model states GiB (measured)"] == 4.0 and row["model states GiB (predicted)"] == 3.0
    assert row["peak GiB"] == 5.0 and row["trainable parameters"] == 7


def test_results_row_of_a_folder_that_is_not_a_run_says_so(tmp_path):
    with pytest.raises(RecipeError, match="no eval_results.json"):
        run_results(tmp_path)


def test_decision_path_walks_the_tree_to_the_recommendation():
    plan = make_plan(PlanRequest("mistral-7b", gpus=2, gpu_memory_gib=24))
    path = decision_path(plan)
    assert [line.split(":")[0] for line in path] == [row["name"] for row in plan["strategies"]][:len(path)]
    assert path[-1].startswith(f"{plan['recommended']}:") and path[-1].endswith("recommended")
    assert all(line.endswith("→ next") for line in path[:-1])
    assert "20.6 GiB usable" in path[0]  # 90% of 24 GiB, less 1 GiB for the CUDA context


def test_decision_path_when_nothing_fits():
    plan = make_plan(PlanRequest("llama-3-70b", gpus=1, gpu_memory_gib=8))
    assert plan["recommended"] is None
    assert decision_path(plan)[-1].startswith("nothing fits")


def test_plan_bars_stack_every_part_of_the_prediction(tmp_path):
    plans = [make_plan(PlanRequest("mistral-7b", gpus=gpus, gpu_memory_gib=24)) for gpus in (1, 2)]
    figure = plot_plans(plans, tmp_path / "plans.png")
    axis = figure.axes[1]  # 2 GPUs
    tops = {}
    for patch in axis.patches:  # bars of each part, stacked: the top of the last one is the total
        tops[round(patch.get_x() + patch.get_width() / 2)] = patch.get_y() + patch.get_height()
    totals = [row["estimate"].total_bytes / GiB for row in plans[1]["strategies"]]
    assert [tops[i] for i in range(len(totals))] == pytest.approx(totals)
    bold = [tick.get_text() for tick in axis.get_xticklabels() if tick.get_fontweight() == "bold"]
    assert bold == [plans[1]["recommended"]]
    assert (tmp_path / "plans.png").is_file()


def test_estimate_bars_for_labelled_setups():
    plan = make_plan(PlanRequest("qwen2.5-0.5b", gpus=1, gpu_memory_gib=16, lora_rank=16))
    figure = plot_estimates({"LoRA": plan["strategies"][0]["estimate"]}, 16, "LoRA on a T4")
    assert figure.axes[0].get_lines()[0].get_ydata()[0] == pytest.approx(0.9 * 16 - 1)
