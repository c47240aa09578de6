"""`finetune plan --calibrate OUTPUT_DIR`: a finished run's measured memory next to the estimator's prediction.

What is measured and what is modelled: `memory_report.json` (`finetune.memory.report`) holds, per rank, the bytes of
parameters, gradients and optimizer states counted storage by storage at the first optimizer step, the peak (CUDA's
`max_memory_allocated` on a GPU; the process's peak RSS on CPU, which no estimate models) and the estimator's
prediction for the same run. On a GPU, peak allocated − predicted total is the overhead the estimator does not model
(allocator blocks, kernels' workspaces, autograd temporaries). `--save-calibration` stores the largest over the
ranks, keyed by GPU name, in `plan_calibration.json` under the user's cache directory (`$FINETUNE_CACHE`, else
`$XDG_CACHE_HOME/finetune`, else `~/.cache/finetune`); later plans for that GPU add it to every strategy's total.
A run that used less than predicted stores 0: a calibration never loosens the plan.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from finetune.errors import RecipeError
from finetune.memory.report import PARTS, load_memory_report

CALIBRATION_FILE = "plan_calibration.json"


def calibration_path() -> Path:
    if os.environ.get("FINETUNE_CACHE"):
        return Path(os.environ["FINETUNE_CACHE"]) / CALIBRATION_FILE
    cache = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(cache) / "finetune" / CALIBRATION_FILE


def compare(output_dir) -> dict:
    """Per rank and part (params, grads, optimizer, peak): predicted, measured and their ratio; on a GPU run the
    overhead beyond the prediction."""
    records = load_memory_report(output_dir)
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
    path = calibration_path()
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise RecipeError(f"{path} is not valid JSON ({error}): delete it or run `finetune plan --calibrate "
                          "OUTPUT_DIR --save-calibration` again.") from None


def save_overhead(gpu_name: str, comparison: dict) -> Path:
    """Stores the run's overhead for `gpu_name` (never below 0); later plans for that GPU add it."""
    if comparison["overhead_bytes"] is None:
        raise RecipeError(f"`--save-calibration`: {comparison['output_dir']} was measured without a GPU (peak "
                          f"{comparison['ranks'][0]['peak_kind']}); calibrate from a GPU run.")
    calibrations = read_calibrations()
    calibrations[gpu_name] = {"overhead_bytes": max(0, int(comparison["overhead_bytes"])),
                              "measured_overhead_bytes": int(comparison["overhead_bytes"]),
                              "from": comparison["output_dir"], "strategy": comparison["strategy"],
                              "world_size": comparison["world_size"]}
    path = calibration_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(calibrations, indent=2) + "\n")
    return path


def overhead_for(gpu_name: str | None) -> int:
    """Bytes a calibration measured beyond the prediction on this GPU (0 without one)."""
    if gpu_name is None:
        return 0
    return int(read_calibrations().get(gpu_name, {}).get("overhead_bytes", 0))
