"""Launch preflight: what this process was asked to run, checked before `TrainingArguments` starts a process group.

The DeepSpeed config (a file, or the one Accelerate builds from inline keys) is linted; combinations that cannot
work (per-node saving under ZeRO-3 or FSDP1, a bf16 comm hook without NCCL, more processes than GPUs, a half-written
checkpoint to resume) stop with a `RecipeError` that says what to change.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from finetune.configs.lint import lint_deepspeed
from finetune.errors import RecipeError
from finetune.strategies import Strategy, is_true, launched_strategy


def preflight_launch(training_inputs: dict[str, Any]) -> tuple[Strategy, dict | None]:
    """Checks the launch the training section (as parsed, before `TrainingArguments`) and the launcher describe;
    returns the strategy they ask for and its DeepSpeed config (None without DeepSpeed)."""
    world_size = int(os.environ["WORLD_SIZE"]) if "WORLD_SIZE" in os.environ else None
    strategy, deepspeed = launched_strategy(training_inputs.get("deepspeed"))
    if deepspeed is not None:
        problems = lint_deepspeed(deepspeed, world_size, source=strategy.source or "DeepSpeed config")
        if problems:
            raise RecipeError(" ".join(problems))
    if is_true(training_inputs.get("save_on_each_node")) and strategy.zero_stage == 3:
        raise RecipeError("`save_on_each_node: true` with ZeRO-3: DeepSpeed gathers the partitioned weights on "
                          "global rank 0 only; save to a filesystem shared by the nodes, or use ZeRO-2, or "
                          "`finetune export` on node 0.")
    if is_true(training_inputs.get("save_on_each_node")) and strategy.kind == "fsdp" and strategy.fsdp_version == 1:
        raise RecipeError("`save_on_each_node: true` with FSDP1: its full state dict is gathered on global rank 0 "
                          "only; set `fsdp_version: 2` in the Accelerate config (the shipped FSDP configs do), or save "
                          "to a filesystem shared by the nodes.")
    resume = training_inputs.get("resume_from_checkpoint")
    if resume not in (None, "", "auto", "false", "False"):
        from finetune.checkpoints import check_explicit_checkpoint

        check_explicit_checkpoint(resume)
    if training_inputs.get("ddp_comm_hook") == "bf16" and not torch.cuda.is_available():
        raise RecipeError("`ddp_comm_hook: bf16` needs CUDA GPUs with NCCL; use fp16 (works over gloo) or no.")
    local_processes = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if not is_true(training_inputs.get("use_cpu")) and torch.cuda.is_available() \
            and local_processes > torch.cuda.device_count():
        raise RecipeError(f"{local_processes} processes per machine but {torch.cuda.device_count()} visible GPU(s); "
                          "launch with --num_processes equal to the GPU count or fix CUDA_VISIBLE_DEVICES.")
    return strategy, deepspeed


def training_precision(training_inputs: dict[str, Any]) -> str:
    """The mixed precision Trainer will run: `bf16`/`fp16` from the recipe, else what `accelerate launch` set."""
    if is_true(training_inputs.get("fp16")):  # in TrainingArguments' order
        return "fp16"
    if is_true(training_inputs.get("bf16")):
        return "bf16"
    return os.environ.get("ACCELERATE_MIXED_PRECISION", "no")


def check_qlora(torch_dtype: str, training_inputs: dict[str, Any], strategy: Strategy) -> None:
    """QLoRA under a strategy that shards parameters stores the packed 4-bit weights in the compute dtype
    (finetune.models.qlora_load); a mixed precision of the other half dtype would cast those bytes as numbers."""
    from finetune.models import qlora_compute_dtype

    if not strategy.shards_parameters:
        return
    storage = {torch.float16: "fp16", torch.bfloat16: "bf16"}[qlora_compute_dtype(torch_dtype)]
    precision = training_precision(training_inputs)
    if precision in ("bf16", "fp16") and precision != storage:
        fix = "`bf16: true`" if storage == "bf16" else "`fp16: true`"
        raise RecipeError(
            f"`use_qlora: true` under {strategy.describe()}: the 4-bit weights are stored as {storage} so that they "
            f"can be sharded (`torch_dtype: {torch_dtype}`), and {precision} mixed precision would cast them as "
            f"numbers, destroying them. Train with {fix}, or set `torch_dtype` to match {precision} "
            f"({'bfloat16' if precision == 'bf16' else 'float16'}).")


def check_pure_bf16(training_inputs: dict[str, Any], strategy: Strategy) -> None:
    """`pure_bf16` (finetune.models.trainable_dtype) is asked for by name and means what it says where the model's
    own tensors are stepped: one process and DDP. DeepSpeed keeps fp32 masters of its own, and Accelerate's FSDP
    path upcasts trainable parameters, so there the key would silently do nothing."""
    if not is_true(training_inputs.get("pure_bf16")):
        return
    if strategy.kind not in ("single", "ddp"):
        raise RecipeError(f"`pure_bf16: true` under {strategy.describe()}: it applies to one process and DDP only "
                          "(DeepSpeed and FSDP keep fp32 master weights of their own); drop it or launch with DDP.")
    if training_precision(training_inputs) == "fp16":
        raise RecipeError("`pure_bf16: true` with fp16 mixed precision: choose one (`fp16: false`, or drop "
                          "`pure_bf16`).")
