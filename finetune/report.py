"""The before/after report of a training run: eval loss and exact match per task, with sample answers."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

SAMPLES_PER_TASK = 2


def summarize_evaluations(log_history: list[dict], exact_match_history: list[dict]) -> dict:
    """The first and the last evaluation, each with eval loss, exact match per task and sample answers."""
    losses = [entry for entry in log_history if "eval_loss" in entry]
    summary: dict = {}
    for label, position in (("before", 0), ("after", -1)):
        if not losses:
            break
        evaluation = {"step": losses[position]["step"], "eval_loss": losses[position]["eval_loss"]}
        if exact_match_history:
            scored = exact_match_history[position]
            evaluation["exact_match"] = scored["per_task"]
            evaluation["samples"] = _pick_samples(scored["samples"])
        summary[label] = evaluation
    return summary


def _pick_samples(samples: list[dict]) -> list[dict]:
    picked, per_task = [], {}
    for sample in samples:
        if per_task.get(sample["task"], 0) < SAMPLES_PER_TASK:
            per_task[sample["task"]] = per_task.get(sample["task"], 0) + 1
            picked.append(sample)
    return picked


def print_before_after(summary: dict, console: Console | None = None) -> None:
    console = console or Console()
    before, after = summary.get("before"), summary.get("after")
    if not before or not after:
        console.print(f"train loss {summary.get('train_loss', float('nan')):.4f} (no eval split: no before/after)")
        return
    table = Table(title="Before vs after training")
    table.add_column("metric")
    table.add_column(f"before (step {before['step']})", justify="right")
    table.add_column(f"after (step {after['step']})", justify="right")
    table.add_row("eval loss", f"{before['eval_loss']:.4f}", f"{after['eval_loss']:.4f}")
    for task, accuracy in after.get("exact_match", {}).items():
        table.add_row(f"exact match: {task}", f"{before['exact_match'][task]:.1%}", f"{accuracy:.1%}")
    console.print(table)
    if after.get("samples"):
        samples = Table(title="Sample generations (held-out)")
        for column in ("task", "prompt", "expected", "before", "after"):
            samples.add_column(column)
        for old, new in zip(before["samples"], after["samples"]):
            samples.add_row(new["task"], new["prompt"].replace("\n", " "), new["reference"], old["answer"], new["answer"])
        console.print(samples)
