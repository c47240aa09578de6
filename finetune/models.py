"""Tokenizer and model loading: the `tiny` preset is built in code, anything else goes through `from_pretrained`."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from finetune import presets

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "auto": "auto"}


def load_tokenizer(model_args):
    name = model_args.tokenizer_name_or_path or model_args.model_name_or_path
    if name == presets.TINY_MODEL:
        return presets.build_tokenizer()
    tokenizer = AutoTokenizer.from_pretrained(name, trust_remote_code=model_args.trust_remote_code)
    if tokenizer.pad_token is None:
        # Padding positions carry label -100 and attention 0, so reusing EOS for padding is safe.
        tokenizer.pad_token = tokenizer.eos_token
    if tokenizer.chat_template is None:
        tokenizer.chat_template = presets.CHAT_TEMPLATE  # documented default for base models
    return tokenizer


def load_model(model_args, tokenizer, seed: int = 0):
    if model_args.model_name_or_path == presets.TINY_MODEL:
        dtype = None if model_args.torch_dtype == "auto" else DTYPES[model_args.torch_dtype]
        return presets.build_model(tokenizer, seed=seed, dtype=dtype)
    return AutoModelForCausalLM.from_pretrained(
        model_args.model_name_or_path,
        dtype=DTYPES[model_args.torch_dtype],
        attn_implementation=model_args.attn_implementation,
        trust_remote_code=model_args.trust_remote_code,
    )


def apply_lora(model, lora_args):
    """Wraps `model` with LoRA adapters on every linear layer (or the named ones); only adapters train."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=lora_args.lora_r,
        lora_alpha=lora_args.lora_alpha,
        lora_dropout=lora_args.lora_dropout,
        target_modules=lora_args.lora_target_modules or "all-linear",
        task_type="CAUSAL_LM",
    )
    return get_peft_model(model, config)
