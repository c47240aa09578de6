"""A vision-language model to train: loaded (or `tiny-vl` built in code), its parts named (the vision tower, the
projector that maps its features into the language model, the language model), and frozen as the recipe asks
(`freeze_vision_tower`, on by default; `freeze_projector`)."""

from __future__ import annotations

from contextlib import contextmanager

import torch

from finetune.errors import RecipeError
from finetune.memory.shapes import (  # where the planner names a vision-language model's parts
    LANGUAGE_MODEL_NAMES,
    PROJECTOR_NAMES,
    TOWER_NAMES,
    part_of,
    vision_parameter_names,
)


def load_vision_model(model_args, tokenizer, seed: int = 0, qlora: bool = False, parallelism=None,
                      shapes_only: bool = False):
    """The vision-language model, its parts frozen as `freeze_vision_tower` and `freeze_projector` say."""
    from finetune.models.loading import DTYPES, check_local_path, loading_refusals, stored_dtype
    from finetune.models.vision import processor_of
    from finetune.models.vision.presets import TINY_VL_MODEL, build_model

    name = model_args.model_name_or_path
    if qlora:
        raise RecipeError("`use_qlora` with a vision-language model is not supported yet: train it with `use_lora` "
                          "(the base in bf16) or in full.")
    if parallelism is not None and parallelism.loads_sharded:
        raise RecipeError("tensor parallelism with a vision-language model is not supported yet: use DDP, a ZeRO "
                          "stage or FSDP.")
    dtype = DTYPES[model_args.torch_dtype]
    if name == TINY_VL_MODEL:
        from accelerate import init_empty_weights

        with init_empty_weights() if shapes_only else whole_under_zero3():
            model = build_model(processor_of(tokenizer), seed=seed, dtype=None if dtype == "auto" else dtype)
        model.tie_weights()  # built on the meta device, the tie was a second meta Parameter
        if model_args.attn_implementation is not None:
            with loading_refusals(model_args):
                model.set_attn_implementation(model_args.attn_implementation)
        model.config.name_or_path = model.name_or_path = TINY_VL_MODEL
    else:
        from transformers import AutoModelForImageTextToText

        check_local_path(name, "model_name_or_path")
        with loading_refusals(model_args):
            if shapes_only:
                from accelerate import init_empty_weights
                from transformers import AutoConfig

                config = AutoConfig.from_pretrained(name, trust_remote_code=model_args.trust_remote_code)
                with init_empty_weights():
                    model = AutoModelForImageTextToText.from_config(
                        config, dtype=stored_dtype(name) if dtype == "auto" else dtype,
                        trust_remote_code=model_args.trust_remote_code)
            else:
                model = AutoModelForImageTextToText.from_pretrained(
                    name, dtype=dtype, attn_implementation=model_args.attn_implementation,
                    trust_remote_code=model_args.trust_remote_code)
        model.checkpoint_dtype = stored_dtype(name) or model.dtype
    freeze_vision_parts(model, model_args.freeze_vision_tower, model_args.freeze_projector)
    projector_reads_its_own_dtype(model)
    return model


def load_base_vision_model(name: str, seed: int = 0):
    """The vision-language model `name` as a recipe naming only it loads it (its dtype as saved, the tower frozen):
    the base a LoRA adapter was trained on."""
    from types import SimpleNamespace

    from finetune.models.vision.processors import vision_processor

    model_args = SimpleNamespace(model_name_or_path=name, tokenizer_name_or_path=None, torch_dtype="auto",
                                 attn_implementation=None, trust_remote_code=False, chat_template=None,
                                 min_pixels=None, max_pixels=None, freeze_vision_tower=True, freeze_projector=False)
    return load_vision_model(model_args, vision_processor(model_args), seed)


@contextmanager
def whole_under_zero3():
    """Builds the tiny model whole on every rank under ZeRO-3, as the tiny text model is built: Qwen2-VL's
    constructor builds its vision tower through `_from_config`, which under a registered ZeRO-3 config partitions
    that part alone inside `zero.Init`, and the outer model's weight initialisation then indexes the empty partitions.
    Built whole (a few MB), the model is partitioned by DeepSpeed's engine when it wraps it."""
    from transformers.integrations import deepspeed

    registered = deepspeed._hf_deepspeed_config_weak_ref
    deepspeed._hf_deepspeed_config_weak_ref = None
    try:
        yield
    finally:
        deepspeed._hf_deepspeed_config_weak_ref = registered


def freeze_vision_parts(model, tower: bool = True, projector: bool = False) -> dict[str, list[str]]:
    """Freezes the vision tower (`tower`) and the projector (`projector`); returns the parts' parameter names."""
    parts = vision_parameter_names(model)
    frozen = set(parts["tower"] if tower else []) | set(parts["projector"] if projector else [])
    for name, parameter in model.named_parameters():
        if name in frozen:
            parameter.requires_grad_(False)
    return parts


def language_model_linear_layers(model) -> str:
    """peft's `target_modules` for LoRA on the language model's linear layers only (a regular expression over module
    names): the default under LoRA, as in TRL's and LLaMA-Factory's vision-language recipes; the head is left out,
    as peft's `all-linear` leaves it."""
    import re

    names = set()
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and part_of(name, LANGUAGE_MODEL_NAMES) \
                and not part_of(name, TOWER_NAMES + PROJECTOR_NAMES):
            names.add(name.rsplit(".", 1)[-1])
    if not names:
        raise RecipeError(f"no linear layer found in the language model of {type(model).__name__} (a module named "
                          f"{', '.join(LANGUAGE_MODEL_NAMES)}): name the layers with `lora_target_modules`.")
    return rf"^(?:.*\.)?(?:{'|'.join(LANGUAGE_MODEL_NAMES)})\..*\.(?:{'|'.join(sorted(map(re.escape, names)))})$"


def trained_projector_modules(model) -> list[str]:
    """The projector modules that train in full beside LoRA's adapters (peft's `modules_to_save`): those whose weights
    are not frozen (`freeze_projector: false`)."""
    found = []
    for name, module in model.named_modules():
        last = name.rsplit(".", 1)[-1]
        if last in PROJECTOR_NAMES and any(p.requires_grad for p in module.parameters()):
            found.append(last)
    return sorted(set(found))


def projector_reads_its_own_dtype(model) -> int:
    """Makes the projector cast the tower's features to its own weights' dtype as it reads them; returns how many
    projector modules do. A frozen tower keeps its loaded dtype (a bf16 checkpoint's: bf16) while the trained
    projector is held in fp32 (finetune.models.loading.hold_trainable_parameters): without autocast (an fp32 run,
    or generation outside the training step's autocast) the two meet in a dtype mismatch at its first matmul. A
    cast at the projector's input costs nothing where the dtypes agree and keeps the frozen tower in its own
    dtype (half the bytes of an fp32 copy). A LoRA run's trained copy of the projector (peft's `modules_to_save`)
    is a copy of the module, hook included."""
    def cast(module, args, kwargs):
        dtype = next(module.parameters()).dtype

        def to_own(value):
            floating = torch.is_tensor(value) and value.is_floating_point() and value.dtype != dtype
            return value.to(dtype) if floating else value

        return tuple(to_own(value) for value in args), {key: to_own(value) for key, value in kwargs.items()}

    hooked = 0
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] in PROJECTOR_NAMES and next(module.parameters(), None) is not None:
            module.register_forward_pre_hook(cast, with_kwargs=True)
            hooked += 1
    return hooked

