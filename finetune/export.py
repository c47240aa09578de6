"""Export a run or checkpoint to a plain Hugging Face model directory in safetensors.

- A full model saved by Trainer (`model.safetensors`, ZeRO-3 weights gathered at save) is reloaded and saved.
- A DeepSpeed checkpoint that holds only ZeRO shards (`global_step*/`) is consolidated with DeepSpeed's own
  `get_fp32_state_dict_from_zero_checkpoint` into the model its `config.json` describes.
- An FSDP checkpoint (a sharded state dict, `pytorch_model_fsdp_0/`) is consolidated with Accelerate's
  `merge_fsdp_weights` into the model the run's `config.json` describes (the checkpoint's, or its output_dir's);
  under LoRA the shards hold the adapters only, loaded into the base its `adapter_config.json` names.
- A LoRA adapter (`adapter_config.json`) is merged into its base (`--merge-lora`) or saved as a standalone
  adapter. The base is `--base-model`, else the adapter's `base_model_name_or_path`; the `tiny` preset is
  rebuilt from `--seed` (the recipe's seed).
Weights are read from safetensors, or from ZeRO shards only after `check_checkpoint_files` found nothing but
tensors and known state in them.
"""

from __future__ import annotations

from pathlib import Path

import torch

from finetune import presets
from finetune.checkpoints import check_checkpoint_files
from finetune.errors import RecipeError
from finetune.models import DTYPES

EXPORT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
                 "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _base_model(name: str | None, seed: int):
    from transformers import AutoModelForCausalLM

    if not name:
        raise RecipeError("the adapter does not name its base model: pass --base-model (a directory, hub id or tiny).")
    if name == presets.TINY_MODEL:
        model = presets.build_model(presets.build_tokenizer(), seed=seed)
        model.config.name_or_path = model.name_or_path = presets.TINY_MODEL  # what the adapter names as its base
        return model
    return AutoModelForCausalLM.from_pretrained(name, dtype=DTYPES["auto"])


def _zero_shards(directory: Path) -> bool:
    return any(path.is_dir() and path.name.startswith("global_step") for path in directory.iterdir())


def load_for_export(source: Path, merge_lora: bool, base_model: str | None, seed: int):
    """`(model, is_adapter)` for `source`."""
    from transformers import AutoModelForCausalLM

    if not source.is_dir():
        raise RecipeError(f"{source} is not a directory: give a run's output_dir or one of its checkpoint-N folders.")
    if (source / FSDP_MODEL_SHARDS).is_dir():
        return _merged_fsdp_model(source, merge_lora, base_model, seed)
    if (source / "adapter_config.json").is_file():
        import json

        from peft import PeftModel

        config = json.loads((source / "adapter_config.json").read_text())
        base = _base_model(base_model or config.get("base_model_name_or_path"), seed)
        model = PeftModel.from_pretrained(base, source)
        return (model.merge_and_unload(), False) if merge_lora else (model, True)
    if merge_lora:
        raise RecipeError(f"--merge-lora: {source} holds no LoRA adapter (no adapter_config.json).")
    if (source / "model.safetensors").is_file() or (source / "model.safetensors.index.json").is_file():
        return AutoModelForCausalLM.from_pretrained(source), False
    if (source / "config.json").is_file() and _zero_shards(source):
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        check_checkpoint_files(source)  # DeepSpeed unpickles its shards in full
        state = get_fp32_state_dict_from_zero_checkpoint(str(source))
        return _model_from_state(state, source, f"the ZeRO shards in {source}"), False
    if (source / "pytorch_model.bin").is_file():
        raise RecipeError(f"{source} has only pickled weights (pytorch_model.bin); they are not loaded, for safety. "
                          "Convert them where you trust the file, e.g. with safetensors' convert script.")
    raise RecipeError(f"{source} holds no model: expected model.safetensors, ZeRO shards (global_step*/) with "
                      f"config.json, FSDP shards ({FSDP_MODEL_SHARDS}/), or a LoRA adapter (adapter_config.json).")


FSDP_MODEL_SHARDS = "pytorch_model_fsdp_0"  # Accelerate's `save_fsdp_model` folder in a checkpoint


def _merged_fsdp_model(source: Path, merge_lora: bool, base_model: str | None, seed: int):
    """`(model, is_adapter)` from an FSDP checkpoint's shards: the whole model, or a LoRA run's adapters."""
    import tempfile

    from accelerate.utils import merge_fsdp_weights
    from safetensors.torch import load_file

    with tempfile.TemporaryDirectory() as merged:
        merge_fsdp_weights(str(source / FSDP_MODEL_SHARDS), merged, safe_serialization=True)
        state = load_file(str(Path(merged) / "model.safetensors"))
    adapter_dir = next((folder for folder in (source, source.parent) if (folder / "adapter_config.json").is_file()),
                       None)
    if adapter_dir is not None and all(name.startswith("base_model.model.") for name in state):
        from peft import PeftConfig, get_peft_model, set_peft_model_state_dict

        config = PeftConfig.from_pretrained(adapter_dir)
        model = get_peft_model(_base_model(base_model or config.base_model_name_or_path, seed), config)
        result = set_peft_model_state_dict(model, state)
        if result.unexpected_keys:
            raise RecipeError(f"the FSDP shards in {source} do not match {adapter_dir / 'adapter_config.json'} "
                              f"(unexpected {sorted(result.unexpected_keys)[:3]}).")
        return (model.merge_and_unload(), False) if merge_lora else (model, True)
    if merge_lora:
        raise RecipeError(f"--merge-lora: {source} holds no LoRA adapter (no adapter_config.json).")
    config_dir = next((folder for folder in (source, source.parent) if (folder / "config.json").is_file()), None)
    if config_dir is None:
        raise RecipeError(f"{source} holds FSDP shards but no config.json, nor does {source.parent}: export the run's "
                          "output_dir after training finished, or copy its config.json next to the shards.")
    return _model_from_state(state, config_dir, f"the FSDP shards in {source}"), False


def _model_from_state(state: dict, config_dir: Path, what: str):
    """The model `config_dir/config.json` describes, holding the consolidated `state` (a tied head may be absent)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(config_dir))
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = {name for name in missing if name.endswith("lm_head.weight") and model.config.tie_word_embeddings}
    if set(missing) - tied or unexpected:
        raise RecipeError(f"{what} do not match {config_dir / 'config.json'} "
                          f"(missing {sorted(set(missing) - tied)[:3]}, unexpected {sorted(unexpected)[:3]}).")
    model.tie_weights()
    return model


def export(source: str | Path, out_dir: str | Path, merge_lora: bool = False, dtype: str | None = None,
           base_model: str | None = None, seed: int = 0) -> Path:
    source, out_dir = Path(source), Path(out_dir)
    if dtype is not None and dtype not in EXPORT_DTYPES:
        raise RecipeError(f"--dtype {dtype} is not one of {', '.join(EXPORT_DTYPES)}.")
    model, is_adapter = load_for_export(source, merge_lora, base_model, seed)
    if dtype is not None:
        model = model.to(EXPORT_DTYPES[dtype])
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
        found = _beside(source, name)
        if found is not None:
            (out_dir / name).write_bytes(found.read_bytes())
    return out_dir


def _beside(source: Path, name: str) -> Path | None:
    """`source/name`, else `source.parent/name`: a checkpoint's own file, else its run's."""
    return next((folder / name for folder in (source, source.parent) if (folder / name).is_file()), None)


def load_with_tokenizer(source: str | Path, merge_lora: bool = False, base_model: str | None = None, seed: int = 0):
    """`(model, tokenizer)` for `source` in memory (what `finetune chat` talks to): the model as `load_for_export`
    loads it (an adapter not merged stays a peft model), and the tokenizer saved beside it, else its base's
    (`base_model`, or the one the adapter names), through `models.load_tokenizer` as training loaded it: a tokenizer
    without a chat template gets the default one training gave it."""
    import json

    from finetune.args import ModelArguments
    from finetune.models import load_tokenizer

    source = Path(source)
    model, _ = load_for_export(source, merge_lora, base_model, seed)
    saved, adapter = _beside(source, "tokenizer_config.json"), _beside(source, "adapter_config.json")
    name = str(saved.parent) if saved is not None else base_model or (
        adapter is not None and json.loads(adapter.read_text()).get("base_model_name_or_path"))
    if not name:
        raise RecipeError(f"{source} has no tokenizer (no tokenizer_config.json there, nor in {source.parent}): copy "
                          "the tokenizer files of the model it was trained from next to the weights.")
    return model, load_tokenizer(ModelArguments(model_name_or_path=name))
