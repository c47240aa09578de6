"""LoRA, DoRA and QLoRA adapters through peft: what to adapt (`lora_target_modules` presets, names checked against
the model), the 4-bit base's compute dtype and placement, and the check that the frozen weights never moved."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from accelerate.utils import gather_object
from transformers import TrainerCallback

from finetune.errors import RecipeError, did_you_mean
from finetune.launch.strategies import Strategy
from finetune.memory.shapes import attention_projections
from finetune.models.loading import DTYPES


@dataclass(frozen=True)
class QLoRALoad:
    """How the QLoRA base is loaded under a strategy (`qlora_load`)."""

    quantization: dict           # BitsAndBytesConfig arguments
    dtype: torch.dtype           # of everything not quantized
    device_map: dict | None      # None: the strategy places the shards
    prepare_for_kbit: bool       # peft's prepare_model_for_kbit_training (upcasts the unquantized weights to fp32)


def qlora_compute_dtype(torch_dtype: str) -> torch.dtype:
    """The dtype QLoRA dequantizes and computes in: the half dtype `torch_dtype` names, else (`auto`, `float32`) the
    visible GPU's (`finetune.launch.devices`): bf16, or fp16 on a GPU without native bf16 such as the T4, as the mixed
    precision there must be fp16 too (`preflight.check_precision_on_gpu`). No GPU visible (planning, tests): bf16."""
    from finetune.launch.devices import visible_gpu

    if torch_dtype in ("float16", "bfloat16"):
        return DTYPES[torch_dtype]
    gpu = visible_gpu()
    return torch.float16 if gpu is not None and not gpu.supports_bf16 else torch.bfloat16


def qlora_load(strategy: Strategy, torch_dtype: str, local_rank: int = 0) -> QLoRALoad:
    """NF4 weights with double quantization (Dettmers et al. 2023), computing in `qlora_compute_dtype`: bf16, or fp16
    with `torch_dtype: float16` or on a GPU without bf16 (a T4).

    Where parameters are sharded (FSDP, ZeRO-3) the packed 4-bit weights are stored in the compute dtype
    (`bnb_4bit_quant_storage`), because FSDP and ZeRO-3 shard floating-point tensors only; nothing is placed on a GPU
    up front (the strategy shards, then places), and peft's k-bit preparation is skipped: its fp32 upcast would mix
    dtypes inside an FSDP unit, as in the Hugging Face FSDP-QLoRA and DeepSpeed-QLoRA guides. Elsewhere each process
    loads the whole quantized model onto its own GPU."""
    compute = qlora_compute_dtype(torch_dtype)
    quantization = {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4", "bnb_4bit_use_double_quant": True,
                    "bnb_4bit_compute_dtype": compute}
    if strategy.shards_parameters:
        return QLoRALoad({**quantization, "bnb_4bit_quant_storage": compute}, compute, None, False)
    return QLoRALoad(quantization, compute, {"": local_rank}, True)


def apply_lora(model, lora_args):
    """Wraps `model` with LoRA adapters as `lora_config` says; only adapters (and `modules_to_save`) train."""
    from peft import get_peft_model

    config = lora_config(model, lora_args)
    try:
        return get_peft_model(model, config)
    except ValueError as error:  # peft's own refusals (a target it cannot adapt...), said in one line
        raise RecipeError(f"LoRA cannot be applied as the recipe asks: {str(error).splitlines()[0]} Check "
                          "`lora_target_modules` and `modules_to_save` against the model's module names.") from None


def lora_config(model, lora_args):
    """peft's `LoraConfig` for `model` from the recipe's LoRA keys: targets resolved (`lora_target_modules`), DoRA,
    rsLoRA and `modules_to_save` checked against the model and passed through under peft's own names."""
    from peft import LoraConfig

    modules_to_save = check_module_names(model, lora_args.modules_to_save, "modules_to_save")
    targets = lora_target_modules(model, lora_args.lora_target_modules)
    if hasattr(model.config, "vision_config"):  # a vision-language model (finetune.models.vision.loading)
        from finetune.models.vision.loading import language_model_linear_layers, trained_projector_modules

        if not lora_args.lora_target_modules:  # the language model's linear layers, not the vision tower's
            targets = language_model_linear_layers(model)
        projector = [name for name in trained_projector_modules(model) if name not in (modules_to_save or [])]
        modules_to_save = [*(modules_to_save or []), *projector] or None  # `freeze_projector: false`: it trains
    return LoraConfig(
        r=lora_args.lora_r,
        lora_alpha=lora_args.lora_alpha,
        lora_dropout=lora_args.lora_dropout,
        target_modules=targets,
        use_dora=lora_args.use_dora,
        use_rslora=lora_args.use_rslora,
        modules_to_save=modules_to_save,
        # A saved copy of a tied module (the tiny preset's lm_head is its embedding) keeps the tie, so the merged
        # model has one trained matrix where the base had one (peft's `ensure_weight_tying`).
        ensure_weight_tying=bool(modules_to_save) and bool(tied_module_names(model) & set(modules_to_save)),
        task_type="CAUSAL_LM",
    )


def lora_target_modules(model, targets: list[str] | None) -> str | list[str]:
    """peft's `target_modules` for the recipe's `lora_target_modules`: `all-linear` when unset or named (peft's own
    wildcard: every linear layer but the output head), the attention projections for `attention`, else the names."""
    if not targets or targets == ["all-linear"]:
        return "all-linear"
    if targets == ["attention"]:
        found = attention_projections(model)
        if not found:
            raise RecipeError(f"`lora_target_modules: attention` found no attention projection in "
                              f"{type(model).__name__} (no linear layer inside a module whose class is an "
                              "*Attention): name the layers to adapt, e.g. `lora_target_modules: [q_proj, v_proj]`.")
        return found
    return check_module_names(model, targets, "lora_target_modules")


def check_module_names(model, names: list[str] | None, key: str) -> list[str] | None:
    """Each name under `key` must match a module as peft matches it (the full name, or its last parts)."""
    if not names:
        return None
    module_names = [name for name, _ in model.named_modules() if name]
    for wanted in names:
        if not any(name == wanted or name.endswith(f".{wanted}") for name in module_names):
            short = sorted({name.rsplit(".", 1)[-1] for name in module_names if not name[-1].isdigit()})
            raise RecipeError(f"`{key}: {wanted}` matches no module of {type(model).__name__}"
                              f"{did_you_mean(wanted, short)}; its modules are named: {', '.join(short)}.")
    return list(names)


def tied_module_names(model) -> set[str]:
    """Last names of the modules whose weight is shared with another module's (a tied embedding and head)."""
    owners: dict[int, list[str]] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        weight = getattr(module, "weight", None)
        if name and isinstance(weight, torch.nn.Parameter):
            owners.setdefault(id(weight), []).append(name.rsplit(".", 1)[-1])
    return {name for names in owners.values() if len(names) > 1 for name in names}


def frozen_weights_digest(model) -> dict[str, float]:
    """A float64 sum per frozen parameter of what this rank holds (its ZeRO-3 partition or the whole tensor)."""
    digest = {}
    for name, parameter in model.named_parameters():
        if not parameter.requires_grad:
            local = getattr(parameter, "ds_tensor", parameter)
            digest[name] = float(local.detach().double().sum()) if local.numel() else 0.0
    return digest


class FrozenWeightsCallback(TrainerCallback):
    """Checks, on every rank, that training changed no frozen (base) weight: LoRA trains adapters only."""

    def __init__(self):
        self.before: dict[str, float] | None = None
        self.unchanged: bool | None = None

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.before = frozen_weights_digest(model)

    def on_train_end(self, args, state, control, model=None, **kwargs):
        mine = frozen_weights_digest(model) == self.before and bool(self.before)
        ranks = gather_object([mine]) if args.world_size > 1 else [mine]
        self.unchanged = all(ranks)
