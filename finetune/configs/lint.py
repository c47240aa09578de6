"""Validation before launch: contradictions in DeepSpeed JSON and Accelerate YAML, one clear message each.

DeepSpeed's own config model decides what it can (its pydantic ZeRO section forbids unknown keys; its
constants name the top-level keys); this module adds the cross-field rules it misses.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import yaml

from finetune.configs.accelerate import deepspeed_section_as_json
from finetune.configs.deepspeed import DEEPSPEED_DEFAULT_PARAM_BUFFER, fill_nvme_param_buffer

_EXTRA_TOP_LEVEL_KEYS = {
    "zero_optimization", "activation_checkpointing", "flops_profiler", "tensorboard", "wandb", "csv_monitor",
    "comet", "comms_logger", "compile", "aio", "tensor_parallel", "amp", "autotuning", "elasticity",
    "nebula", "data_efficiency", "curriculum_learning", "compression_training", "sparse_attention",
    "pipeline", "weight_quantization", "hybrid_engine", "monitor_config", "zero_force_ds_cpu_optimizer",
    "torch_autocast", "timers", "fp8", "mics_shard_size", "mics_hierarchical_params_gather",
}


def _enabled(section: Any) -> bool:
    return isinstance(section, dict) and section.get("enabled") is True


def _offloads(section: Any) -> bool:
    """An offload section that moves something (Accelerate writes `device: none` for no offload)."""
    return isinstance(section, dict) and section.get("device") not in (None, "none")


def _known_top_level_keys() -> set[str]:
    import deepspeed.runtime.constants as constants

    values = {value for name, value in vars(constants).items() if name.isupper() and isinstance(value, str)}
    return values | _EXTRA_TOP_LEVEL_KEYS


def lint_deepspeed(config: dict[str, Any], world_size: int | None = None,
                   source: str = "DeepSpeed config") -> list[str]:
    """Problems in a DeepSpeed config dict; `world_size` enables the batch-size product check."""
    problems = []
    zero = config.get("zero_optimization", {}) or {}
    stage = zero.get("stage", 0)
    if _offloads(zero.get("offload_param")) and stage != 3:
        problems.append(f"{source}: `zero_optimization.offload_param` needs ZeRO stage 3 (stage is {stage}); "
                        "remove offload_param or set stage 3.")
    if _enabled(config.get("fp16")) and _enabled(config.get("bf16")):
        problems.append(f"{source}: `fp16.enabled` and `bf16.enabled` are both true; enable one (or use \"auto\").")
    hpz = zero.get("zero_hpz_partition_size")
    if hpz is not None and hpz != "auto" and not (isinstance(hpz, int) and not isinstance(hpz, bool) and hpz >= 1):
        problems.append(f"{source}: `zero_optimization.zero_hpz_partition_size` is {hpz!r}: give the GPUs of one "
                        "node, or \"auto\" (finetune train fills it from the launch).")
    buffer = (zero.get("offload_param") or {}).get("buffer_size")
    if buffer is not None and buffer != "auto" and not isinstance(buffer, (int, float)):
        problems.append(f"{source}: `zero_optimization.offload_param.buffer_size` is {buffer!r}: give a number of "
                        "elements, or \"auto\" (finetune train sizes it from the model).")
    for section in ("offload_optimizer", "offload_param"):
        offload = zero.get(section) or {}
        if offload.get("device") == "nvme" and not offload.get("nvme_path"):
            problems.append(f"{source}: `zero_optimization.{section}` offloads to NVMe without `nvme_path`; "
                            "set it to a directory on a local NVMe drive.")
    problems += _batch_product_problems(config, world_size, source)
    unknown = sorted(set(config) - _known_top_level_keys())
    if unknown:
        problems.append(f"{source}: unknown top-level key(s) {', '.join(map(repr, unknown))} (DeepSpeed ignores them).")
    problems += _zero_section_problems(zero, source)
    return problems


def _batch_product_problems(config: dict[str, Any], world_size: int | None, source: str) -> list[str]:
    values = {key: config.get(key) for key in
              ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")}
    if not all(isinstance(value, int) for value in values.values()):
        return []  # "auto" or absent: Trainer fills them consistently
    total, micro, accumulation = values.values()
    if world_size is not None and total != micro * accumulation * world_size:
        return [f"{source}: train_batch_size {total} != micro {micro} × accumulation {accumulation} × "
                f"world size {world_size} = {micro * accumulation * world_size}; set them to \"auto\"."]
    if total % (micro * accumulation):
        return [f"{source}: train_batch_size {total} is not a multiple of micro {micro} × accumulation {accumulation}."]
    return []


def _zero_section_problems(zero: dict[str, Any], source: str) -> list[str]:
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    from pydantic import ValidationError

    resolved = {key: (int(5e8) if value == "auto" else value) for key, value in zero.items()}
    if isinstance(resolved.get("offload_param"), dict):  # "auto": the buffer finetune train sizes from the model
        resolved["offload_param"] = {key: (DEEPSPEED_DEFAULT_PARAM_BUFFER if value == "auto" else value)
                                     for key, value in resolved["offload_param"].items()}
    try:
        DeepSpeedZeroConfig(**resolved)
    except ValidationError as error:
        return [f"{source}: `zero_optimization.{'.'.join(map(str, e['loc']))}`: {e['msg']}" for e in error.errors()]
    return []


def parse_with_deepspeed(config: dict[str, Any], hidden_size: int = 4096):
    """DeepSpeed's own `DeepSpeedConfig` parse (in this single process), after Transformers' integration has
    filled the "auto" values exactly as Trainer does (`trainer_config_process` / `trainer_config_finalize`)
    for default `TrainingArguments` and a model of `hidden_size`."""
    import tempfile
    from types import SimpleNamespace

    from deepspeed.runtime.config import DeepSpeedConfig
    from transformers import TrainingArguments
    from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig

    with tempfile.TemporaryDirectory() as output_dir:
        args = TrainingArguments(output_dir=output_dir, use_cpu=True, report_to="none")
    config = copy.deepcopy(config)
    fill_nvme_param_buffer(config, DEEPSPEED_DEFAULT_PARAM_BUFFER)  # filled from the model at launch; no model here
    filled = HfTrainerDeepSpeedConfig(config)
    filled.trainer_config_process(args)
    filled.trainer_config_finalize(args, SimpleNamespace(config=SimpleNamespace(hidden_size=hidden_size)), 100)
    return DeepSpeedConfig(filled.config)


def lint_accelerate(config: dict[str, Any], visible_devices: int | None = None,
                    source: str = "Accelerate config") -> list[str]:
    """Problems in an Accelerate config dict; `visible_devices` enables the per-machine process count check."""
    problems = []
    machines = int(config.get("num_machines", 1) or 1)
    processes = int(config.get("num_processes", 1) or 1)
    if processes % machines:
        problems.append(f"{source}: num_processes {processes} is not a multiple of num_machines {machines}.")
    if config.get("distributed_type") == "MULTI_CPU" and processes > machines:
        problems.append(f"{source}: MULTI_CPU with {processes} processes: `accelerate launch` starts ONE process "
                        "per machine for it unless run under mpirun; use distributed_type MULTI_GPU with "
                        "use_cpu: true for several CPU processes on one machine.")
    uses_gpus = not config.get("use_cpu") and config.get("distributed_type") != "MULTI_CPU"
    per_machine = processes // machines
    if uses_gpus and visible_devices is not None and per_machine > visible_devices:
        problems.append(f"{source}: {per_machine} process(es) per machine but {visible_devices} visible GPU(s); "
                        "set num_processes to the GPU count or fix CUDA_VISIBLE_DEVICES.")
    if config.get("distributed_type") == "DEEPSPEED":
        section = config.get("deepspeed_config") or {}
        path = section.get("deepspeed_config_file")
        if path and not Path(path).is_file():
            problems.append(f"{source}: deepspeed_config_file `{path}` does not exist (paths are relative to the "
                            "directory you launch from).")
        elif not path:  # DeepSpeed keys written inline: lint the config Accelerate builds from them
            try:
                deepspeed = deepspeed_section_as_json(section)
            except ValueError as error:
                problems.append(f"{source}: deepspeed_config: {error}")
            else:
                problems += lint_deepspeed(deepspeed, source=f"{source} (inline deepspeed_config)")
    if config.get("use_cpu") and config.get("mixed_precision") == "fp16":
        problems.append(f"{source}: fp16 mixed precision is not supported on CPU; use bf16 or no.")
    return problems


def lint_fsdp_wrap_classes(layer_classes: list[str], model) -> list[str]:
    """FSDP wrap classes that do not occur in `model`."""
    present = {type(module).__name__ for module in model.modules()}
    missing = [name for name in layer_classes if name not in present]
    if not missing:
        return []
    candidates = getattr(model, "_no_split_modules", None) or sorted(present)[:8]
    return [f"FSDP wrap class(es) {', '.join(missing)} not found in {type(model).__name__}; "
            f"this model's layer class is {', '.join(candidates)}."]


def lint_file(path: str | Path, world_size: int | None = None, visible_devices: int | None = None) -> list[str]:
    """Lints a DeepSpeed JSON or an Accelerate YAML; unreadable files are problems too."""
    path = Path(path)
    if not path.is_file():
        return [f"{path}: no such file."]
    text = path.read_text()
    try:
        config = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as error:
        return [f"{path}: cannot parse: {error}"]
    if not isinstance(config, dict):
        return [f"{path}: expected a mapping at the top level."]
    if path.suffix == ".json":
        return lint_deepspeed(config, world_size, source=str(path))
    problems = lint_accelerate(config, visible_devices, source=str(path))
    try:
        from accelerate.commands.config.config_args import load_config_from_file

        load_config_from_file(str(path))
    except Exception as error:  # Accelerate's loader is the judge of its own format
        problems.append(f"{path}: Accelerate cannot load it: {type(error).__name__}: {error}")
    return problems
