"""The effective configuration of a launch: every value that decides what runs, with where it came from.

Rank 0 prints it as one table and writes `output_dir/effective_config.json`. It warns when Accelerate
used a default config file nobody named, and lists DeepSpeed JSON values that contradict Trainer
arguments (found by Transformers' own DeepSpeed integration, `HfTrainerDeepSpeedConfig.mismatches`).
"""

from __future__ import annotations

import os

from rich.console import Console
from rich.table import Table

from finetune.errors import RecipeError
from finetune.strategy import (
    StrategyCheckCallback, launch_deepspeed_config, requested_strategy, write_effective_config,
)

# Trainer argument → the DeepSpeed key Trainer fills from it when the JSON says "auto".
DEEPSPEED_KEYS = {
    "per_device_train_batch_size": "train_micro_batch_size_per_gpu",
    "gradient_accumulation_steps": "gradient_accumulation_steps",
    "max_grad_norm": "gradient_clipping",
}


def launched_by_accelerate() -> bool:
    """`accelerate launch` hands every process its config as ACCELERATE_* variables; this one is always set."""
    return "ACCELERATE_MIXED_PRECISION" in os.environ


def unnamed_accelerate_config() -> str | None:
    """Accelerate's default config file, when `accelerate launch` used it without being told to."""
    from accelerate.commands.config.config_args import default_config_file

    if not os.path.isfile(default_config_file) or not launched_by_accelerate():
        return None
    import psutil

    command = psutil.Process().parent().cmdline()
    parent_is_accelerate = "launch" in command and any("accelerate" in part for part in command)
    return default_config_file if parent_is_accelerate and "--config_file" not in command else None


def describe_effective_config(trainer, sources: dict[str, str]) -> dict:
    args = trainer.args
    ds_file, ds_json = launch_deepspeed_config(args.deepspeed)
    requested = requested_strategy(args, ds_file, ds_json)
    ds_json = ds_json or {}
    launcher = "Accelerate config" if launched_by_accelerate() else "launcher"
    values: dict[str, dict] = {}

    def add(name, value, source):
        values[name] = {"value": value, "source": source}

    add("world_size", args.world_size, f"{launcher} (WORLD_SIZE)" if "WORLD_SIZE" in os.environ else "single process")
    add("strategy", requested["strategy"], f"DeepSpeed JSON {ds_file}" if ds_file else launcher)
    if requested["strategy"] == "deepspeed":
        for key in ("zero_stage", "offload_optimizer", "offload_param"):
            add(key, requested[key], f"DeepSpeed JSON {ds_file}")
    precision_key = "bf16" if args.bf16 else "fp16" if args.fp16 else None
    precision_source = sources.get(precision_key, "default") if precision_key else sources.get("bf16", "default")
    if ds_json and ds_json.get("bf16", {}).get("enabled") == "auto":
        precision_source += " → DeepSpeed \"auto\""
    add("precision", precision_key or "fp32", precision_source)
    for key in ("per_device_train_batch_size", "gradient_accumulation_steps", "learning_rate", "max_grad_norm"):
        source = sources.get(key, "default")
        ds_value = ds_json.get(DEEPSPEED_KEYS.get(key, ""), None)
        if ds_value == "auto":
            source += " → DeepSpeed \"auto\" filled by Trainer"
        elif ds_value is not None:
            source = f"DeepSpeed JSON {ds_file} ({DEEPSPEED_KEYS[key]}={ds_value}); Trainer has {getattr(args, key)}"
        add(key, getattr(args, key), source)
    global_batch = args.per_device_train_batch_size * args.world_size * args.gradient_accumulation_steps
    add("global_batch_size", global_batch, "micro-batch × processes × accumulation")

    warnings = []
    default_config = unnamed_accelerate_config()
    if default_config:
        warnings.append(f"accelerate launch used its default config {default_config}, which the command did not "
                        "name; pass --config_file to choose one.")
    plugin = getattr(trainer.accelerator.state, "deepspeed_plugin", None)
    mismatches = list(getattr(getattr(plugin, "hf_ds_config", None), "mismatches", []) or [])
    return {
        "values": values,
        "strategy": {"requested": requested},
        "warnings": warnings,
        "deepspeed_mismatches": [m.lstrip("- ") for m in mismatches],
    }


def print_effective_config(effective: dict, console: Console | None = None) -> None:
    console = console or Console()
    table = Table(title="Effective configuration")
    for column in ("setting", "value", "source"):
        table.add_column(column)
    for name, entry in effective["values"].items():
        table.add_row(name, str(entry["value"]), entry["source"])
    console.print(table)
    for warning in effective["warnings"]:
        console.print(f"[yellow]warning:[/yellow] {warning}")
    for mismatch in effective["deepspeed_mismatches"]:
        console.print(f"[red]DeepSpeed JSON contradicts Trainer:[/red] {mismatch}")


def report_and_guard_launch(trainer, sources: dict[str, str]) -> dict:
    """Writes and prints the effective configuration, stops on a DeepSpeed/Trainer contradiction, and
    arms the check that the strategy Trainer prepares is the requested one."""
    effective = describe_effective_config(trainer, sources)
    if trainer.is_world_process_zero():
        write_effective_config(effective, trainer.args.output_dir)
        print_effective_config(effective)
    if effective["deepspeed_mismatches"]:
        raise RecipeError(
            "the DeepSpeed JSON contradicts the recipe: " + "; ".join(effective["deepspeed_mismatches"])
            + '. Set those DeepSpeed values to "auto" (Trainer fills them from the recipe) or change the recipe.'
        )
    trainer.add_callback(StrategyCheckCallback(trainer, effective))
    return effective
