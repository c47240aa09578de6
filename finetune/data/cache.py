"""The preprocessed-data cache: the tokenized (and packed) data `finetune preprocess` writes before a launch, which
`finetune train` then memory-maps on every rank instead of tokenizing on rank 0 while the others wait at a barrier.

The cache is valid for one key: a hash of everything that changes the rows training reads (the data's bytes, the
tokenizer, the chat template, every `DataArguments` key but those in `NOT_IN_KEY`, the mixing seed). The key is kept
part by part, so a stale cache is named with the parts that differ. The folder holds `datasets/` (`train` and `eval`
as `DatasetDict.save_to_disk` writes them), `generation_examples.json`, `data_summary.json` and `key.json`; it is
written under a temporary name and renamed into place, so a folder with a key is always whole. A new cache replaces
only those entries: a folder holding anything else, or the run's `output_dir` (or a folder holding it), is refused,
so a cache never deletes what it did not write.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
from pathlib import Path

from datasets import DatasetDict, load_from_disk

from finetune import outputs, presets
from finetune.data.summary import fingerprint
from finetune.data.tokenize import PreparedData
from finetune.errors import RecipeError

# Bump when tokenizing, masking or packing change the rows they write: older caches then read as stale.
PIPELINE_VERSION = 2
KEY_FILE = "key.json"
DATASETS = "datasets"
GENERATION_EXAMPLES = "generation_examples.json"
# DataArguments keys that leave the prepared rows unchanged; every other key is part of the cache key.
NOT_IN_KEY = {
    "preprocessed_dir": "where the cache lives, not what it holds",
    "padding_free": "a collator choice: the tokenized rows are the same",
    "dataset_num_proc": "how many processes tokenize, not what they write",
    "generation_max_new_tokens": "read while generating, after the data is prepared",
    "generation_eval_samples": "the cache keeps the prompts of every eval example; the first N are scored",
}
# Keys that name where the data is: the key holds a digest of what they name instead of the name.
DATA_LOCATIONS = ("dataset", "train_file", "eval_file", "mix_files")
DIGEST = "sha256:"
# Everything a cache folder holds: what `save_preprocessed` writes, and all it ever deletes.
CACHE_ENTRIES = (DATASETS, GENERATION_EXAMPLES, outputs.DATA_SUMMARY, KEY_FILE)


def cache_dir(data_args, output_dir) -> Path:
    """Where the cache of this recipe lives: `preprocessed_dir`, or `<output_dir>/preprocessed`."""
    return Path(data_args.preprocessed_dir or Path(output_dir, outputs.PREPROCESSED))


def cache_key(data_args, tokenizer, seed: int) -> dict[str, str]:
    """`{part: value}` for everything that changes the prepared rows: settings by their value, contents (data files,
    tokenizer, chat template) by a sha256 digest."""
    key = {"pipeline": str(PIPELINE_VERSION), **data_digests(data_args)}
    key["tokenizer"] = _digest(tokenizer_text(tokenizer).encode())
    key["chat_template"] = _digest(json.dumps(tokenizer.chat_template, sort_keys=True).encode())
    from finetune.models.vision import processor_of

    processor = processor_of(tokenizer)
    if processor is not None:  # a vision-language model's: its resize rules decide each image's tokens
        key["image_processor"] = _digest(processor.image_processor.to_json_string().encode())
    for field in dataclasses.fields(data_args):
        if field.name not in NOT_IN_KEY and field.name not in DATA_LOCATIONS:
            key[field.name] = str(getattr(data_args, field.name))
    if data_args.mix_files and len(data_args.mix_files) > 1:
        key["seed"] = str(seed)  # interleave_datasets draws the mix with the training seed
    return key


def key_digest(key: dict[str, str]) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


def data_digests(data_args) -> dict[str, str]:
    """A digest of each data source `load_raw_data` reads, named by its recipe key."""
    if data_args.mix_files:
        parts = {f"mix_files[{index}]": _file_digest(path) for index, path in enumerate(data_args.mix_files)}
    elif data_args.train_file is not None:
        parts = {"train_file": _file_digest(data_args.train_file)}
    else:
        parts = {"dataset": dataset_digest(data_args.dataset)}
    if data_args.eval_file is not None:
        parts["eval_file"] = _file_digest(data_args.eval_file)
    return parts


def dataset_digest(dataset: str) -> str:
    """The bytes of the embedded synthetic files, a local file or a local folder (`save_to_disk` output); for a hub
    id, the id and the revision the hub cache last fetched (the recipe pins none)."""
    if dataset == presets.SYNTHETIC_DATASET:
        return _folder_digest(presets.synthetic_data_dir())
    path = Path(dataset)
    if path.is_file():
        return _file_digest(path)
    if path.is_dir():
        return _folder_digest(path)
    return f"hub {dataset} at {_hub_revision(dataset)}"


def _hub_revision(dataset: str) -> str:
    from huggingface_hub.constants import HF_HUB_CACHE

    ref = Path(HF_HUB_CACHE, f"datasets--{dataset.replace('/', '--')}", "refs", "main")
    return ref.read_text().strip() if ref.is_file() else "an unrecorded revision"


def tokenizer_text(tokenizer) -> str:
    """What decides the tokenizer's ids: its `tokenizer.json` (vocabulary, merges, normalizer, pre- and
    post-processor) or, for a slow tokenizer, its vocabulary; and its special tokens, which templates and EOS use."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    vocabulary = backend.to_str() if backend is not None else json.dumps(sorted(tokenizer.get_vocab().items()))
    return f"{type(tokenizer).__name__}\n{vocabulary}\n{json.dumps(tokenizer.special_tokens_map, sort_keys=True)}"


def _digest(data: bytes) -> str:
    return DIGEST + hashlib.sha256(data).hexdigest()[:16]


def _file_digest(path) -> str:
    with open(path, "rb") as file:
        return DIGEST + hashlib.file_digest(file, "sha256").hexdigest()[:16]


def _folder_digest(folder: Path) -> str:
    digest = hashlib.sha256()
    for path in sorted(p for p in Path(folder).rglob("*") if p.is_file()):
        digest.update(f"{path.relative_to(folder)}\n{_file_digest(path)}\n".encode())
    return DIGEST + digest.hexdigest()[:16]


def stale_parts(saved: dict[str, str], wanted: dict[str, str]) -> list[str]:
    """What differs between the key a cache was written for and the one wanted now, in words."""
    changes = []
    for part in [*wanted, *(part for part in saved if part not in wanted)]:
        old, new = saved.get(part), wanted.get(part)
        if old == new:
            continue
        if str(old).startswith(DIGEST) and str(new).startswith(DIGEST):
            changes.append(f"`{part}` changed")
        else:
            changes.append(f"`{part}` is {new} (the cache has {old})")
    return changes


def check_cache_dir(directory, output_dir=None) -> Path:
    """`directory` may take a cache: it is new, empty or holds an earlier cache and nothing else (a new cache replaces
    those entries only, `CACHE_ENTRIES`); it is not the run's `output_dir` nor a folder holding it, where Trainer
    writes the model and checkpoints."""
    directory = Path(directory)
    named = f"`preprocessed_dir: {directory}`"
    if output_dir is not None:
        output = Path(output_dir).resolve()
        if directory.resolve() == output or directory.resolve() in output.parents:
            raise RecipeError(f"{named} is {'' if directory.resolve() == output else 'a folder holding '}the "
                              f"output_dir {output_dir}, where the model and checkpoints go, and a new cache replaces "
                              f"its folder: name a folder of its own (default: <output_dir>/{outputs.PREPROCESSED}).")
    if directory.exists() and not directory.is_dir():
        raise RecipeError(f"{named} holds something other than preprocessed data (it is a file): name a new or "
                          "empty folder.")
    entries = sorted(path.name for path in directory.iterdir()) if directory.is_dir() else []
    others = [name for name in entries if name not in CACHE_ENTRIES]
    if entries and KEY_FILE not in entries:  # a cache always has its key (written last, renamed in whole)
        others = entries
    if others:
        raise RecipeError(f"{named} holds something other than preprocessed data ({', '.join(others[:5])}"
                          f"{' ...' if len(others) > 5 else ''}; a cache holds {', '.join(CACHE_ENTRIES)}), which a "
                          "new cache would delete: name a new or empty folder, or move those out.")
    return directory


def save_preprocessed(data: PreparedData, directory, key: dict[str, str], output_dir=None) -> Path:
    """Writes the prepared data and its key to `directory`, replacing the entries of an earlier cache there and
    nothing else (`check_cache_dir`)."""
    directory = check_cache_dir(directory, output_dir)
    staging = directory.with_name(f".{directory.name}.{os.getpid()}.tmp")
    shutil.rmtree(staging, ignore_errors=True)
    splits = DatasetDict(train=data.train, **({"eval": data.eval} if data.eval is not None else {}))
    splits.save_to_disk(str(staging / DATASETS))
    outputs.write_record(staging, GENERATION_EXAMPLES, data.generation_examples)
    outputs.write_record(staging, outputs.DATA_SUMMARY, data.summary)
    outputs.write_record(staging, KEY_FILE, {"digest": key_digest(key), "parts": key})
    if directory.is_dir():
        for name in (KEY_FILE, *CACHE_ENTRIES):  # the key first: a folder without one is no cache
            entry = directory / name
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
            else:
                entry.unlink(missing_ok=True)
        directory.rmdir()  # empty now; an error if anything appeared meanwhile, which stays
    os.replace(staging, directory)
    return directory


def load_preprocessed(directory, data_args, tokenizer, seed: int) -> tuple[PreparedData | None, str]:
    """The cached data in `directory` (memory-mapped) when it was written for this data, tokenizer and seed
    (`cache_key`); otherwise None and why ("" when there is no cache there). The key, which reads every data file,
    is computed only when there is a cache to compare it with."""
    directory = Path(directory)
    try:
        record = outputs.read_record(directory, KEY_FILE, missing=None)
    except RecipeError as error:
        return None, f"the preprocessed data in {directory} is damaged ({error})"
    if record is None:
        return None, ""
    changes = stale_parts(record.get("parts", {}), cache_key(data_args, tokenizer, seed))
    if changes:
        return None, f"the preprocessed data in {directory} is stale ({'; '.join(changes)})"
    try:  # a damaged file reads as OSError ("Invalid flatbuffers message"), ArrowInvalid (a ValueError) or KeyError
        splits = load_from_disk(str(directory / DATASETS))
        summary = outputs.read_record(directory, outputs.DATA_SUMMARY)
        matches = fingerprint(splits["train"]) == summary["train_fingerprint"]
        examples = outputs.read_record(directory, GENERATION_EXAMPLES)
    except (OSError, ValueError, KeyError) as error:  # RecipeError (a record that is not JSON) is a ValueError
        first_line = (str(error).splitlines() or [""])[0]
        return None, f"the preprocessed data in {directory} is damaged ({type(error).__name__}: {first_line})"
    if not matches:
        return None, f"the preprocessed train rows in {directory} do not match their recorded fingerprint (damaged)"
    summary["preprocessed"] = {"dir": str(directory), "key": record["digest"]}
    data = PreparedData(splits["train"], splits["eval"] if "eval" in splits else None,
                        examples[: data_args.generation_eval_samples], summary)
    return data, ""
