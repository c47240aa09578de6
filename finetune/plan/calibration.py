"""`finetune plan --calibrate OUTPUT_DIR`: a finished run's measured memory next to the estimator's prediction.

What is measured and what is modelled: `memory_report.json` (`finetune.memory.report`) holds, per rank, the bytes of
parameters, gradients and optimizer states counted storage by storage at the first optimizer step, the peak (CUDA's
`max_memory_allocated` on a GPU; the process's peak RSS on CPU, which no estimate models) and the estimator's
prediction for the same run. On a GPU, peak allocated − predicted total is the overhead the estimator does not model
(allocator blocks, kernels' workspaces, autograd temporaries). The store, `plan_calibration.json` under the user's
cache directory (`$FINETUNE_CACHE`, else `$XDG_CACHE_HOME/finetune`, else `~/.cache/finetune`), keeps the largest
over the ranks per GPU name and strategy, with the run it came from. `--save-calibration` stores a run's; a finished
`finetune train` run on a GPU stores its own (`learn_from_run`; recipe key `save_calibration`); a CPU run stores
nothing. Later plans for that GPU add it to that strategy's total, and to a strategy not yet measured there the
largest stored for the GPU. A run that used less than predicted stores 0: a calibration never loosens the plan.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from finetune import outputs
from finetune.errors import RecipeError
from finetune.memory.report import PARTS, load_memory_report

CALIBRATION_FILE = "plan_calibration.json"


def calibration_path() -> Path:
    return outputs.user_cache_dir() / CALIBRATION_FILE


def compare(output_dir, records: list[dict] | None = None) -> dict:
    """Per rank and part (params, grads, optimizer, peak): predicted, measured and their ratio; on a GPU run the
    overhead beyond the prediction. `records`: the run's memory report when already in hand (else read)."""
    records = load_memory_report(output_dir) if records is None else records
    ranks = []
    for record in records:
        predicted, measured = record.get("predicted") or {}, record.get("measured") or {}
        on_gpu = str(measured.get("peak_kind", "")).startswith("cuda")
        parts = []
        for key, label in (*PARTS, ("peak_bytes", "peak")):
            want, got = predicted.get(key), measured.get(key)
            comparable = want and got is not None and (key != "peak_bytes" or on_gpu)
            parts.append({"part": label, "predicted": want, "measured": got,
                          "ratio": got / want if comparable else None})
        overhead = measured["peak_bytes"] - predicted["peak_bytes"] if on_gpu and predicted.get("peak_bytes") \
            and measured.get("peak_bytes") is not None else None
        ranks.append({"rank": record["rank"], "peak_kind": measured.get("peak_kind"), "parts": parts,
                      "overhead_bytes": overhead})
    overheads = [rank["overhead_bytes"] for rank in ranks if rank["overhead_bytes"] is not None]
    return {"output_dir": str(output_dir), "strategy": records[0].get("strategy"),
            "world_size": records[0].get("world_size"), "ranks": ranks,
            "overhead_bytes": max(overheads) if overheads else None}


def read_calibrations() -> dict:
    """The store: GPU name → {"strategies": {strategy label → calibration}}. An entry written before calibrations
    were kept per strategy (one per GPU) reads as the calibration of the strategy it was measured with."""
    path = calibration_path()
    if not path.is_file():
        return {}
    try:
        stored = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise RecipeError(f"{path} is not valid JSON ({error}): delete it or run `finetune plan --calibrate "
                          "OUTPUT_DIR --save-calibration` again.") from None
    if not isinstance(stored, dict):
        raise RecipeError(f"{path} is not a calibration store (a JSON object by GPU name): delete it.")
    return {gpu: entry if "strategies" in entry else {"strategies": {entry.get("strategy") or "any": entry}}
            for gpu, entry in stored.items() if isinstance(entry, dict)}


def save_overhead(gpu_name: str, comparison: dict) -> Path:
    """Stores the run's overhead for `gpu_name` and the run's strategy (never below 0), with the run it came from;
    later plans for that GPU add it."""
    if comparison["overhead_bytes"] is None:
        raise RecipeError(f"`--save-calibration`: {comparison['output_dir']} was measured without a GPU (peak "
                          f"{comparison['ranks'][0]['peak_kind']}); calibrate from a GPU run.")
    calibrations = read_calibrations()
    strategies = calibrations.setdefault(gpu_name, {"strategies": {}})["strategies"]
    strategies[comparison["strategy"]] = {
        "overhead_bytes": max(0, int(comparison["overhead_bytes"])),
        "measured_overhead_bytes": int(comparison["overhead_bytes"]),
        "from": comparison["output_dir"], "world_size": comparison["world_size"],
        "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    # atomically: a plan reading meanwhile sees the old store or the new one
    return outputs.write_record(calibration_path().parent, CALIBRATION_FILE, calibrations)


def learn_from_run(output_dir, gpu_name: str | None, records: list[dict] | None = None) -> Path | None:
    """At the end of a run: a GPU run's measured overhead goes into the store for its GPU and strategy (the memory
    report's comparison, as `finetune plan --calibrate OUTPUT_DIR --save-calibration` stores it); a CPU run, a run
    without a GPU name or without a prediction stores nothing. Returns the store's path when written."""
    if gpu_name is None:
        return None
    comparison = compare(output_dir, records)
    if comparison["overhead_bytes"] is None:
        return None
    return save_overhead(gpu_name, comparison)


def calibration_for(gpu_name: str | None) -> dict:
    """The calibrations measured on this GPU, by strategy label (empty without any)."""
    if gpu_name is None:
        return {}
    return dict(read_calibrations().get(gpu_name, {}).get("strategies", {}))


def overhead_of(calibrations: dict, strategy_label: str) -> tuple[int, str | None]:
    """Bytes to add to a strategy's prediction on a calibrated GPU, and the strategy whose run measured them: its own
    calibration when a run of it was stored, else the largest stored for the GPU (a run of another strategy says
    what this GPU's kernels and allocator hold beyond the model); (0, None) on a GPU never calibrated."""
    if strategy_label in calibrations:
        return int(calibrations[strategy_label]["overhead_bytes"]), strategy_label
    if not calibrations:
        return 0, None
    label = max(calibrations, key=lambda name: calibrations[name]["overhead_bytes"])
    return int(calibrations[label]["overhead_bytes"]), label
