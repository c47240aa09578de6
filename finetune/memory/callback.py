"""`MemoryReportCallback`: per rank, what is really held next to what the estimator predicted for the same run.

Works in any `Trainer`: `Trainer(..., callbacks=[MemoryReportCallback(sequence_length=2048)])`. At the first
optimizer step it reads the ledger (`finetune.memory.ledger`), and between the micro-steps of the first
`PROBED_STEPS` accumulation windows the gradients held there, then stays idle; at the end of training it adds
the peak, gathers every rank's record and rank 0 writes `memory_report.json`, `.md` and `.png`.
"""

from __future__ import annotations

import os

import torch
from accelerate.state import AcceleratorState
from accelerate.utils import DistributedType, gather_object
from transformers import TrainerCallback
from transformers.utils import logging

from finetune.errors import RecipeError
from finetune.launch.strategies import (
    PURE_BF16_KINDS,
    Strategy,
    fsdp_fills_from_rank_zero,
    loaded_sharded,
    prepared_strategy,
)
from finetune.memory.estimate import (
    FusedKernels,
    MethodTerms,
    Setup,
    estimate,
    generated_at_once,
    kv_cache_bytes_per_token,
    precision_of,
)
from finetune.memory.ledger import (
    GradientProbe,
    PhasePeaks,
    StorageCount,
    gradient_peaks,
    local_parameters,
    measure_states,
    peak_memory,
)
from finetune.memory.report import write_memory_report
from finetune.memory.shapes import shape_of

logger = logging.get_logger(__name__)
STATE_KEYS = ("params_bytes", "grads_bytes", "optimizer_bytes")
GRADIENT_PEAK_KEYS = ("grads_between_micro_steps_bytes", "grads_peak_bytes")
# Accumulation windows whose micro-steps are probed: the first (before DeepSpeed allocates its buffers) and one
# after a step (steady state).
PROBED_STEPS = 2


def optimizer_kind(optim: str) -> str | None:
    """Trainer's `optim` name → the estimator's optimizer family; None when the estimator has no model of it."""
    name = str(getattr(optim, "value", optim))
    if "adam" in name:
        return "adamw_8bit" if "8bit" in name else "adamw"
    return "sgd" if name == "sgd" else None


def running_setup(args, model, sequence_length: int | None,
                  method: MethodTerms = MethodTerms()) -> tuple[Strategy, Setup]:
    """The strategy Accelerate prepared for this run and the estimator's `Setup` for it."""
    state = AcceleratorState()
    local_processes = int(os.environ.get("LOCAL_WORLD_SIZE", args.world_size))
    strategy = loaded_sharded(model) or prepared_strategy(state, args.world_size,
                                                          nodes=max(1, args.world_size // local_processes))
    sub_group_size, sharded_loading = None, True  # ZeRO-3 under `finetune train` loads sharded whatever the plugin says
    if state.distributed_type == DistributedType.DEEPSPEED:
        config = state.deepspeed_plugin.deepspeed_config
        half = config.get("bf16", {}).get("enabled") is True or config.get("fp16", {}).get("enabled") is True
        precision = "bf16" if half else "fp32"
        sub_group_size = config.get("zero_optimization", {}).get("sub_group_size")
    else:
        if state.distributed_type == DistributedType.FSDP:
            sharded_loading = fsdp_fills_from_rank_zero()
        precision = precision_of(args.mixed_precision)
    config = model.config
    trainable_parameters = [p for p in model.parameters() if p.requires_grad]
    trainable = sum(getattr(p, "ds_numel", p.numel()) for p in trainable_parameters)
    # What the trainable weights are really held in (finetune.models.loading.trainable_dtype), read off the model.
    pure_bf16 = state.distributed_type != DistributedType.DEEPSPEED and precision != "fp16" \
        and bool(trainable_parameters) and all(p.dtype == torch.bfloat16 for p in trainable_parameters)
    return strategy, Setup(
        **strategy.estimator_options(),
        rank=args.process_index,
        precision=precision,
        pure_bf16=pure_bf16 and strategy.kind in PURE_BF16_KINDS,
        num_gpus=args.world_size,
        gpus_per_node=local_processes,
        optimizer=optimizer_kind(args.optim) or "adamw",
        micro_batch_size=args.per_device_train_batch_size,
        sequence_length=sequence_length or getattr(config, "max_position_embeddings", 2048),
        gradient_checkpointing=bool(args.gradient_checkpointing),
        attention="eager" if getattr(config, "_attn_implementation", "sdpa") == "eager" else "sdpa",
        trainable_parameters=trainable,
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        sub_group_size=None if sub_group_size is None else int(sub_group_size),
        sharded_loading=sharded_loading,
        method=method,
        peft=hasattr(model, "peft_config"),
        lora_dropout=_lora_dropout(model),
        kernels=liger_kernels_applied(model),
    )


def liger_kernels_applied(model) -> FusedKernels:
    """The Liger kernels patched into `model` (Trainer applies them at the start of `train`), read off the model
    without importing Liger: its patch renames the modules it rebinds (`_get_name`: LigerRMSNorm, LigerSwiGLUMLP) and
    puts functions of its own package in place of the model's rotary embedding, forward (the fused linear
    cross-entropy) and `torch.nn.functional.cross_entropy` (liger_kernel/transformers/monkey_patch.py)."""
    import sys

    base = model.get_base_model() if hasattr(model, "get_base_model") else model

    def from_liger(function) -> bool:
        return str(getattr(function, "__module__", "")).startswith("liger_kernel")

    names = {module._get_name() for module in base.modules()}
    modeling = sys.modules.get(type(base).__module__)
    return FusedKernels(
        rope=from_liger(getattr(modeling, "apply_rotary_pos_emb", None)),
        rms_norm=any(name.startswith("LigerRMSNorm") for name in names),
        swiglu=any(name.startswith("Liger") and "SwiGLU" in name for name in names),
        cross_entropy=from_liger(torch.nn.functional.cross_entropy),
        fused_linear_cross_entropy=from_liger(getattr(base.forward, "__func__", base.forward)),
    )


def _lora_dropout(model) -> float:
    """The active LoRA adapter's dropout (0 without one)."""
    config = getattr(model, "active_peft_config", None)  # peft's PeftModel
    return float(getattr(config, "lora_dropout", 0.0) or 0.0)


def predicted_ledger(model, args, sequence_length: int | None,
                     method: MethodTerms = MethodTerms()) -> tuple[Strategy, dict]:
    strategy, setup = running_setup(args, model, sequence_length, method)
    shape = shape_of(model)
    prediction = estimate(shape, setup)
    cpu_only = not torch.cuda.is_available()  # the "GPU" partitions are host memory too
    offloaded = prediction.offloaded
    ledger = {key: getattr(prediction, key) + offloaded.get(key, 0) for key in STATE_KEYS}
    ledger["grads_between_micro_steps_bytes"] = prediction.grads_between_micro_steps_bytes
    ledger["grads_peak_bytes"] = max(ledger["grads_bytes"], prediction.grads_between_micro_steps_bytes)
    ledger["offloaded_bytes"] = sum(offloaded.values())
    if setup.method.reference_model:
        ledger["reference_bytes"] = prediction.reference_bytes
    if setup.method.reward_model_parameters:
        ledger["reward_models_bytes"] = prediction.reward_models_bytes
    if setup.method.generates:  # at the planned lengths, and per token to compare with the round measured
        ledger["generation_bytes"] = prediction.generation_bytes
        ledger["generated_at_once"] = generated_at_once(setup)
        ledger["kv_cache_bytes_per_token"] = kv_cache_bytes_per_token(shape, setup)
    ledger["host_load_bytes"] = prediction.host_load_bytes_of_rank(args.process_index, device_is_host=cpu_only)
    ledger["peak_bytes"] = prediction.total_bytes
    ledger["estimate"] = prediction.to_dict()
    if optimizer_kind(args.optim) is None:
        ledger["note"] = f"optimizer {args.optim} is not modelled: AdamW's 8 bytes/param assumed"
    return strategy, ledger


def reference_bytes(reference_model) -> int:
    """Bytes of the reference model's parameters this rank holds (ZeRO-3: its partition); 0 without one."""
    return 0 if reference_model is None else StorageCount().add(local_parameters(reference_model)).total


def every_ranks_figures(figures: dict, world_size: int) -> dict:
    """Rank 0's `memory/*` as they are and each other rank's as `memory/rank_N/*`, the same on every rank: Trainer's
    `report_to` integrations log only global rank 0's logs. A collective: every rank calls it at the same log."""
    if world_size == 1:
        return figures
    every_rank = gather_object([figures])
    named = dict(every_rank[0])
    for rank, theirs in enumerate(every_rank[1:], start=1):
        named.update({key.replace("memory/", f"memory/rank_{rank}/", 1): value for key, value in theirs.items()})
    return named


class MemoryReportCallback(TrainerCallback):
    """Measures each rank's parameters, gradients, optimizer states and peak memory; writes the report.

    `sequence_length` sizes the predicted activations (default: the model's maximum context). The measured bytes go
    into the first training log as `memory/*` (rank 0's) and `memory/rank_N/*` (rank N's); in a plain `Trainer`,
    `finetune.train.trainer.log_metrics_first(trainer)` lets `report_to` (TensorBoard, W&B, MLflow) see them."""

    adds_logged_metrics = True  # finetune.train.trainer.log_metrics_first: runs before the reporting integrations

    def __init__(self, sequence_length: int | None = None, output_dir: str | None = None,
                 method: MethodTerms = MethodTerms()):
        self.sequence_length = sequence_length
        self.output_dir = output_dir
        self.method = method  # what the training method adds to the prediction (finetune/train/methods/)
        # A preference method's frozen reference model as the trainer prepared it (`trainer.ref_model`; None under
        # LoRA, where the reference is the policy without its adapters), counted as `reference_bytes`.
        self.reference_model = None
        # An online RL method's frozen reward models (`reward_models_bytes`) and the KV cache its generation rounds
        # held at their largest (`generation_cache`: set by its trainer, finetune.memory.generation.CacheMeter)
        self.reward_models: list = []
        self.generation_cache = None
        # Host RAM this rank took while the model loaded (`finetune.memory.ledger.HostLoadProbe`), when measured.
        self.host_load_bytes: int | None = None
        self.reference_read_bytes: int | None = None  # a frozen reference's weights this rank read from its checkpoint
        self.probe: GradientProbe | None = None
        self.measured: dict | None = None
        self.pending_log: dict | None = None
        self.phases = PhasePeaks()
        self.records: list[dict] | None = None  # every rank's record, on global rank 0 once training ended

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        if optimizer is not None and self.measured is None:
            self.probe = GradientProbe(model, optimizer)

    def on_substep_end(self, args, state, control, **kwargs):
        """After a micro-step that is not an accumulation boundary (transformers/trainer.py calls it then)."""
        if self.probe is not None:
            self.probe.between_micro_steps()
            self.phases.record("micro_step")

    def on_step_end(self, args, state, control, model=None, optimizer=None, **kwargs):
        if self.probe is None or not self.probe.done:
            return
        self.phases.record("step")
        if self.measured is None:
            self.measured = measure_states(model, optimizer, self.probe.by_device())
            if self.method.reference_model:
                self.measured["reference_bytes"] = reference_bytes(self.reference_model)
            if self.method.reward_model_parameters:
                self.measured["reward_models_bytes"] = sum(reference_bytes(model) for model in self.reward_models)
            self.probe.remove()
            keys = (*STATE_KEYS, *GRADIENT_PEAK_KEYS, "reference_bytes", "reward_models_bytes")
            self.pending_log = {f"memory/{key}": value for key, value in self.measured.items() if key in keys}
        if state.global_step >= PROBED_STEPS or args.gradient_accumulation_steps == 1:
            self._finish_probe()

    def _finish_probe(self) -> None:
        if self.probe is not None:
            self.probe.remove()
            self.measured = gradient_peaks(self.measured, self.probe.between)
            for key in GRADIENT_PEAK_KEYS:
                if self.pending_log is not None:
                    self.pending_log[f"memory/{key}"] = self.measured[key]
            self.probe = None

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self.pending_log and logs is not None:  # once: into the printed logs and the log history
            figures = every_ranks_figures(self.pending_log, args.world_size)
            logs.update(figures)
            if state.log_history:
                state.log_history[-1].update(figures)
            self.pending_log = None

    def on_train_end(self, args, state, control, model=None, **kwargs):
        if self.probe is not None and self.measured is not None:
            self._finish_probe()
        elif self.probe is not None:
            self.probe.remove()
        try:
            strategy, predicted = predicted_ledger(model, args, self.sequence_length, self.method)
            strategy = strategy.label
        except RecipeError as error:  # a model the estimator cannot read: report the measurement alone
            logger.warning("memory report: no prediction for this run (%s)", error)
            strategy, predicted = AcceleratorState().distributed_type.value.lower(), None
        measured = None if self.measured is None else {**self.measured, **peak_memory(self.phases.by_phase)}
        if measured is not None and self.host_load_bytes is not None:
            measured["host_load_bytes"] = self.host_load_bytes
        if measured is not None and self.reference_read_bytes is not None:
            measured["reference_read_bytes"] = self.reference_read_bytes
        if measured is not None and self.generation_cache is not None and self.generation_cache.largest:
            measured["generation_cache"] = self.generation_cache.largest
        if measured is not None and self.phases.by_phase:
            measured["peak_bytes_by_phase"] = dict(self.phases.by_phase)
        record = {"rank": args.process_index, "world_size": args.world_size, "strategy": strategy,
                  "measured": measured, "predicted": predicted}
        records = gather_object([record]) if args.world_size > 1 else [record]
        if state.is_world_process_zero:
            self.records = sorted(records, key=lambda r: r["rank"])
            paths = write_memory_report(sorted(records, key=lambda r: r["rank"]), self.output_dir or args.output_dir)
            logger.info("memory report written to %s", ", ".join(map(str, paths)))
