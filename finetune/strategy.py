"""What runs versus what was asked.

`effective_config` describes, with the source of every value, what this launch will really run and is
written to `output_dir/effective_config.json` before the first step. `StrategyCheckCallback` then
checks, once Trainer has prepared the model, that the engine is the one requested (a DeepSpeed
engine at the requested ZeRO stage, parameters really partitioned under ZeRO-3, optimizer states
really on CPU under offload, FSDP really sharding) and stops with a `RecipeError` naming the
fallback otherwise. After the first optimizer step it records the bytes each rank holds.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from accelerate.utils import gather_object
from transformers import TrainerCallback

from finetune.errors import RecipeError
from finetune.memory.ledger import StorageCount, local_parameters, optimizer_chain


def launch_deepspeed_config(deepspeed=None) -> tuple[str | None, dict | None]:
    """`(path, config)` of the DeepSpeed config this process will use: Trainer's `deepspeed` argument (a path
    or a dict), else the JSON an Accelerate DeepSpeed config named; `(None, None)` without DeepSpeed."""
    if isinstance(deepspeed, dict):
        return None, deepspeed
    path = deepspeed
    if path is None and os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true":
        path = os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE")
    if path is None:
        return None, None
    return path, json.loads(Path(path).read_text())


def requested_strategy(args, deepspeed_file: str | None, deepspeed: dict | None) -> dict:
    """The strategy the launcher's config and the recipe ask for, read from what they hand this process."""
    if deepspeed is not None:
        zero = deepspeed.get("zero_optimization", {})
        return {
            "strategy": "deepspeed",
            "zero_stage": zero.get("stage", 0),
            "offload_optimizer": (zero.get("offload_optimizer") or {}).get("device"),
            "offload_param": (zero.get("offload_param") or {}).get("device"),
            "config_file": deepspeed_file,
        }
    if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true" or args.fsdp:
        return {"strategy": "fsdp"}
    return {"strategy": "ddp" if int(os.environ.get("WORLD_SIZE", "1")) > 1 else "single"}


def running_strategy(trainer) -> dict:
    """The strategy Trainer actually prepared, read from the wrapped model and optimizer."""
    wrapped = trainer.model_wrapped
    if trainer.is_deepspeed_enabled and hasattr(wrapped, "zero_optimization_stage"):
        return {
            "strategy": "deepspeed",
            "zero_stage": wrapped.zero_optimization_stage(),
            "offload_optimizer": _offload_device(wrapped.zero_offload_optimizer()),
            "offload_param": _offload_device(wrapped.zero_offload_param()),
        }
    if trainer.is_fsdp_enabled and _is_fsdp_sharded(trainer.model):
        return {"strategy": "fsdp"}
    if isinstance(wrapped, torch.nn.parallel.DistributedDataParallel):
        hooks = [getattr(hook, "__name__", str(hook)) for hook, _ in getattr(wrapped, "_comm_hooks", [])]
        return {"strategy": "ddp", "comm_hooks": hooks}
    return {"strategy": "single"}


def _offload_device(offload_config) -> str | None:
    device = getattr(offload_config, "device", None)
    device = getattr(device, "value", device)  # an enum in some DeepSpeed versions, a str in others
    return None if device in (None, "none") else str(device)


def _is_fsdp_sharded(model) -> bool:
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters()) or any(
        type(m).__name__.startswith(("FullyShardedDataParallel", "FSDP")) for m in model.modules()
    )


def held_bytes(model, optimizer) -> dict:
    """Bytes of parameters and optimizer states this rank really holds (ZeRO-3 partitions, not full tensors);
    the full ledger, gradients included, is `finetune.memory`'s."""
    params = StorageCount().add(local_parameters(model))
    states = StorageCount()
    if optimizer is not None:
        base = optimizer_chain(optimizer)[-1]
        states.add([value for state in base.state.values() for value in state.values()
                    if torch.is_tensor(value) and value.dim() > 0])
    return {"params_bytes": params.total, "optimizer_bytes": states.total, "optimizer_devices": sorted(states.by_device)}


def strategy_problems(requested: dict, running: dict, trainer) -> list[str]:
    problems = []
    asked, got = requested["strategy"], running["strategy"]
    if asked != got:
        hint = ""
        if asked == "fsdp" and trainer.args.use_cpu:
            hint = (" On CPU, Trainer's use_cpu turns FSDP into DDP without a word: run FSDP on GPUs, or use "
                    "DeepSpeed ZeRO-3 (accelerate_configs/deepspeed_zero3.yaml) to shard on CPU.")
        problems.append(f"{asked} was requested but Trainer prepared {got}: nothing is sharded as asked.{hint}")
        return problems
    if asked == "deepspeed":
        if requested["zero_stage"] != running["zero_stage"]:
            problems.append(f"ZeRO stage {requested['zero_stage']} was requested but the engine runs stage "
                            f"{running['zero_stage']}.")
        for key in ("offload_optimizer", "offload_param"):
            if requested[key] and requested[key] != running[key]:
                problems.append(f"{key} to {requested[key]} was requested but the engine has {running[key]}.")
        if requested["offload_optimizer"] == "cpu":
            devices = held_bytes(trainer.model, trainer.optimizer)["optimizer_devices"]
            if devices and devices != ["cpu"]:
                problems.append(f"optimizer offload to CPU was requested but optimizer states are on {devices}.")
        if running["zero_stage"] == 3 and trainer.args.world_size > 1:
            unpartitioned = [n for n, p in trainer.model.named_parameters() if not hasattr(p, "ds_tensor")]
            if unpartitioned:
                problems.append(f"ZeRO-3 is on but {len(unpartitioned)} parameters are not partitioned "
                                f"(e.g. {unpartitioned[0]}).")
    hook = trainer.args.ddp_comm_hook
    if hook != "no" and not any(name.startswith(hook) for name in running.get("comm_hooks", [])):
        problems.append(f"`ddp_comm_hook: {hook}` was requested but no {hook} hook is registered "
                        f"(strategy: {got}); communication hooks apply to DDP only.")
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if trainer.args.world_size != world_size:
        problems.append(f"the launcher started {world_size} processes but Trainer runs with world size "
                        f"{trainer.args.world_size}: each rank trains alone.")
    return problems


class StrategyCheckCallback(TrainerCallback):
    """Stops at the start of training when the prepared strategy is not the requested one; after the first
    optimizer step, adds each rank's held bytes to `effective_config.json`."""

    def __init__(self, trainer, effective: dict):
        self.trainer = trainer
        self.effective = effective
        self.measured = False

    def on_train_begin(self, args, state, control, **kwargs):
        running = running_strategy(self.trainer)
        self.effective["strategy"]["running"] = running
        problems = strategy_problems(self.effective["strategy"]["requested"], running, self.trainer)
        if problems:
            raise RecipeError(" ".join(problems))

    def on_step_end(self, args, state, control, model=None, optimizer=None, **kwargs):
        if self.measured:
            return
        self.measured = True
        mine = {"rank": args.process_index, **held_bytes(model, optimizer)}
        ranks = gather_object([mine]) if args.world_size > 1 else [mine]
        self.effective["ranks"] = sorted(ranks, key=lambda entry: entry["rank"])
        if state.is_world_process_zero:
            write_effective_config(self.effective, args.output_dir)


def write_effective_config(effective: dict, output_dir: str) -> Path:
    path = Path(output_dir, "effective_config.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(effective, indent=2, default=str) + "\n")
    return path
