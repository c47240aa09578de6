"""Export a run or checkpoint to a plain Hugging Face model directory in safetensors.

- A full model saved by Trainer (`model.safetensors`, ZeRO-3 weights gathered at save) is reloaded and saved.
- A DeepSpeed checkpoint that holds only ZeRO shards (`global_step*/`) is consolidated with DeepSpeed's own
  `get_fp32_state_dict_from_zero_checkpoint` into the model its `config.json` describes.
- An FSDP checkpoint (a sharded state dict, `pytorch_model_fsdp_0/`) is consolidated with Accelerate's
  `merge_fsdp_weights` into the model the run's `config.json` describes (the checkpoint's, or its output_dir's);
  under LoRA the shards hold the adapters only, loaded into the base its `adapter_config.json` names.
- A pipeline checkpoint (`pipeline_stage_NN.safetensors`) is consolidated into the model its `config.json`
  describes; under LoRA the stages hold the adapters, put onto the base its `adapter_config.json` names.
- A LoRA adapter (`adapter_config.json`) is merged into its base (`--merge-lora`) or saved as a standalone
  adapter. The base is `--base-model`, else the adapter's `base_model_name_or_path`; the `tiny` preset is
  rebuilt from `--seed`, else from the seed the run recorded (its effective_config.json).
Every file the loaders will open is checked first (`check_checkpoint_files`: whole safetensors and JSON, pickles
holding nothing but tensors and known state, symlinks followed); a run still training or a half-written checkpoint
is refused by name with the complete checkpoints to use instead. The destination is never the source, inside it or
around it, and a non-empty folder is written into only when it holds an earlier export, or with `--force`.
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path

import torch

from finetune import outputs, presets
from finetune.checkpoints import run_lock
from finetune.checkpoints.complete import (
    CHECKPOINT_NAME,
    check_checkpoint_files,
    checkpoints_newest_first,
    file_damage,
    is_complete,
    read_marker,
    why_incomplete,
)
from finetune.errors import RecipeError
from finetune.models.loading import DTYPES, check_local_path

# Written into every export: the folder may be exported into again (its earlier files replaced), and only then.
EXPORT_RECORD = "finetune_export.json"

EXPORT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
                 "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _base_model(name: str | None, seed: int | None, source: Path):
    from transformers import AutoModelForCausalLM

    if not name:
        raise RecipeError("the adapter does not name its base model: pass --base-model (a directory, hub id or tiny).")
    if name == presets.TINY_MODEL:
        seed = run_seed(source) if seed is None else seed
        model = presets.build_model(presets.build_tokenizer(), seed=seed)
        model.config.name_or_path = model.name_or_path = presets.TINY_MODEL  # what the adapter names as its base
        return model
    from finetune.models.vision import is_vision_model

    if is_vision_model(name):  # the vision-language model the adapter was trained on, as training loaded it
        from finetune.models.vision.loading import load_base_vision_model

        return load_base_vision_model(name, (run_seed(source) if seed is None else seed)
                                      if name == presets.TINY_VL_MODEL else 0)
    return AutoModelForCausalLM.from_pretrained(name, dtype=DTYPES["auto"])


def model_class(config_dir: Path):
    """The Auto class that rebuilds what `config_dir/config.json` describes: a scorer (a reward model,
    `...ForSequenceClassification`), a vision-language model (its config has a `vision_config`) or, by default, a
    causal LM."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, AutoModelForSequenceClassification

    config = config_dir / "config.json"
    values = json.loads(config.read_text()) if config.is_file() else {}
    architectures = values.get("architectures") or []
    if any(str(name).endswith("ForSequenceClassification") for name in architectures):
        return AutoModelForSequenceClassification
    if "vision_config" in values:
        return AutoModelForImageTextToText
    return AutoModelForCausalLM


def _zero_shards(directory: Path) -> bool:
    return any(path.is_dir() and path.name.startswith("global_step") for path in directory.iterdir())


def run_seed(source: Path) -> int:
    """The seed the run of `source` trained with, which built its `tiny` base: from the run's effective_config.json
    (the checkpoint's run's), else from the recipe its completion marker records."""
    seed = outputs.recorded_value([source, source.parent] if CHECKPOINT_NAME.match(source.name) else [source], "seed")
    if isinstance(seed, int):
        return seed
    recorded = read_marker(source).get("recipe", {}).get("seed")
    if isinstance(recorded, str) and recorded.lstrip("-").isdigit():
        return int(recorded)
    raise RecipeError(f"{source} records no seed (no effective_config.json beside it): pass --seed, the recipe's "
                      "seed, which built the `tiny` base the adapter was trained on.")


def check_finished(source: Path) -> None:
    """Refuses a run still training (its final weights are not written yet) and a checkpoint its run has not finished
    saving, naming the live run and the complete checkpoints to use instead."""
    is_checkpoint = CHECKPOINT_NAME.match(source.name) is not None
    run_dir = source.parent if is_checkpoint else source
    ours = (run_dir / outputs.RUN_LOCK).is_file()  # a folder `finetune train` wrote (a foreign one has no marker)
    if not ours or (is_checkpoint and is_complete(source)):
        return
    holder = run_lock.live_holder(run_dir)
    if holder is None and not is_checkpoint:
        return
    complete = [str(folder) for folder in checkpoints_newest_first(run_dir) if is_complete(folder)]
    instead = (f"use one of its complete checkpoints: {', '.join(complete)}" if complete else
               "it has no complete checkpoint yet: wait for its first save")
    training = "" if holder is None else f"; {run_dir} is still being trained by {run_lock.name_of(holder)}"
    if is_checkpoint:
        raise RecipeError(f"{source} is {why_incomplete(source)}{training}: {instead}.")
    raise RecipeError(f"{source} is still being trained by {run_lock.name_of(holder)}, so its final weights are not "
                      f"written yet: {instead}, or wait for the run to end.")


def load_for_export(source: Path, merge_lora: bool, base_model: str | None, seed: int | None):
    """`(model, is_adapter)` for `source`, once every file it will read has been checked."""

    if not source.is_dir():
        raise RecipeError(f"{source} is not a directory: give a run's output_dir or one of its checkpoint-N folders.")
    if base_model:  # before anything loads: a folder's name would be tried as a hub id
        check_local_path(base_model, "--base-model")
    check_finished(source)
    weights = ("model.safetensors", "model.safetensors.index.json", "adapter_config.json", FSDP_MODEL_SHARDS)
    if (source / "pytorch_model.bin").is_file() and not any((source / name).exists() for name in weights) and not (
            (source / "config.json").is_file() and _zero_shards(source)):
        raise RecipeError(f"{source} has only pickled weights (pytorch_model.bin); they are not loaded, for safety. "
                          "Convert them where you trust the file, e.g. with safetensors' convert script.")
    check_checkpoint_files(source, skip_checkpoints=True)  # before anything is unpickled: DeepSpeed's shards in full
    if (source / FSDP_MODEL_SHARDS).is_dir():
        return _merged_fsdp_model(source, merge_lora, base_model, seed)
    if (source / "adapter_config.json").is_file() and any(source.glob("pipeline_stage_[0-9][0-9].safetensors")):
        return _pipeline_adapters(source, merge_lora, base_model, seed)
    if (source / "adapter_config.json").is_file():
        from peft import PeftModel

        config = json.loads((source / "adapter_config.json").read_text())
        base = _base_model(base_model or config.get("base_model_name_or_path"), seed, source)
        model = PeftModel.from_pretrained(base, source)
        return (model.merge_and_unload(), False) if merge_lora else (model, True)
    if merge_lora:
        raise RecipeError(f"--merge-lora: {source} holds no LoRA adapter (no adapter_config.json).")
    if (source / "model.safetensors").is_file() or (source / "model.safetensors.index.json").is_file():
        return model_class(source).from_pretrained(source), False
    if (source / "config.json").is_file() and any(source.glob("pipeline_stage_[0-9][0-9].safetensors")):
        from finetune.checkpoints.pipeline_stages import consolidated_state

        return _model_from_state(consolidated_state(source), source, f"the pipeline stages in {source}"), False
    if (source / "config.json").is_file() and _zero_shards(source):
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        state = get_fp32_state_dict_from_zero_checkpoint(str(source))
        return _model_from_state(state, source, f"the ZeRO shards in {source}"), False
    raise RecipeError(f"{source} holds no model: expected model.safetensors, ZeRO shards (global_step*/) with "
                      f"config.json, FSDP shards ({FSDP_MODEL_SHARDS}/), or a LoRA adapter (adapter_config.json).")


FSDP_MODEL_SHARDS = "pytorch_model_fsdp_0"  # Accelerate's `save_fsdp_model` folder in a checkpoint


def _merged_fsdp_model(source: Path, merge_lora: bool, base_model: str | None, seed: int | None):
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
        model = get_peft_model(_base_model(base_model or config.base_model_name_or_path, seed, source), config)
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


def _pipeline_adapters(source: Path, merge_lora: bool, base_model: str | None, seed: int | None):
    """`(model, is_adapter)` from a pipeline LoRA checkpoint: each stage's file holds its adapters, named as in the
    whole adapted model, put onto the base its `adapter_config.json` names; merged (`--merge-lora`) or written as
    the one adapter file peft loads."""
    from peft import PeftConfig, get_peft_model

    from finetune.checkpoints.pipeline_stages import consolidated_state

    config = PeftConfig.from_pretrained(source)
    model = get_peft_model(_base_model(base_model or config.base_model_name_or_path, seed, source), config)
    missing, unexpected = model.load_state_dict(consolidated_state(source), strict=False)
    adapters = {name for name, parameter in model.named_parameters() if parameter.requires_grad}
    if unexpected or adapters & set(missing):
        raise RecipeError(f"the pipeline stages in {source} do not match its adapter_config.json "
                          f"(missing {sorted(adapters & set(missing))[:3]}, unexpected {sorted(unexpected)[:3]}).")
    return (model.merge_and_unload(), False) if merge_lora else (model, True)


def _model_from_state(state: dict, config_dir: Path, what: str):
    """The model `config_dir/config.json` describes, holding the consolidated `state` (a tied head may be absent),
    built in the dtype the state holds: a checkpoint's config names the stored model's dtype (bf16 for a hub
    checkpoint), and building in it would round the fp32 masters before any `--dtype` applies."""
    from transformers import AutoConfig

    dtype = next((tensor.dtype for tensor in state.values() if tensor.is_floating_point()), None)
    model = model_class(config_dir).from_config(AutoConfig.from_pretrained(config_dir), dtype=dtype)
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = {name for name in missing if name.endswith("lm_head.weight") and model.config.tie_word_embeddings}
    if set(missing) - tied or unexpected:
        raise RecipeError(f"{what} do not match {config_dir / 'config.json'} "
                          f"(missing {sorted(set(missing) - tied)[:3]}, unexpected {sorted(unexpected)[:3]}).")
    model.tie_weights()
    return model


def export(source: str | Path, out_dir: str | Path, merge_lora: bool = False, dtype: str | None = None,
           base_model: str | None = None, seed: int | None = None, force: bool = False) -> Path:
    source, out_dir = Path(source), Path(out_dir)
    if dtype is not None and dtype not in EXPORT_DTYPES:
        raise RecipeError(f"--dtype {dtype} is not one of {', '.join(EXPORT_DTYPES)}.")
    model, is_adapter = load_for_export(source, merge_lora, base_model, seed)
    check_destination(source, out_dir, force)
    if dtype is None and not is_adapter:  # a checkpoint holds the training precision: export as the run saves
        dtype = read_marker(source).get("final_weights_dtype")
    if dtype is not None:
        model = model.to(EXPORT_DTYPES[dtype])
    forget_earlier_export(out_dir)
    before = {path.name for path in out_dir.iterdir()} if out_dir.is_dir() else set()  # a user's files (--force)
    with writing_export(out_dir, weights_bytes(model), "the exported model"):
        model.save_pretrained(out_dir, safe_serialization=True)
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                     "processor_config.json", "preprocessor_config.json"):  # a vision-language model's processor too
            found = beside(source, name)
            if found is not None:
                (out_dir / name).write_bytes(found.read_bytes())
    written = sorted(path.name for path in out_dir.iterdir() if path.name not in before | {EXPORT_RECORD})
    outputs.write_record(out_dir, EXPORT_RECORD, {"source": str(source.resolve()), "dtype": dtype, "files": written})
    return out_dir


def check_destination(source: Path, out_dir: Path, force: bool, outside_the_run: bool = False) -> None:
    """Export never writes over what it reads: the destination is not the source, inside it or around it (a link to
    either counts as it), nor a training run's output_dir or checkpoint, even under `force`; with `outside_the_run`
    (a served copy, written whole and removed after) not inside the source's run either, where `finetune export
    RUN/checkpoint-N RUN/merged` is a user's habit. A non-empty folder is written into only when an earlier export left
    it (its files are replaced) or with `force`: a user's files are not overwritten unasked."""
    source_real, out_real = source.resolve(), out_dir.resolve()
    source_run = source_real.parent if CHECKPOINT_NAME.match(source_real.name) else source_real
    where = ("is" if out_real == source_real else "is inside" if out_real.is_relative_to(source_real) else
             "holds" if source_real.is_relative_to(out_real) else
             "is inside the run of" if outside_the_run and out_real.is_relative_to(source_run) else None)
    if where is not None:
        raise RecipeError(f"the export destination {out_dir} {where} the source {source}: writing there would replace "
                          "or mix with the weights it is read from. Give a directory outside the run.")
    run_dir = out_real.parent if CHECKPOINT_NAME.match(out_real.name) else out_real
    if (run_dir / outputs.RUN_LOCK).is_file():  # another checkpoint of the run, or another run: its weights
        raise RecipeError(f"the export destination {out_dir} is {'a checkpoint of ' if run_dir != out_real else ''}"
                          f"the training run {run_dir}: exporting there would replace the weights a resume or chat "
                          "reads. Give a directory outside the run.")
    if out_dir.exists() and not out_dir.is_dir():
        raise RecipeError(f"the export destination {out_dir} is a file: give a directory.")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not (out_dir / EXPORT_RECORD).is_file() and not force:
        raise RecipeError(f"the export destination {out_dir} is not empty and holds no earlier export "
                          f"({EXPORT_RECORD}): give a new or empty directory, or pass --force to write into it.")


def earlier_export_files(out_dir: Path) -> list[str]:
    """The files an earlier export into `out_dir` wrote that are still there, as its record lists them."""
    record = out_dir / EXPORT_RECORD
    if not record.is_file():
        return []
    try:
        files = json.loads(record.read_text()).get("files", [])
    except (ValueError, AttributeError):
        files = []
    return [name for name in files if isinstance(name, str) and Path(name).name == name and (out_dir / name).is_file()]


def forget_earlier_export(out_dir: Path) -> list[str]:
    """Removes the files an earlier export into `out_dir` wrote, so none of its shards or adapter files is left beside
    the new model; returns their names."""
    removed = earlier_export_files(out_dir)
    for name in removed:
        (out_dir / name).unlink()
    return removed


def weights_bytes(model) -> int:
    """What `model`'s weights take in safetensors, as they are held (each tensor's elements times their size)."""
    return sum(weight.numel() * weight.element_size() for weight in model.state_dict().values())


@contextmanager
def writing_export(folder: Path, needed_bytes: int, what: str):
    """Around writing `what` (about `needed_bytes`) into `folder`, which it creates: stops before when the disk has
    less free, and turns a write that fails for want of space (finetune.checkpoints.disk.is_disk_full) into one line,
    after removing what the write left in `folder` (and `folder` itself if it made it): nothing partial stays."""
    import shutil

    from finetune.checkpoints.disk import free_bytes, human_bytes, is_disk_full

    def no_space() -> RecipeError:
        return RecipeError(f"no space left on {folder}: {human_bytes(free_bytes(folder))} free, {what} needs "
                           f"~{human_bytes(needed_bytes)}; nothing partial was left there. Free space there or give a "
                           "folder on another disk.")

    if free_bytes(folder) < needed_bytes:
        raise no_space()
    existed = folder.is_dir()
    folder.mkdir(parents=True, exist_ok=True)
    before = set(folder.iterdir())
    try:
        yield
    except BaseException as error:
        if not is_disk_full(error):
            raise
        for path in set(folder.iterdir()) - before:
            shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()
        if not existed:
            folder.rmdir()
        raise no_space() from None


def beside(source: Path, name: str) -> Path | None:
    """`source/name`, else `source.parent/name` (a checkpoint's own file, else its run's), refused by name when it
    does not read."""
    found = next((folder / name for folder in (source, source.parent) if (folder / name).is_file()), None)
    damage = None if found is None else file_damage(found)
    if damage is not None:
        raise RecipeError(f"{found} {damage}: it cannot be loaded. Copy it again from the model it came from.")
    return found
