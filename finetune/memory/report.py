"""The memory report files: `memory_report.json` (the record), `memory_report.md` (a table) and
`memory_report.png` (stacked bars, predicted next to measured, per rank). `finetune report` re-renders
the last two from the JSON."""

from __future__ import annotations

from pathlib import Path

from finetune import outputs
from finetune.errors import RecipeError

PARTS = (("params_bytes", "parameters"), ("grads_bytes", "gradients"), ("optimizer_bytes", "optimizer states"))
# Gradients where they can peak besides the step (rows shown when a record has them).
REFERENCE = ("reference_bytes", "reference model")
GRADIENT_PEAKS = (("grads_between_micro_steps_bytes", "gradients between micro-steps"),
                  ("grads_peak_bytes", "gradients at their peak"))
# Host RAM this rank took while the model loaded, before Trainer sharded it (shown when a record has it).
HOST_LOAD = ("host_load_bytes", "host RAM while loading")
MiB = 1024**2


def write_memory_report(records: list[dict], output_dir) -> list[Path]:
    path = outputs.write_record(output_dir, outputs.MEMORY_REPORT, {"ranks": records})
    return [path, *render_memory_report(output_dir)]


def load_memory_report(output_dir) -> list[dict]:
    record = outputs.read_record(output_dir, outputs.MEMORY_REPORT, missing=None)
    if record is None:
        raise RecipeError(f"no {outputs.MEMORY_REPORT} in {output_dir}: run `finetune train` (or a Trainer with "
                          f"MemoryReportCallback) with this output_dir first.")
    if not isinstance(record, dict) or "ranks" not in record:
        raise RecipeError(f"{Path(output_dir, outputs.MEMORY_REPORT)} is not a memory report (no `ranks`).")
    return record["ranks"]


def render_memory_report(output_dir) -> list[Path]:
    """Writes the Markdown table and, when matplotlib is installed, the PNG, from `memory_report.json`."""
    records = load_memory_report(output_dir)
    markdown = Path(output_dir) / outputs.MEMORY_REPORT_TABLE
    markdown.write_text(markdown_table(records))
    picture = Path(output_dir) / outputs.MEMORY_REPORT_PLOT
    return [markdown, picture] if plot(records, picture) else [markdown]


def _mib(value) -> str:
    return "–" if value is None else f"{value / MiB:,.2f}"


def markdown_table(records: list[dict]) -> str:
    lines = [
        "# Memory per rank: predicted vs measured (MiB)",
        "",
        f"Strategy: {records[0]['strategy']}, world size {records[0]['world_size']}.",
        "",
        "| rank | part | predicted | measured | measured / predicted |",
        "|---:|---|---:|---:|---:|",
    ]
    for record in records:
        predicted, measured = record["predicted"] or {}, record["measured"] or {}
        peaks = [row for row in GRADIENT_PEAKS if row[0] in predicted or row[0] in measured]
        reference = [REFERENCE] if REFERENCE[0] in predicted or REFERENCE[0] in measured else []
        host_load = [HOST_LOAD] if HOST_LOAD[0] in measured else []
        rows = [*PARTS, *reference, *peaks, *host_load,
                ("peak_bytes", f"peak ({measured.get('peak_kind', 'not measured')})")]
        for key, label in rows:
            want, got = predicted.get(key), measured.get(key)
            comparable = key != "peak_bytes" or measured.get("peak_kind", "").startswith("cuda")
            ratio = f"{got / want:.3f}" if want and got is not None and comparable else "–"
            lines.append(f"| {record['rank']} | {label} | {_mib(want)} | {_mib(got)} | {ratio} |")
    lines += [
        "",
        "Parameters, gradients and optimizer states are counted per storage on each rank at the first optimizer",
        "step (offloaded bytes included); gradients also between the micro-steps of gradient accumulation. Host",
        "RAM while loading: the growth of the process's peak resident memory from before the model loaded until",
        "it was ready for Trainer (the whole model on a rank that reads the checkpoint). The",
        "predicted peak is per GPU; on a CPU-only run the measured peak is the process's resident memory (Python,",
        "libraries, data), which the estimator does not model.",
        "",
    ]
    return "\n".join(lines)


def plot(records: list[dict], path: Path) -> bool:
    try:  # a bare Figure, not pyplot: drawing a report must not change the backend of a notebook or script
        from matplotlib.figure import Figure
    except ImportError:
        return False
    figure = Figure(figsize=(4.0 + 1.6 * len(records), 4.2))
    axis = figure.subplots()
    colors = ("#4C72B0", "#DD8452", "#55A868")
    labels, positions = [], []
    for index, record in enumerate(records):
        for offset, (kind, ledger) in enumerate((("predicted", record["predicted"]), ("measured", record["measured"]))):
            x = index * 2.6 + offset
            positions.append(x)
            labels.append(f"rank {record['rank']}\n{kind}")
            bottom = 0.0
            for (key, name), color in zip(PARTS, colors):
                height = (ledger or {}).get(key, 0) / MiB
                axis.bar(x, height, bottom=bottom, color=color, label=name if x == 0 else None,
                         hatch="//" if kind == "predicted" else None, edgecolor="white")
                bottom += height
            peak = (ledger or {}).get("peak_bytes")
            if peak and str(record["measured"] and record["measured"].get("peak_kind")).startswith("cuda"):
                axis.plot([x - 0.4, x + 0.4], [peak / MiB] * 2, color="black", linewidth=2,
                          label="peak allocated" if x == 0 else None)
    axis.set_xticks(positions, labels, fontsize=8)
    axis.set_ylabel("MiB held per rank")
    precision = ((records[0]["predicted"] or {}).get("estimate") or {}).get("setup", {}).get("precision", "")
    axis.set_title(f"Memory per rank: {records[0]['strategy']} {precision}".rstrip(), fontsize=10)
    axis.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    return True
