"""What runs versus what was asked.

`describe_effective_config` lists, with the source of every value, what this launch will really run; rank 0 prints it
and writes `effective_config.json` before the first step. It warns when Accelerate used a default config file nobody
named, and lists DeepSpeed values that contradict Trainer arguments (found by Transformers' own DeepSpeed
integration, `HfTrainerDeepSpeedConfig.mismatches`). `StrategyCheckCallback` then checks, once Trainer has prepared
the model, that the engine is the one requested (a DeepSpeed engine at the requested ZeRO stage, parameters really
partitioned under ZeRO-3, optimizer states really on CPU under offload, FSDP really sharding) and stops with a
`RecipeError` naming the fallback otherwise. After the first optimizer step it records the bytes each rank holds.
"""

from __future__ import annotations

import hashlib
import os

import torch
from accelerate.utils import gather_object
from rich.console import Console
from rich.table import Table
from transformers import TrainerCallback

from finetune import outputs
from finetune.errors import RecipeError
from finetune.launch.self_launch import launch_plan
from finetune.launch.strategies import Strategy, running_strategy
from finetune.memory.callback import liger_kernels_applied
from finetune.memory.estimate import FusedKernels
from finetune.memory.ledger import StorageCount, local_parameters, optimizer_chain
from finetune.models.experts import load_balancing_weight
from finetune.models.loading import chat_template_text, trainable_dtype
from finetune.recipe.aliases import FOREIGN
from finetune.recipe.batch_plan import BatchPlan
from finetune.recipe.preflight import warmup_warning

# Trainer argument → the DeepSpeed key Trainer fills from it when the config says "auto".
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


def describe_effective_config(trainer, recipe) -> dict:
    """Every value that decides the run, with its source; `recipe.strategy` is what was asked for. `trainer`: Trainer,
    or the loop of an axis Trainer cannot drive (`recipe.runner`: its arguments, model and batch are read alike)."""
    args, sources, requested = trainer.args, recipe.sources, recipe.strategy
    deepspeed = recipe.deepspeed_config or {}
    launcher = "Accelerate config" if launched_by_accelerate() else "launcher"
    values: dict[str, dict] = {}

    def add(name, value, source):
        values[name] = {"value": value, "source": source}

    add("world_size", args.world_size, f"{launcher} (WORLD_SIZE)" if "WORLD_SIZE" in os.environ else "single process")
    add("seed", args.seed, "recipe" if "seed" in sources else "Trainer's default")  # rebuilds `tiny` for export/chat
    # the model before training and the answers' length in exact match: `finetune eval --compare-base` and `synthetic`
    add("model_name_or_path", recipe.model.model_name_or_path, sources.get("model_name_or_path", "recipe"))
    add("generation_max_new_tokens", recipe.data.generation_max_new_tokens,
        sources.get("generation_max_new_tokens", "default"))
    add("strategy", requested.kind, requested.source if requested.kind == "deepspeed" or requested.axis is not None
        else launcher)
    if requested.kind == "deepspeed":
        for key in ("zero_stage", "offload_optimizer", "offload_param"):
            add(key, getattr(requested, key), requested.source)
    if requested.kind == "fsdp":
        add("fsdp_sharding", requested.fsdp_sharding, launcher)
    precision_key = args.mixed_precision if args.mixed_precision in ("bf16", "fp16") else None  # Transformers' resolver
    precision_source = sources.get(precision_key, "default") if precision_key else sources.get("bf16", "default")
    if (deepspeed.get("bf16") or {}).get("enabled") == "auto":
        precision_source += " → DeepSpeed \"auto\""
    add("precision", precision_key or "fp32", precision_source)
    held = trainable_dtype(requested, args.mixed_precision, args.pure_bf16)
    add("trainable_weights", "fp32 (DeepSpeed's master copy)" if held is None else str(held).removeprefix("torch."),
        "pure_bf16" if args.pure_bf16
        else "fp32 master weights under any precision (finetune.models.loading.trainable_dtype)")
    for key in ("per_device_train_batch_size", "gradient_accumulation_steps", "learning_rate", "max_grad_norm"):
        source = sources.get(key, "default")
        deepspeed_value = deepspeed.get(DEEPSPEED_KEYS.get(key, ""), None)
        if deepspeed_value == "auto":
            source += " → DeepSpeed \"auto\" filled by Trainer"
        elif deepspeed_value is not None:
            source = f"{requested.source} ({DEEPSPEED_KEYS[key]}={deepspeed_value}); Trainer has {getattr(args, key)}"
        add(key, getattr(args, key), source)
    for key, source in sources.items():  # keys given under another name: the source says which (recipe.aliases)
        if any(mark in source for mark in FOREIGN) and key not in values:
            add(key, next(getattr(section, key) for section in recipe.sections if hasattr(section, key)), source)
    router_weight = load_balancing_weight(trainer.model)
    if router_weight is not None:  # a model with experts: the load-balancing loss's weight (finetune.models.experts)
        add("router_aux_loss_coef", router_weight, sources.get("router_aux_loss_coef", "the checkpoint's config "
                                                               "(load balancing on, as in TRL)"))
    if getattr(recipe, "runner", None) is None:
        add("global_batch_size", BatchPlan.running(args).global_batch_size, "micro-batch × processes × accumulation")
    else:  # the runner's ranks share batches as its axis says (a pipeline's stages and TP ranks: one replica)
        add("global_batch_size", recipe.batch_plan.global_batch_size, "micro-batch × replicas × accumulation")
    add("loss_normalization", args.loss_normalization, sources.get("loss_normalization", "default"))
    if hasattr(trainer, "full_logits_reason"):  # the toolkit's SFT trainer (TRL's trainers fuse their own heads)
        reason = trainer.full_logits_reason
        add("loss_head", "full logits" if reason else "fused (TRL's add_fused_lm_head: no full logits)",
            reason or "default")
    if args.torch_compile:  # Accelerate compiles the wrapped model; compile.json counts its graphs (train.compiled)
        add("torch_compile", f"{args.torch_compile_backend or 'inductor'}, mode {args.torch_compile_mode or 'default'}",
            sources.get("torch_compile", "recipe"))
    add("fused_kernels", *fused_kernels_asked(args, sources, torch.cuda.is_available()))
    if "max_steps" in sources:  # given, or a token budget's steps
        add("max_steps", args.max_steps, sources["max_steps"])
    if recipe.model.chat_template is not None:  # the template conversations were rendered with, and where it came from
        add("chat_template", recipe.model.chat_template, sources.get("chat_template", "recipe"))
        values["chat_template"]["sha256"] = hashlib.sha256(
            (chat_template_text(recipe.model.chat_template) or "").encode()).hexdigest()[:16]
    if recipe.data.mixture is not None:
        add("dataset_mixture", recipe.data.mixture.to_dict(), sources.get("dataset_mixture", "recipe"))

    warnings = []
    default_config = unnamed_accelerate_config()
    if default_config:
        warnings.append(f"accelerate launch used its default config {default_config}, which the command did not "
                        "name; pass --config_file to choose one.")
    plugin = getattr(getattr(getattr(trainer, "accelerator", None), "state", None), "deepspeed_plugin", None)
    mismatches = list(getattr(getattr(plugin, "hf_ds_config", None), "mismatches", []) or [])
    effective = {
        "values": values,
        "strategy": {"requested": requested.to_dict()},
        "warnings": warnings,
        "deepspeed_mismatches": [m.lstrip("- ") for m in mismatches],
    }
    if recipe.foreign_keys is not None:  # each key given in TRL's or another tool's name, and what became of it
        effective["foreign_keys"] = recipe.foreign_keys
    plan = launch_plan()
    if plan is not None:  # a self-launch's choice, what it rejected and the bytes it predicted (finetune.plan.launch)
        effective["plan"] = plan
    return effective


def fused_kernels_asked(args, sources: dict, cuda: bool) -> tuple[str, str]:
    """The fused kernels the run will compute with, and why: Liger's, those Trainer applies for `use_liger_kernel`
    (`liger_kernel_config` over Liger's defaults, as a TRL trainer left it: TRL turns the fused linear cross-entropy
    off for its own fused head), or PyTorch's own. `StrategyCheckCallback` adds those really applied once Trainer has
    patched the model."""
    if args.use_liger_kernel:
        kernels = FusedKernels.from_trainer_arguments(True, args.liger_kernel_config)
        config = " with `liger_kernel_config` over Liger's defaults" if args.liger_kernel_config else \
            " (Liger's defaults)"
        return f"Liger: {', '.join(kernels.names) or 'none'}", sources.get("use_liger_kernel", "recipe") + config
    if not cuda:
        return "PyTorch's own", "no CUDA GPU: Liger's kernels are Triton"
    if "use_liger_kernel" in sources:
        return "PyTorch's own", f"`use_liger_kernel: false` ({sources['use_liger_kernel']})"
    return "PyTorch's own", ("default: Liger's kernels (`use_liger_kernel`) stay off until their effect is measured "
                             "on a GPU here (docs/strategies.md)")


def record_applied_kernels(effective: dict, model) -> None:
    """Adds to the `fused_kernels` entry the Liger kernels really patched into the model (read off it: Liger's
    patch for a model type keeps only the kernels it has, and none for a type it does not know)."""
    entry = effective["values"].get("fused_kernels")
    if entry is not None and str(entry["value"]).startswith("Liger"):
        entry["applied"] = list(liger_kernels_applied(model).names)


def print_effective_config(effective: dict, console: Console | None = None) -> None:
    console = console or Console()
    table = Table(title="Effective configuration")
    for column in ("setting", "value", "source"):
        table.add_column(column)
    for name, entry in effective["values"].items():
        shown = str(entry["value"])
        table.add_row(name, shown if len(shown) <= 120 else f"{shown[:117]}...", entry["source"])
    console.print(table)
    for warning in effective["warnings"]:
        console.print(f"[yellow]warning:[/yellow] {warning}")
    for mismatch in effective["deepspeed_mismatches"]:
        console.print(f"[red]DeepSpeed config contradicts Trainer:[/red] {mismatch}")


def report_and_guard_launch(trainer, recipe) -> dict:
    """Writes and prints the effective configuration, stops on a DeepSpeed/Trainer contradiction, and arms the check
    that the strategy Trainer prepares is the requested one."""
    effective = describe_effective_config(trainer, recipe)
    if trainer.is_world_process_zero():
        outputs.write_record(trainer.args.output_dir, outputs.EFFECTIVE_CONFIG, effective)
        print_effective_config(effective)
    if effective["deepspeed_mismatches"]:
        source = recipe.strategy.source or ""
        what = "the DeepSpeed JSON" if source.startswith("DeepSpeed JSON") else f"the DeepSpeed settings of {source}"
        raise RecipeError(
            f"{what} contradicts the recipe: " + "; ".join(effective["deepspeed_mismatches"])
            + '. Set those DeepSpeed values to "auto" (Trainer fills them from the recipe) or change the recipe.'
        )
    trainer.add_callback(StrategyCheckCallback(trainer, effective, recipe.strategy))
    return effective


def held_bytes(model, optimizer) -> dict:
    """Bytes of parameters and optimizer states this rank really holds (ZeRO-3 partitions, not full tensors);
    the full ledger, gradients included, is `finetune.memory`'s."""
    params = StorageCount().add(local_parameters(model))
    states = StorageCount()
    if optimizer is not None:
        base = optimizer_chain(optimizer)[-1]
        states.add([value for state in base.state.values() for value in state.values()
                    if torch.is_tensor(value) and value.dim() > 0])
    held = {"params_bytes": params.total, "optimizer_bytes": states.total,
            "optimizer_devices": sorted(states.by_device)}
    split = split_parameters(model)
    if split is not None:
        held["split_parameters"] = split
    return held


def split_parameters(model) -> dict | None:
    """How many parameters are DTensors (split over ranks by tensor parallelism or FSDP2), and one of the first
    block's with its local and global shapes; None when none is."""
    from torch.distributed.tensor import DTensor

    names = [name for name, parameter in model.named_parameters() if isinstance(parameter, DTensor)]
    if not names:
        return None
    example = next((name for name in names if ".layers.0." in name), names[0])
    parameter = model.get_parameter(example)
    split = {"count": len(names), "of": sum(1 for _ in model.parameters()),
             "example": {"name": example, "local": list(parameter.to_local().shape), "global": list(parameter.shape)}}
    gathered = fsdp_gather_dtype(model)
    if gathered is not None:
        split["fsdp_gathers_in"] = gathered
    return split


def fsdp_gather_dtype(model) -> str | None:
    """The dtype FSDP2 all-gathers this model's shards in (its mixed-precision policy's, else the parameters' own);
    None where no module is FSDP2's."""
    from torch.distributed.fsdp import FSDPModule

    module = next((module for module in model.modules() if isinstance(module, FSDPModule)), None)
    if module is None:
        return None
    dtype = module._get_fsdp_state()._mp_policy.param_dtype or next(module.parameters()).dtype
    return str(dtype).removeprefix("torch.")


def comm_hooks(trainer) -> list[str]:
    """Names of the communication hooks registered on the DDP wrapper (none without DDP)."""
    wrapped = trainer.model_wrapped
    if not isinstance(wrapped, torch.nn.parallel.DistributedDataParallel):
        return []
    return [getattr(hook, "__name__", str(hook)) for hook, _ in getattr(wrapped, "_comm_hooks", [])]


def strategy_problems(requested: Strategy, running: Strategy, trainer) -> list[str]:
    problems = []
    world_size = trainer.args.world_size
    asked, got = requested.for_world_size(world_size), running.for_world_size(world_size)
    if asked.kind != got.kind:
        hint = ""
        if asked.kind == "fsdp" and trainer.args.use_cpu:
            hint = (" On CPU, Trainer's use_cpu turns FSDP into DDP without a word: run FSDP on GPUs, or use "
                    "DeepSpeed ZeRO-3 (accelerate_configs/deepspeed_zero3.yaml) to shard on CPU.")
        problems.append(f"{asked.kind} was requested but Trainer prepared {got.kind}: nothing is sharded as "
                        f"asked.{hint}")
        return problems
    if asked.kind == "deepspeed":
        if asked.zero_stage != got.zero_stage:
            problems.append(f"ZeRO stage {asked.zero_stage} was requested but the engine runs stage {got.zero_stage}.")
        for key in ("offload_optimizer", "offload_param"):
            if getattr(asked, key) and getattr(asked, key) != getattr(got, key):
                problems.append(f"{key} to {getattr(asked, key)} was requested but the engine has {getattr(got, key)}.")
        if asked.offload_optimizer == "cpu":
            devices = held_bytes(trainer.model, trainer.optimizer)["optimizer_devices"]
            if devices and devices != ["cpu"]:
                problems.append(f"optimizer offload to CPU was requested but optimizer states are on {devices}.")
        if got.zero_stage == 3 and world_size > 1:
            unpartitioned = [n for n, p in trainer.model.named_parameters() if not hasattr(p, "ds_tensor")]
            if unpartitioned:
                problems.append(f"ZeRO-3 is on but {len(unpartitioned)} parameters are not partitioned "
                                f"(e.g. {unpartitioned[0]}).")
    hook = trainer.args.ddp_comm_hook
    if hook != "no" and not any(name.startswith(hook) for name in comm_hooks(trainer)):
        problems.append(f"`ddp_comm_hook: {hook}` was requested but no {hook} hook is registered "
                        f"(strategy: {got.kind}); communication hooks apply to DDP only.")
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size != launched:
        problems.append(f"the launcher started {launched} processes but Trainer runs with world size "
                        f"{world_size}: each rank trains alone.")
    return problems


def warn_about_warmup(args, state) -> str | None:
    """A run of `num_train_epochs` knows its steps only now: rank 0 says when the warmup lasts all of them (a run
    of `max_steps` was told when the recipe was read, `finetune.recipe.parse`)."""
    if args.max_steps > 0:
        return None
    warning = warmup_warning(args.warmup_steps, args.learning_rate, state.max_steps)
    if warning and state.is_world_process_zero:
        print(f"warning: {warning}")
    return warning


class StrategyCheckCallback(TrainerCallback):
    """Stops at the start of training when the prepared strategy is not the requested one; after the first
    optimizer step, adds each rank's held bytes to `effective_config.json`."""

    def __init__(self, trainer, effective: dict, requested: Strategy):
        self.trainer = trainer
        self.effective = effective
        self.requested = requested
        self.measured = False

    def on_train_begin(self, args, state, control, **kwargs):
        warning = warn_about_warmup(args, state)
        if warning:
            self.effective["warnings"].append(warning)
        running = running_strategy(self.trainer)
        self.effective["strategy"]["running"] = running.to_dict()
        record_applied_kernels(self.effective, self.trainer.model)  # Trainer patched them as `train` started
        if running.kind == "ddp":
            self.effective["strategy"]["running"]["comm_hooks"] = comm_hooks(self.trainer)
        problems = strategy_problems(self.requested, running, self.trainer)
        if problems:
            raise RecipeError(" ".join(problems))

    def on_step_end(self, args, state, control, model=None, optimizer=None, **kwargs):
        if self.measured:
            return
        self.measured = True
        mine = {"rank": args.process_index, **held_bytes(model, optimizer)}
        ranks = gather_object([mine]) if args.world_size > 1 else [mine]
        self.effective["ranks"] = sorted(ranks, key=lambda entry: entry["rank"])
        if state.is_world_process_zero:  # keeps what was added since (the resume record, finetune.train.trainer)
            written = outputs.read_record(args.output_dir, outputs.EFFECTIVE_CONFIG, missing={})
            outputs.write_record(args.output_dir, outputs.EFFECTIVE_CONFIG, {**written, **self.effective})
