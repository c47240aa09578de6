"""`finetune plan --calibrate OUTPUT_DIR`: a finished run's measured memory next to the estimator's prediction.

What is measured and what is modelled: `memory_report.json` (`finetune.memory.report`) holds, per rank, the bytes of
parameters, gradients and optimizer states counted storage by storage at the first optimizer step, the peak (CUDA's
`max_memory_allocated` on a GPU; the process's peak RSS on CPU, which no estimate models) and the estimator's
prediction for the same run. On a GPU, peak allocated − predicted total is the overhead the estimator does not model
(allocator blocks, kernels' workspaces, autograd temporaries).

The store, `plan_calibration.json` under the user's cache directory (`$FINETUNE_CACHE`, else
`$XDG_CACHE_HOME/finetune`, else `~/.cache/finetune`), keeps that overhead as a share of the predicted peak, so it
scales with the run it is applied to, per GPU name and per class of run: the strategy, the method and the model's
size class (`model_class`: below 1B, 1B–10B, 10B–100B, 100B and more). Each class holds the largest share its runs
measured (never below 0: a calibration never loosens a plan) and how many runs measured it. A plan adds to a
strategy's total its own class's share, or, for a strategy not yet measured in that method and size class, the
largest share measured there by another strategy, and says whose; a run of another method or size class lends
nothing. `--save-calibration` stores a run's; a finished `finetune train` run on a GPU stores its own (recipe key
`save_calibration`) unless its model is under 1B parameters (a check or a toy run says little of the models that are
planned); a CPU run stores nothing. A store written before classes existed (absolute bytes per strategy) is not read.
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


def model_class(num_parameters: int | None) -> str:
    """A model's size class for calibrations: what one run tells of others of about its size."""
    if not num_parameters:
        return "unknown size"
    for bound, name in ((1e9, "under 1B"), (1e10, "1B-10B"), (1e11, "10B-100B")):
        if num_parameters < bound:
            return name
    return "100B and more"


def calibration_key(strategy: str, method: str, num_parameters: int | None) -> str:
    return f"{strategy} · {method} · {model_class(num_parameters)}"


def compare(output_dir, records: list[dict] | None = None, method: str | None = None) -> dict:
    """Per rank and part (params, grads, optimizer, peak): predicted, measured and their ratio; on a GPU run the
    overhead beyond the prediction, in bytes and as a share of the predicted peak. `records`: the run's memory report
    when already in hand (else read); `method`: the run's training method (else as its eval_results.json says)."""
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
                      "overhead_bytes": overhead,
                      "overhead_share": overhead / predicted["peak_bytes"] if overhead is not None else None})
    overheads = [rank["overhead_bytes"] for rank in ranks if rank["overhead_bytes"] is not None]
    shares = [rank["overhead_share"] for rank in ranks if rank["overhead_share"] is not None]
    estimate = (records[0].get("predicted") or {}).get("estimate") or {}
    return {"output_dir": str(output_dir), "strategy": records[0].get("strategy"),
            "world_size": records[0].get("world_size"), "ranks": ranks,
            "num_parameters": estimate.get("num_parameters"), "method": method or run_method(output_dir),
            "overhead_bytes": max(overheads) if overheads else None,
            "overhead_share": max(shares) if shares else None}


def run_method(output_dir) -> str:
    """The training method a finished run used (its `eval_results.json`); `sft` where it says none."""
    from finetune.recipe.methods import DEFAULT_METHOD

    try:
        return str(outputs.read_record(Path(output_dir), outputs.EVAL_RESULTS).get("method") or DEFAULT_METHOD)
    except (OSError, ValueError, AttributeError):
        return DEFAULT_METHOD


def read_calibrations() -> dict:
    """The store: GPU name → {"calibrations": {class key (`calibration_key`) → calibration}}. Entries of a store
    written before classes existed (absolute bytes by strategy) are left out: a byte count measured on one model
    says nothing of another."""
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
    return {gpu: {"calibrations": dict(entry["calibrations"])} for gpu, entry in stored.items()
            if isinstance(entry, dict) and isinstance(entry.get("calibrations"), dict)}


def save_overhead(gpu_name: str, comparison: dict) -> Path:
    """Stores the run's overhead for `gpu_name` in its class (strategy, method, model size): the largest share of
    the predicted peak measured by that class's runs (never below 0) and how many runs measured it, with the latest
    run it came from; later plans for that GPU add it."""
    if comparison["overhead_share"] is None:
        raise RecipeError(f"`--save-calibration`: {comparison['output_dir']} was measured without a GPU (peak "
                          f"{comparison['ranks'][0]['peak_kind']}); calibrate from a GPU run.")
    calibrations = read_calibrations()
    stored = calibrations.setdefault(gpu_name, {"calibrations": {}})["calibrations"]
    key = calibration_key(comparison["strategy"], comparison["method"], comparison["num_parameters"])
    before = stored.get(key, {})
    share = comparison["overhead_share"]
    stored[key] = {
        "strategy": comparison["strategy"], "method": comparison["method"],
        "model_class": model_class(comparison["num_parameters"]),
        "overhead_share": max(before.get("overhead_share", 0.0), share, 0.0),
        "runs": before.get("runs", 0) + 1,
        "latest": {"from": comparison["output_dir"], "overhead_share": share,
                   "overhead_bytes": int(comparison["overhead_bytes"]), "world_size": comparison["world_size"],
                   "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")},
    }
    # atomically: a plan reading meanwhile sees the old store or the new one
    return outputs.write_record(calibration_path().parent, CALIBRATION_FILE, calibrations)


SMALLEST_CALIBRATING_MODEL = 1e9  # parameters: smaller runs store nothing by default (`learn_from_run`)


def learn_from_run(output_dir, gpu_name: str | None, records: list[dict] | None = None,
                   method: str | None = None) -> Path | None:
    """At the end of a run: a GPU run's measured overhead goes into the store for its GPU and class (as `finetune
    plan --calibrate OUTPUT_DIR --save-calibration` stores it); a CPU run, a run without a GPU name or without a
    prediction, and a model under 1B parameters store nothing. Returns the store's path when written."""
    if gpu_name is None:
        return None
    comparison = compare(output_dir, records, method)
    if comparison["overhead_share"] is None or (comparison["num_parameters"] or 0) < SMALLEST_CALIBRATING_MODEL:
        return None
    return save_overhead(gpu_name, comparison)


def calibration_for(gpu_name: str | None) -> dict:
    """The calibrations measured on this GPU, by class key (empty without any)."""
    if gpu_name is None:
        return {}
    return dict(read_calibrations().get(gpu_name, {}).get("calibrations", {}))


def overhead_of(calibrations: dict, strategy_label: str, method: str, num_parameters: int,
                predicted_bytes: float) -> tuple[int, str | None]:
    """Bytes to add to a strategy's predicted peak on a calibrated GPU, and the class key whose runs measured them:
    its own class's share when runs of it were stored, else the largest share stored for the same method and model
    size by another strategy; (0, None) where neither was measured on this GPU."""
    own = calibration_key(strategy_label, method, num_parameters)
    if own in calibrations:
        return int(calibrations[own]["overhead_share"] * predicted_bytes), own
    size = model_class(num_parameters)
    kin = [key for key, entry in calibrations.items()
           if entry.get("method") == method and entry.get("model_class") == size]
    if not kin:
        return 0, None
    key = max(kin, key=lambda name: calibrations[name]["overhead_share"])
    return int(calibrations[key]["overhead_share"] * predicted_bytes), key
