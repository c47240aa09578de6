"""Launch preflight: what this process was asked to run, checked before `TrainingArguments` starts a process group.

The DeepSpeed config (a file, or the one Accelerate builds from inline keys) is linted; combinations that cannot
work (per-node saving under ZeRO-3 or FSDP1, a bf16 comm hook without NCCL, more processes than GPUs, several GPUs
but one process, bf16 on a GPU without it, a half-written checkpoint to resume) stop with a `RecipeError` that says
what to change.
"""

from __future__ import annotations

import math
import os
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch

from finetune.configs.lint import lint_deepspeed
from finetune.errors import RecipeError, launched_rank
from finetune.launch.devices import visible_gpu
from finetune.launch.parallelism import (
    Parallelism,
    describe_as_accelerate,
    requested,
    requested_on,
)
from finetune.launch.parallelism import launched as launched_parallelism
from finetune.launch.strategies import PURE_BF16_KINDS, Strategy, is_true, launched_strategy, shipped


def preflight_launch(training_inputs: dict[str, Any]) -> tuple[Strategy, dict | None]:
    """Checks the launch the training section (as parsed, before `TrainingArguments`) and the launcher describe;
    returns the strategy they ask for and its DeepSpeed config (None without DeepSpeed)."""
    check_both_sharding_engines(training_inputs)
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
        from finetune.checkpoints.complete import check_explicit_checkpoint

        check_explicit_checkpoint(resume)
    if training_inputs.get("ddp_comm_hook") == "bf16" and not torch.cuda.is_available():
        raise RecipeError("`ddp_comm_hook: bf16` needs CUDA GPUs with NCCL; use fp16 (works over gloo) or no.")
    local_processes = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if not is_true(training_inputs.get("use_cpu")) and torch.cuda.is_available() \
            and local_processes > torch.cuda.device_count():
        raise RecipeError(f"{local_processes} processes per machine but {torch.cuda.device_count()} visible GPU(s); "
                          "launch with --num_processes equal to the GPU count or fix CUDA_VISIBLE_DEVICES.")
    check_output_dir(training_inputs.get("output_dir"))
    check_optimizer_library(training_inputs.get("optim"))
    check_hub_push(training_inputs)
    check_per_node_sizes(deepspeed)
    check_one_process_per_gpu(training_inputs)
    check_precision_on_gpu(training_inputs)
    check_fused_kernels(training_inputs)
    return strategy, deepspeed


def check_parallelism(training_inputs: dict[str, Any], model_args, inside_stages: bool = False) -> Parallelism:
    """The sizes of Accelerate's mesh the recipe or the launch names, resolved against the launch (each axis checks
    itself against the rest of the recipe: finetune.axes, `Axis.check`). `inside_stages`: a pipeline runs, whose
    stages split their own layers (finetune.train.axes.pipeline.loop): the sizes are returned as asked, for the
    pipeline to place on its mesh; nothing is loaded sharded."""
    from finetune.memory.shapes import resolve_config

    if inside_stages:
        return requested(training_inputs)[0]
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    on_gpu = torch.cuda.is_available() and not is_true(training_inputs.get("use_cpu"))
    model_config = lru_cache(maxsize=1)(lambda: resolve_config(model_args.model_name_or_path))
    return requested_on(training_inputs, on_gpu, world_size, model_config)[0]


def check_optimizer_library(optim: Any) -> None:
    """Trainer's bitsandbytes optimizers (8-bit or paged states: `adamw_8bit`, axolotl's default) need bitsandbytes,
    whose absence Trainer reports only once the model is loaded, in a traceback."""
    import importlib.util

    name = str(optim or "")
    if ("8bit" in name or "bnb" in name or name.startswith("paged_")) and importlib.util.find_spec(
            "bitsandbytes") is None:
        raise RecipeError(f"`optim: {name}` keeps its states with bitsandbytes, which is not installed here: install "
                          "it (it needs a CUDA GPU), or give `optim: adamw_torch` (32-bit states).")


def check_fused_kernels(training_inputs: dict[str, Any]) -> None:
    """`use_liger_kernel` patches the model with Liger's Triton kernels (Trainer's `apply_liger_kernel`), which need
    a CUDA GPU and the `liger-kernel` package; without either Trainer stops only once the model is loaded, in a
    traceback. Off by default: its effect is still to be measured on a GPU (docs/strategies.md, "What runs where")."""
    import importlib.util

    if not is_true(training_inputs.get("use_liger_kernel")):
        return
    gpu = None if is_true(training_inputs.get("use_cpu")) else visible_gpu()
    if gpu is None:
        raise RecipeError("`use_liger_kernel: true` runs Liger's Triton kernels, which need a CUDA GPU, and this "
                          "process trains on the CPU: drop `use_liger_kernel` to train with PyTorch's own kernels.")
    if importlib.util.find_spec("liger_kernel") is None or importlib.util.find_spec("triton") is None:
        raise RecipeError(f"`use_liger_kernel: true` on {gpu.describe()} needs the `liger-kernel` package (and Triton, "
                          "which it brings), not installed here: `pip install liger-kernel`, or drop "
                          "`use_liger_kernel`.")


def check_loss_head(method, training_inputs: dict[str, Any]) -> None:
    """`fused_lm_head: false` asks for the loss from the full logits, which only the trainers with both paths have
    (`Method.full_logits_on_request`): some of TRL's trainers always score through its fused head, and a reward model
    has no LM head."""
    if is_true(training_inputs.get("fused_lm_head", True)) or method.full_logits_on_request:
        return
    raise RecipeError(f"`fused_lm_head: false` with `method: {method.name}`: its trainer has no full-logits path "
                      "(it always scores through TRL's fused LM head, or has no LM head); drop `fused_lm_head`.")


def check_hub_push(training_inputs: dict[str, Any]) -> None:
    """`push_to_hub: true` (the handbook's recipes carry it) makes Trainer create the repository as it starts: offline
    or without a token, a traceback once the model and data are loaded."""
    if not is_true(training_inputs.get("push_to_hub")):
        return
    from huggingface_hub import constants, get_token

    if constants.HF_HUB_OFFLINE:
        raise RecipeError("`push_to_hub: true` but the hub is offline here (HF_HUB_OFFLINE): set `push_to_hub: false` "
                          "and upload the run later (`hf upload REPO OUTPUT_DIR`).")
    if not (training_inputs.get("hub_token") or get_token()):
        raise RecipeError("`push_to_hub: true` needs a hub token and there is none (HF_TOKEN, `hf auth login`): log "
                          "in, or set `push_to_hub: false`.")


def check_both_sharding_engines(training_inputs: dict[str, Any]) -> None:
    """`fsdp` and `deepspeed` together (an axolotl config may carry both) end in Trainer's ValueError."""
    fsdp, deepspeed = training_inputs.get("fsdp"), training_inputs.get("deepspeed")
    if fsdp not in (None, "", [], False) and deepspeed not in (None, "", {}):
        raise RecipeError(f"`fsdp: {fsdp}` and `deepspeed: {deepspeed}` ask for two sharding engines; keep one "
                          "(drop `fsdp` to train under DeepSpeed, or `deepspeed` to train under FSDP).")


def check_named_strategy(name: str | None, launched: Strategy, world_size: int, from_command_line: bool) -> None:
    """A `strategy` (how `finetune train` launches itself) against what a launcher runs. Under a launch typed by hand
    its config decides: a recipe file's other strategy is named in a warning (the recipe still runs as launched),
    one given on this very command line (`--strategy`, as a self-launch passes it) stops the run."""
    from finetune.launch.self_launch import under_a_launcher

    if name in (None, "auto"):
        return
    row = shipped(name)  # an unknown name is refused wherever the recipe runs
    if not under_a_launcher():  # one process without a launcher: nothing to pick
        return
    asked = row.strategy.for_world_size(world_size)
    running = launched.for_world_size(world_size)
    if asked.runs_as(running):
        return
    message = (f"`strategy: {name}` asks for {asked.label}, but this launch runs {running.label} "
               f"({running.source or 'the launcher'})")
    if from_command_line:
        raise RecipeError(f"{message}: launch with `finetune train RECIPE.yaml --strategy {name}` (it picks the "
                          "config), or leave `--strategy` out to run what the launcher says.")
    if launched_rank() == 0:
        by_axes = launched.axis is not None
        says = "as the recipe's parallelism axes say" if by_axes and launched.source == "the recipe" \
            else "as its config says"
        print(f"warning: {message}, {says}; `finetune train RECIPE.yaml` without a launcher runs "
              f"{name}.")


def check_per_node_sizes(deepspeed: dict | None, environ=None) -> None:
    """Sizes written for one cluster shape must fit the launch's: Accelerate's parallelism sizes (FSDP hybrid shard's
    replicate × shard) multiply to the processes launched, and ZeRO++'s hpZ group is the processes of one node (its
    secondary weight copy is meant to stay inside the node). `scripts/launch_multinode.sh` passes the sizes from the
    nodes and GPUs per node; `"auto"` hpZ is filled from the node's processes when DeepSpeed starts."""
    environ = os.environ if environ is None else environ
    world_size, per_node = int(environ.get("WORLD_SIZE", "1")), int(environ.get("LOCAL_WORLD_SIZE", "1"))
    sizes = launched_parallelism(environ)
    # all 1 is plain data parallelism over every process (Accelerate sets dp_replicate to the process count); an axis
    # beside DeepSpeed (Ulysses) sizes its own groups
    beside_an_engine = sizes is not None and bool(sizes.beside_the_engine())
    if sizes is not None and sizes.total not in (1, world_size) and not beside_an_engine:
        nodes = world_size // per_node if per_node and world_size % per_node == 0 else "?"
        raise RecipeError(
            f"the Accelerate config's parallelism sizes multiply to {sizes.total} ({describe_as_accelerate(sizes)}) "
            f"but this launch runs {world_size} processes ({nodes} node(s) × {per_node}): give sizes for this "
            "cluster (`--parallelism_config_dp_replicate_size NODES --parallelism_config_dp_shard_size "
            "GPUS_PER_NODE`), as scripts/launch_multinode.sh does from --nnodes and --gpus-per-node.")
    # read as the estimator reads it (Strategy.from_deepspeed): a number of ranks above 1, "auto", or None
    hpz = Strategy.from_deepspeed(deepspeed).hpz_partition_size if deepspeed else None
    if isinstance(hpz, int) and hpz != per_node:  # lint names a value that is neither
        raise RecipeError(
            f"`zero_hpz_partition_size: {hpz}` (ZeRO++'s secondary weight copy, over that many GPUs) but this node "
            f"runs {per_node} process(es): hpZ is meant to be the GPUs of one node, so that the backward all-gather "
            f"stays inside it; set it to {per_node}, or \"auto\" (the shipped zero3_zeropp.json), which `finetune "
            "train` fills from the launch.")


def check_one_process_per_gpu(training_inputs: dict[str, Any]) -> None:
    """One process that sees several GPUs would train on all of them through `nn.DataParallel`: with no launcher
    (no WORLD_SIZE or LOCAL_RANK), Accelerate's state is not distributed and `TrainingArguments._setup_devices` sets
    `n_gpu = torch.cuda.device_count()` ("nn.DataParallel handles n_gpu > 1", transformers/training_args.py), then
    Trainer wraps the model and multiplies the batch by n_gpu (`train_batch_size`). The batch plan counted one
    process with one GPU, so every step would take n_gpu times the planned global batch, through the slowest
    data-parallel path there is."""
    if "WORLD_SIZE" in os.environ or "LOCAL_RANK" in os.environ:
        return
    if is_true(training_inputs.get("use_cpu")) or not torch.cuda.is_available():
        return
    gpus = torch.cuda.device_count()
    if gpus > 1:
        raise RecipeError(
            f"{gpus} GPUs are visible to one process (no launcher set WORLD_SIZE): Trainer would wrap the model in "
            f"nn.DataParallel and every step would take {gpus}× the planned batch. Launch one process per GPU: "
            f"`accelerate launch --config_file accelerate_configs/ddp.yaml --num_processes {gpus} -m finetune train "
            "RECIPE.yaml [--key value ...]`, or train on one GPU: `CUDA_VISIBLE_DEVICES=0 finetune train RECIPE.yaml`.")


def check_precision_on_gpu(training_inputs: dict[str, Any]) -> None:
    """bf16 asked for on a GPU without it (compute capability below 8.0: T4, V100) stops with the fix, fp16.

    Stopping, rather than switching to fp16 with a warning: fp16 is not bf16 with fewer bits. Its range ends at
    65504, so it needs loss scaling and can overflow where the bf16 run would not; the recipe's bf16 also reaches
    QLoRA's storage check (`check_qlora`), `pure_bf16` and what `finetune.train.effective` and checkpoints record, and a
    silent switch would leave those disagreeing with what runs. Transformers would not stop it either: it asks
    `torch.cuda.is_bf16_supported()` counting emulation (`_validate_args` in transformers/training_args.py), which a
    T4 passes, and trains bf16 emulated, or raises a bare ValueError where even emulation fails. The GPU is
    `finetune.launch.devices.visible_gpu`, the one Trainer trains on."""
    if is_true(training_inputs.get("use_cpu")):
        return
    asked = [key for key in ("bf16", "bf16_full_eval", "pure_bf16") if is_true(training_inputs.get(key))]
    from_launcher = not asked and training_precision(training_inputs) == "bf16"
    if not asked and not from_launcher:
        return
    gpu = visible_gpu()
    if gpu is None or gpu.supports_bf16:
        return
    if from_launcher:
        raise RecipeError(f"the Accelerate config asks for bf16 mixed precision (`mixed_precision: bf16`) but "
                          f"{gpu.describe()} has no bf16 (Ampere, 8.0, or newer): launch with `accelerate launch "
                          "--mixed_precision fp16 ...` (a recipe precision must agree with the launcher's).")
    fixes = {"bf16": "`--bf16 false --fp16 true`", "bf16_full_eval": "`--bf16_full_eval false --fp16_full_eval true`",
             "pure_bf16": "drop `pure_bf16`"}
    keys, fix = ", ".join(f"`{key}: true`" for key in asked), "; ".join(fixes[key] for key in asked)
    raise RecipeError(f"{keys} but {gpu.describe()} has no bf16 (compute capability 8.0, Ampere, or newer): train in "
                      f"fp16 instead ({fix}), or let `bf16: auto` pick per GPU.")


def check_launcher_precision(training_inputs: dict[str, Any], sources: dict[str, str]) -> None:
    """The recipe's `bf16`/`fp16` and the mixed precision `accelerate launch` hands the ranks
    (ACCELERATE_MIXED_PRECISION, from the config's `mixed_precision` or `--mixed_precision`) must agree: Trainer
    trains in the recipe's and drops the launcher's without a word (`TrainingArguments.__post_init__`). A recipe
    precision `bf16: auto` chose for the GPU wins with a warning, as that is what auto asks for."""
    launcher = os.environ.get("ACCELERATE_MIXED_PRECISION", "no")
    recipe = next((key for key in ("fp16", "bf16") if is_true(training_inputs.get(key))), None)  # Trainer's order
    if recipe is None or launcher in ("no", recipe):
        return
    source = sources.get(recipe, "default")
    contradiction = (f"the Accelerate config's `mixed_precision: {launcher}` contradicts the recipe's `{recipe}: true` "
                     f"({source})")
    if "auto →" in source:
        if launched_rank() == 0:
            print(f"warning: {contradiction}; training in {recipe}, which `bf16: auto` chose for this GPU.")
        return
    raise RecipeError(f"{contradiction}: Trainer would train in {recipe} and ignore the launcher's {launcher}. Make "
                      f"them agree: launch with `--mixed_precision {recipe}`, or set `{recipe}: false` and "
                      f"`{launcher}: true` in the recipe.")


def warmup_warning(warmup_steps: float, learning_rate: float, total_steps: int) -> str | None:
    """What to say when the warmup (`warmup_steps`, or below 1 a fraction of the run, as Trainer reads it in
    `TrainingArguments.get_warmup_steps`) lasts the whole run: the learning rate then never reaches its value."""
    warmup = int(warmup_steps) if warmup_steps >= 1 else math.ceil(total_steps * warmup_steps)
    if total_steps <= 0 or warmup < total_steps:
        return None
    given = f"`warmup_steps: {warmup_steps:g}`{' of the run' if warmup_steps < 1 else ''}"
    highest = learning_rate * total_steps / warmup
    return (f"the warmup ({warmup} steps, {given}) is as long as the run or longer ({total_steps} steps): the learning "
            f"rate never reaches `learning_rate: {learning_rate:g}` (it climbs to ~{highest:.2g}); lower "
            "`warmup_steps` or train longer.")


def check_eval_split(args, has_eval: bool) -> None:
    """An `eval_strategy` other than `no` needs eval data, which is known once the data are loaded (a dataset's own
    validation split, `eval_file`, `eval_split_ratio`); Trainer would refuse it with a ValueError of its own."""
    strategy = str(getattr(args.eval_strategy, "value", args.eval_strategy))
    if has_eval or strategy == "no":
        return
    raise RecipeError(f"`eval_strategy: {strategy}` evaluates, but the data have no eval split: give `eval_file` or "
                      "`eval_split_ratio`, or set `eval_strategy: no`.")


def training_precision(training_inputs: dict[str, Any], launcher: bool = True) -> str:
    """The mixed precision Trainer will run (no, bf16, fp16), read from the training keys before `TrainingArguments`
    exists, as its `__post_init__` resolves `mixed_precision` afterwards: `fp16`, then `bf16`, else what `accelerate
    launch` set (`launcher`: False for a plan made for another machine)."""
    if is_true(training_inputs.get("fp16")):  # in TrainingArguments' order
        return "fp16"
    if is_true(training_inputs.get("bf16")):
        return "bf16"
    return os.environ.get("ACCELERATE_MIXED_PRECISION", "no") if launcher else "no"


def check_qlora(torch_dtype: str, training_inputs: dict[str, Any], strategy: Strategy) -> None:
    """QLoRA computes in `finetune.models.lora.qlora_compute_dtype`: bf16 named by `torch_dtype` on a GPU without it
    stops here. Under a strategy that shards parameters the packed 4-bit weights are stored in the compute dtype
    (finetune.models.lora.qlora_load); a mixed precision of the other half dtype would cast those bytes as
    numbers."""
    from finetune.models.lora import qlora_compute_dtype

    gpu = visible_gpu()
    if qlora_compute_dtype(torch_dtype) == torch.bfloat16 and gpu is not None and not gpu.supports_bf16:
        raise RecipeError(f"`use_qlora: true` with `torch_dtype: {torch_dtype}` computes in bf16, which "
                          f"{gpu.describe()} does not have: set `torch_dtype: float16` or `auto`.")
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
    """`pure_bf16` (finetune.models.loading.trainable_dtype) is asked for by name and means what it says where the
    model's
    own tensors are stepped: one process and DDP. DeepSpeed keeps fp32 masters of its own, and Accelerate's FSDP
    path upcasts trainable parameters, so there the key would silently do nothing."""
    if not is_true(training_inputs.get("pure_bf16")):
        return
    if strategy.kind not in PURE_BF16_KINDS:
        raise RecipeError(f"`pure_bf16: true` under {strategy.describe()}: it applies to one process and DDP only "
                          "(DeepSpeed and FSDP keep fp32 master weights of their own); drop it or launch with DDP.")
    if training_precision(training_inputs) == "fp16":
        raise RecipeError("`pure_bf16: true` with fp16 mixed precision: choose one (`fp16: false`, or drop "
                          "`pure_bf16`).")


def check_output_dir(output_dir: str | None) -> None:
    """`output_dir` must be a directory this process can create and write: a file there, or a read-only place,
    would surface as a FileExistsError or PermissionError traceback at the first save, after the set-up."""
    if not output_dir:
        return
    path = Path(output_dir)
    existing = next((parent for parent in (path, *path.parents) if parent.exists()), Path("."))
    if not existing.is_dir():
        raise RecipeError(f"`output_dir: {output_dir}`: {existing} is a file, not a directory; choose another "
                          "output_dir.")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise RecipeError(f"`output_dir: {output_dir}`: {existing} is not writable by this user; choose a writable "
                          "output_dir.")


def check_lora_adapters(model_args, lora) -> None:
    """The LoRA keys that name parts of the model (`lora_target_modules`, `modules_to_save`) are checked against an
    empty (meta-device) instance of it built from its config alone, so that a name matching nothing stops here,
    before any process group, not on every rank after loading the weights. A config that cannot be read here (custom
    code, no network) is left to the loading, which says why; `finetune.models.lora.apply_lora` checks again."""
    if not lora.use_lora or not (lora.modules_to_save or lora.lora_target_modules):
        return
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    from finetune.memory.shapes import resolve_config
    from finetune.models.lora import lora_config

    try:
        with init_empty_weights():
            model = AutoModelForCausalLM.from_config(resolve_config(model_args.model_name_or_path))
    except (OSError, ValueError):  # RecipeError included: the loading names the problem with its fix
        return
    lora_config(model, lora)
