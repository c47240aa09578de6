"""What `report_to: wandb` and `report_to: mlflow` runs hold beyond what Trainer's integrations give them: the recipe's
own values and what `effective_config.json` says runs, as run parameters, and (MLflow) the final evaluation in the run.

Trainer's `WandbCallback` and `MLflowCallback` log `TrainingArguments` and the model's config, not the model, data,
LoRA and method keys, nor the strategy and batch the launch resolved. `TrackedRunCallback` adds them on global rank 0,
under `finetune/`, once the integrations have started their runs; wandb and mlflow are imported only when asked for.
"""

from __future__ import annotations

import dataclasses
import enum
import re
from typing import Any

from transformers import TrainerCallback, TrainingArguments
from transformers.utils import logging

logger = logging.get_logger(__name__)

PREFIX = "finetune"
MLFLOW_REFUSED = re.compile(r"[^\w\-. :/]")  # mlflow.utils.validation.validate_param_and_metric_name allows the rest


def run_parameters(recipe, effective: dict) -> dict[str, Any]:
    """The recipe's sections Trainer's integrations do not log (model, data, LoRA, the method and its keys), then every
    value of `effective_config.json` (world size, strategy, precision, micro-batch, accumulation, global batch, ...),
    flattened under `finetune/`."""
    values: dict[str, Any] = {}
    for section in recipe.sections:
        if dataclasses.is_dataclass(section) and not isinstance(section, TrainingArguments):
            values.update(dataclasses.asdict(section))
    values.update({name: entry["value"] for name, entry in effective["values"].items()})
    return flatten(values, PREFIX)


def flatten(values: dict, prefix: str) -> dict[str, Any]:
    """`{"a": {"b": 1}}` → `{"prefix/a/b": 1}`; enums as their values, lists and scalars kept."""
    flat: dict[str, Any] = {}
    for key, value in values.items():
        name = f"{prefix}/{key}"
        if isinstance(value, dict) and value:
            flat.update(flatten(value, name))
        else:
            flat[name] = value.value if isinstance(value, enum.Enum) else value
    return flat


def mlflow_params(parameters: dict[str, Any], max_key_length: int, max_value_length: int) -> dict[str, str]:
    """The parameters as MLflow takes them: text no longer than it stores, names no longer than it allows, with only
    the characters it allows (others become `_`) and no path segment it refuses (empty, `.` or `..`:
    `mlflow.utils.validation.path_not_unique`)."""
    params = {}
    for key, value in parameters.items():
        segments = [segment if segment not in ("", ".", "..") else "_"
                    for segment in MLFLOW_REFUSED.sub("_", key).split("/")]
        name = "/".join(segments)
        if len(name) > max_key_length:  # a cut may leave a trailing `/`, `.` or `..`
            name = name[:max_key_length].rstrip("/.")
        params[name] = str(value)[:max_value_length]
    return params


class TrackedRunCallback(TrainerCallback):
    """On global rank 0, at the start of training: `parameters` into the W&B run's config and the MLflow run's params
    (never changing a param the run already holds: MLflow refuses that). At the end of training, MLflow's run is
    taken up again, which Trainer's `MLflowCallback` ends there: the final evaluation would otherwise start a second run
    holding only it. Runs after the integrations (Trainer puts them first), so their runs exist."""

    def __init__(self, parameters: dict[str, Any]):
        self.parameters = parameters
        self.mlflow_run_id: str | None = None

    def on_train_begin(self, args, state, control, **kwargs):
        if not state.is_world_process_zero:
            return
        if "wandb" in args.report_to:
            import wandb

            if wandb.run is not None:
                wandb.run.config.update(self.parameters, allow_val_change=True)
        if "mlflow" in args.report_to:
            self._log_mlflow_params()

    def _log_mlflow_params(self) -> None:
        import mlflow
        from mlflow.utils import validation

        run = mlflow.active_run()
        if run is None:
            return
        self.mlflow_run_id = run.info.run_id
        held = mlflow.get_run(self.mlflow_run_id).data.params  # a resumed run (MLFLOW_RUN_ID) holds its params
        params = mlflow_params(self.parameters, validation.MAX_ENTITY_KEY_LENGTH, validation.MAX_PARAM_VAL_LENGTH)
        kept = [key for key, value in params.items() if held.get(key, value) != value]
        if kept:
            logger.warning("MLflow run %s keeps its params %s: MLflow refuses to change a param.", self.mlflow_run_id,
                           ", ".join(kept))
        new = [(key, value) for key, value in params.items() if key not in held]
        for start in range(0, len(new), validation.MAX_PARAMS_TAGS_PER_BATCH):
            mlflow.log_params(dict(new[start:start + validation.MAX_PARAMS_TAGS_PER_BATCH]))

    def on_train_end(self, args, state, control, **kwargs):
        if self.mlflow_run_id is None:
            return
        import mlflow

        if mlflow.active_run() is None:  # MLflowCallback ends it again when deleted, MLflow itself at exit
            mlflow.start_run(run_id=self.mlflow_run_id)
