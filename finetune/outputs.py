"""Every file a run writes into its `output_dir`, named once, with the one writer and reader of those records.

Besides Trainer's own files (checkpoints, `trainer_state.json`, the model), a `finetune train` run writes these; a
checkpoint folder gets `CHECKPOINT_COMPLETE` once every rank has saved it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from finetune.errors import RecipeError

EFFECTIVE_CONFIG = "effective_config.json"  # what runs, with the source of every value (finetune.train.effective)
BATCH_PLAN = "batch_plan.json"              # micro × processes × accumulation, the LR (finetune.recipe.batch_plan)
DATA_SUMMARY = "data_summary.json"          # rows, tokens, lengths, dropped rows (finetune.data.summary)
MEMORY_REPORT = "memory_report.json"        # measured next to predicted, per rank (finetune.memory)
MEMORY_REPORT_TABLE = "memory_report.md"
MEMORY_REPORT_PLOT = "memory_report.png"
THROUGHPUT = "throughput.json"              # tokens/s, step time, MFU (finetune.train.throughput)
EVAL_RESULTS = "eval_results.json"          # before/after evaluation and the run's summary (finetune.train.run)
COMPILE = "compile.json"                    # torch.compile's graphs and graph breaks (finetune.train.compiled)
PEAK_MEMORY = "peak_memory.json"            # the bench's plain-Trainer baseline (finetune.bench.plain_trainer)
CHECKPOINT_COMPLETE = "finetune_complete.json"  # in a checkpoint folder, once every rank saved it
RUN_LOCK = ".finetune_run.lock"             # held by the run writing here (finetune.checkpoints.run_lock)
PREPROCESSED = "preprocessed"               # tokenized data by `finetune preprocess` (finetune.data.cache)


def user_cache_dir() -> Path:
    """Where finetune keeps files between runs (the plan calibration store, launch configs written for a launch
    outside the checkout): `$FINETUNE_CACHE`, else `$XDG_CACHE_HOME/finetune`, else `~/.cache/finetune`."""
    if os.environ.get("FINETUNE_CACHE"):
        return Path(os.environ["FINETUNE_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "finetune"


def write_record(output_dir, name: str, record: Any) -> Path:
    """Writes `record` as indented JSON to `output_dir/name` (see `write_text`)."""
    return write_text(output_dir, name, json.dumps(record, indent=2, default=str) + "\n")


def write_text(output_dir, name: str, text: str) -> Path:
    """Writes `text` to `output_dir/name`, creating the folder; atomically (a temporary file in the same folder, then
    a rename), so a run killed mid-write leaves the old file or the new one, never half."""
    path = Path(output_dir, name)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        temporary.write_text(text)
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)
    return path


def recorded_value(folders, key: str) -> Any:
    """The value of `key` the first of `folders` records in its effective_config.json (`seed`, `model_name_or_path`,
    ...); None when none records it."""
    for folder in folders:
        effective = read_record(folder, EFFECTIVE_CONFIG, missing=None)
        value = effective.get("values", {}).get(key, {}).get("value") if isinstance(effective, dict) else None
        if value is not None:
            return value
    return None


def read_record(output_dir, name: str, missing: Any = ...) -> Any:
    """The record `output_dir/name`; `missing` when the file is absent (a RecipeError if not given), a RecipeError
    when it is not valid JSON."""
    path = Path(output_dir, name)
    if not path.is_file():
        if missing is not ...:
            return missing
        raise RecipeError(f"no {name} in {output_dir}: run `finetune train` with this output_dir first.")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise RecipeError(f"{path} is not valid JSON ({error}).") from None
