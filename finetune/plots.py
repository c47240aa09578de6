"""Pictures and tables of runs and plans, for notebooks and reports: loss curves from `trainer_state.json`,
predicted memory per strategy and GPU count, and one results row per finished `finetune train` output_dir."""

from __future__ import annotations

from pathlib import Path

from transformers.trainer import TRAINER_STATE_NAME

from finetune import outputs
from finetune.errors import RecipeError
from finetune.memory.estimate import GiB
from finetune.memory.report import load_memory_report
from finetune.plan.decision_tree import HEADROOM, usable_bytes

# The parts of a prediction stacked in a memory bar, bottom to top.
PLAN_PARTS = (("params_bytes", "parameters"), ("grads_bytes", "gradients"), ("optimizer_bytes", "optimizer states"),
              ("activations_bytes", "activations"), ("temporary_bytes", "buffers"))
COLORS = ("#4C72B0", "#DD8452", "#55A868", "#C44E52", "#8172B3")


def _pyplot():
    try:
        import matplotlib.pyplot as plt
    except ImportError:
        raise RecipeError("plots need matplotlib: pip install matplotlib (or the project's `plots` extra).") from None
    return plt




def loss_history(output_dir) -> dict[str, list[tuple[int, float]]]:
    """(step, loss) pairs Trainer logged, for training and for evaluation, from `output_dir/trainer_state.json`."""
    history = outputs.read_record(output_dir, TRAINER_STATE_NAME)["log_history"]
    return {
        "train": [(entry["step"], entry["loss"]) for entry in history if "loss" in entry],
        "eval": [(entry["step"], entry["eval_loss"]) for entry in history if "eval_loss" in entry],
    }


def plot_loss_curves(runs: dict[str, str | Path], path: str | Path | None = None):
    """One figure with the training loss (lines) and eval loss (dots) of each labelled run; saved when `path`."""
    plt = _pyplot()
    figure, axis = plt.subplots(figsize=(7, 4))
    for (label, output_dir), color in zip(runs.items(), COLORS * 4):
        history = loss_history(output_dir)
        if history["train"]:
            axis.plot(*zip(*history["train"]), color=color, label=f"{label}: train")
        if history["eval"]:
            axis.plot(*zip(*history["eval"]), "o--", color=color, label=f"{label}: eval")
    axis.set_xlabel("optimizer step")
    axis.set_ylabel("loss (per answer token)")
    axis.set_title("Loss")
    axis.legend(fontsize=8)
    figure.tight_layout()
    if path is not None:
        figure.savefig(path, dpi=120)
    return figure


def plot_plans(plans: list[dict], path: str | Path | None = None):
    """Stacked bars of predicted GiB per GPU for every strategy, one panel per plan (GPU count), with the usable
    memory (90% of the GPU) as a line and the recommended strategy in bold."""
    plt = _pyplot()
    figure, axes = plt.subplots(1, len(plans), figsize=(3.6 * len(plans) + 1.5, 4.6), sharey=True, squeeze=False)
    for axis, plan in zip(axes[0], plans):
        estimates = {row["name"]: row["estimate"] for row in plan["strategies"]}
        _stacked_bars(axis, estimates, plan["gpu_memory_gib"], bold=plan["recommended"])
        axis.set_title(f"{plan['gpus']} GPU{'s' if plan['gpus'] > 1 else ''}: {plan['recommended'] or 'none fits'}",
                       fontsize=9)
    return _finish(figure, axes[0], f"{plans[0]['model']}: memory per GPU by strategy", path)


def plot_estimates(estimates: dict, gpu_memory_gib: float, title: str, path: str | Path | None = None):
    """Stacked bars of predicted GiB per GPU for labelled estimates (e.g. full, LoRA and QLoRA on one GPU)."""
    plt = _pyplot()
    figure, axis = plt.subplots(figsize=(1.3 * len(estimates) + 3.5, 4.2))
    _stacked_bars(axis, estimates, gpu_memory_gib)
    return _finish(figure, [axis], title, path)


def _stacked_bars(axis, estimates: dict, gpu_memory_gib: float, bold: str | None = None) -> None:
    names = list(estimates)
    bottom = [0.0] * len(names)
    for (key, label), color in zip(PLAN_PARTS, COLORS):
        heights = [getattr(estimates[name], key) / GiB for name in names]
        axis.bar(range(len(names)), heights, bottom=bottom, color=color, label=label, edgecolor="white")
        bottom = [b + h for b, h in zip(bottom, heights)]
    axis.axhline(usable_bytes(gpu_memory_gib) / GiB, color="black", linestyle="--", linewidth=1,
                 label=f"{HEADROOM:.0%} of {gpu_memory_gib:g} GiB less the CUDA context")
    axis.set_xticks(range(len(names)), names, rotation=60, ha="right", fontsize=7)
    for tick, name in zip(axis.get_xticklabels(), names):
        if name == bold:
            tick.set_fontweight("bold")


def _finish(figure, axes, title: str, path):
    axes[0].set_ylabel("predicted GiB per GPU")
    axes[-1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    figure.suptitle(title, fontsize=10)
    figure.tight_layout()
    if path is not None:
        figure.savefig(path, dpi=120)
    return figure


def run_results(output_dir) -> dict:
    """One row summarising a finished run: losses before/after, exact match, speed and memory per rank 0."""
    from finetune.train.evaluation import PREFERENCE_METRICS

    summary = outputs.read_record(output_dir, outputs.EVAL_RESULTS)
    before, after = summary.get("before") or {}, summary.get("after") or {}
    row = {
        "eval loss before": before.get("eval_loss"),
        "eval loss after": after.get("eval_loss"),
        "train loss": summary.get("train_loss"),
        "exact match before": _mean(before.get("exact_match")),
        "exact match after": _mean(after.get("exact_match")),
    }
    for metric in PREFERENCE_METRICS.values():  # a preference or RL method's own held-out measure
        if metric in after:
            name = metric.replace("_", " ")
            row.update({f"{name} before": before.get(metric), f"{name} after": after[metric]})
    throughput = outputs.read_record(output_dir, outputs.THROUGHPUT, missing=None)
    if throughput is not None:
        row["tokens/s"] = throughput["tokens_per_second"]
        row["MFU"] = throughput["mfu"]
    if (Path(output_dir) / outputs.MEMORY_REPORT).is_file():
        rank0 = load_memory_report(output_dir)[0]
        measured, predicted = rank0["measured"] or {}, rank0["predicted"] or {}
        states = ("params_bytes", "grads_bytes", "optimizer_bytes")
        row["model states GiB (measured)"] = sum(measured.get(key, 0) for key in states) / GiB
        row["model states GiB (predicted)"] = sum(predicted.get(key, 0) for key in states) / GiB
        if "reference_bytes" in predicted:
            row["reference model GiB (measured)"] = measured.get("reference_bytes", 0) / GiB
            row["reference model GiB (predicted)"] = predicted["reference_bytes"] / GiB
        if "reward_models_bytes" in predicted:
            row["reward models GiB (measured)"] = measured.get("reward_models_bytes", 0) / GiB
            row["reward models GiB (predicted)"] = predicted["reward_models_bytes"] / GiB
        if measured.get("generation_cache"):
            row["generation KV cache GiB (measured)"] = measured["generation_cache"]["bytes"] / GiB
            row["generation GiB (predicted)"] = predicted["generation_bytes"] / GiB
        row["peak GiB"] = measured.get("peak_bytes", 0) / GiB
        row["peak kind"] = measured.get("peak_kind")
        row["trainable parameters"] = (predicted.get("estimate") or {}).get("trainable_parameters")
    return row


def _mean(scores: dict | None) -> float | None:
    return sum(scores.values()) / len(scores) if scores else None
