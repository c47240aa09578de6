"""Tokenizer and model loading: the `tiny` preset is built in code, anything else goes through `from_pretrained`."""

from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from accelerate.utils import gather_object
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

from finetune import presets
from finetune.errors import RecipeError, did_you_mean
from finetune.launch.strategies import Strategy
from finetune.memory.shapes import attention_projections

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "auto": "auto"}


def check_local_path(name: str, key: str) -> None:
    """A name that can only be a path (it starts with `.`, `/` or `~`, or has more separators than a hub id's one)
    and names no directory stops here: from_pretrained would take it for a malformed hub repo id."""
    looks_local = name.startswith((".", "/", "~", os.sep)) or name.count("/") > 1 or (os.sep != "/" and os.sep in name)
    if looks_local and not Path(name).expanduser().is_dir():
        found = "a file, not a directory" if Path(name).expanduser().exists() else "no such directory"
        raise RecipeError(f"`{key}: {name}`: {found}; give the folder holding config.json (as save_pretrained "
                          "writes it), or a hub id such as `Qwen/Qwen2.5-0.5B`.")


def load_tokenizer(model_args):
    name = model_args.tokenizer_name_or_path or model_args.model_name_or_path
    if name == presets.TINY_MODEL:
        return presets.build_tokenizer()
    check_local_path(model_args.model_name_or_path, "model_name_or_path")
    if model_args.tokenizer_name_or_path:
        check_local_path(model_args.tokenizer_name_or_path, "tokenizer_name_or_path")
    with loading_refusals(model_args):
        tokenizer = AutoTokenizer.from_pretrained(name, trust_remote_code=model_args.trust_remote_code)
    if tokenizer.pad_token is None:
        # Padding positions carry label -100 and attention 0, so reusing EOS for padding is safe.
        tokenizer.pad_token = tokenizer.eos_token
    if tokenizer.chat_template is None:
        tokenizer.chat_template = presets.CHAT_TEMPLATE  # documented default for base models
    return tokenizer


def load_model(model_args, tokenizer, seed: int = 0, qlora: bool = False, strategy: Strategy | None = None):
    if model_args.model_name_or_path == presets.TINY_MODEL and not qlora:
        dtype = None if model_args.torch_dtype == "auto" else DTYPES[model_args.torch_dtype]
        model = presets.build_model(tokenizer, seed=seed, dtype=dtype)
        model.config.name_or_path = model.name_or_path = presets.TINY_MODEL  # peft records it as the adapter's base
        return model
    check_local_path(model_args.model_name_or_path, "model_name_or_path")
    if qlora:
        return _load_4bit(model_args, tokenizer, seed, strategy or Strategy("single"))
    with loading_refusals(model_args):
        return AutoModelForCausalLM.from_pretrained(
            model_args.model_name_or_path,
            dtype=DTYPES[model_args.torch_dtype],
            attn_implementation=model_args.attn_implementation,
            trust_remote_code=model_args.trust_remote_code,
        )


@contextmanager
def loading_refusals(model_args):
    """Transformers' own refusals while loading, said in one line naming the recipe key and the fix: custom code
    without `trust_remote_code` (the refusal itself is right), an attention kernel that cannot load (an unknown name,
    flash-attn not installed, no CUDA), a model that cannot be found or fetched (an OSError)."""
    try:
        yield
    except (ImportError, ValueError) as error:
        first_line = str(error).splitlines()[0] if str(error) else type(error).__name__
        if "trust_remote_code" in str(error):
            raise RecipeError(f"`{model_args.model_name_or_path}` ships its own model code, which runs only with "
                              "`trust_remote_code: true`: read that code first, then set it (or use a model "
                              "Transformers supports natively).") from None
        if model_args.attn_implementation is not None and "attn" in str(error).lower().replace("attention", "attn"):
            raise RecipeError(f"`attn_implementation: {model_args.attn_implementation}` cannot be used here: "
                              f"{first_line} Use `sdpa` (any device), or install the kernel's package on a CUDA GPU "
                              "(flash_attention_2: `pip install flash-attn`).") from None
        raise
    except OSError as error:  # Transformers' "not a local folder and not a valid model identifier", offline, ...
        first_line = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise RecipeError(f"`model_name_or_path: {model_args.model_name_or_path}` cannot be loaded: {first_line} "
                          "Give a local folder written by save_pretrained, or a hub id this machine can reach "
                          "(or has in its hub cache).") from None


def trainable_dtype(strategy: Strategy, precision: str, pure_bf16: bool = False) -> torch.dtype | None:
    """The dtype trainable parameters are held in; None where the strategy keeps its own fp32 master copy.

    Under bf16/fp16 mixed precision Trainer autocasts the forward pass but steps the optimizer on the model's own
    tensors: a bf16 checkpoint loaded with `torch_dtype: auto` would train as pure bf16, where an update smaller than
    half a bf16 step (lr 2e-5 on weights of ~0.02) rounds away (measured: 23% of the weights moved in 5 steps, 100%
    from the same model in fp32). So trainable parameters are held in fp32 whatever the checkpoint's dtype, as
    Accelerate's FSDP path does (`fsdp2_prepare_model` upcasts them); frozen base weights keep the loaded dtype.
    DeepSpeed under half precision casts the module itself and keeps fp32 masters (`bf16_optimizer.py`,
    `stage_1_and_2.py`): nothing to do. `pure_bf16` asks by name for bf16 weights, gradients and Adam states."""
    if pure_bf16:
        return torch.bfloat16
    if strategy.kind == "deepspeed" and precision in ("bf16", "fp16"):
        return None
    return torch.float32


def hold_trainable_parameters(model, dtype: torch.dtype | None) -> int:
    """Casts the trainable parameters to `dtype` in place (tied weights stay tied: the Parameter is kept); returns
    how many parameters changed dtype."""
    if dtype is None:
        return 0
    changed = 0
    for parameter in model.parameters():
        if parameter.requires_grad and parameter.dtype != dtype:
            if hasattr(parameter, "ds_tensor"):  # partitioned by ZeRO-3 while loading: its shards are DeepSpeed's
                raise RecipeError(f"the model was loaded in {parameter.dtype} and partitioned by ZeRO-3, but trains "
                                  "without DeepSpeed's half precision, which would keep fp32 master weights: set "
                                  "`bf16: true` (or `fp16: true`), or `torch_dtype: float32`.")
            parameter.data = parameter.data.to(dtype)
            changed += parameter.numel()
    return changed


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


def _load_4bit(model_args, tokenizer, seed: int, strategy: Strategy):
    """The QLoRA base as `qlora_load` says, on this process's GPU or ready for the strategy to shard."""
    import os
    import tempfile

    from peft import prepare_model_for_kbit_training
    from transformers import BitsAndBytesConfig

    load = qlora_load(strategy, model_args.torch_dtype, int(os.environ.get("LOCAL_RANK", "0")))
    source = model_args.model_name_or_path
    with tempfile.TemporaryDirectory() as directory:
        if source == presets.TINY_MODEL:  # quantization happens in from_pretrained: save the preset first
            presets.build_model(tokenizer, seed=seed).save_pretrained(directory)
            source = directory
        with loading_refusals(model_args):
            model = AutoModelForCausalLM.from_pretrained(
                source,
                quantization_config=BitsAndBytesConfig(**load.quantization),
                dtype=load.dtype,
                device_map=load.device_map,
                attn_implementation=model_args.attn_implementation,
                trust_remote_code=model_args.trust_remote_code,
            )
    if load.prepare_for_kbit:
        return prepare_model_for_kbit_training(model)
    model.enable_input_require_grads()  # what the preparation also does, for gradient checkpointing on a frozen base
    return model


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
    return LoraConfig(
        r=lora_args.lora_r,
        lora_alpha=lora_args.lora_alpha,
        lora_dropout=lora_args.lora_dropout,
        target_modules=lora_target_modules(model, lora_args.lora_target_modules),
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
