"""The preprocessed-data cache: the tokenized (and packed) data `finetune preprocess` writes before a launch, which
`finetune train` then memory-maps on every rank instead of tokenizing on rank 0 while the others wait at a barrier.

The cache is valid for one key: a hash of everything that changes the rows training reads (the data's bytes, the
tokenizer, the chat template, every `DataArguments` key but those in `NOT_IN_KEY`, the mixing seed). The key is kept
part by part, so a stale cache is named with the parts that differ. The folder holds `datasets/` (`train` and `eval`
as `DatasetDict.save_to_disk` writes them), `generation_examples.json`, `data_summary.json` and `key.json`; it is
written under a temporary name and renamed into place, so a folder with a key is always whole.
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
PIPELINE_VERSION = 1
KEY_FILE = "key.json"
DATASETS = "datasets"
GENERATION_EXAMPLES = "generation_examples.json"
# DataArguments keys that leave the prepared rows unchanged; every other key is part of the cache key.
NOT_IN_KEY = {
    "preprocessed_dir": "where the cache lives, not what it holds",
    "padding_free": "a collator choice: the tokenized rows are the same",
    "generation_max_new_tokens": "read while generating, after the data is prepared",
}
# Keys that name where the data is: the key holds a digest of what they name instead of the name.
DATA_LOCATIONS = ("dataset", "train_file", "eval_file", "mix_files")
DIGEST = "sha256:"


def cache_dir(data_args, output_dir) -> Path:
    """Where the cache of this recipe lives: `preprocessed_dir`, or `<output_dir>/preprocessed`."""
    return Path(data_args.preprocessed_dir or Path(output_dir, outputs.PREPROCESSED))


def cache_key(data_args, tokenizer, seed: int) -> dict[str, str]:
    """`{part: value}` for everything that changes the prepared rows: settings by their value, contents (data files,
    tokenizer, chat template) by a sha256 digest."""
    key = {"pipeline": str(PIPELINE_VERSION), **data_digests(data_args)}
    key["tokenizer"] = _digest(tokenizer_text(tokenizer).encode())
    key["chat_template"] = _digest(json.dumps(tokenizer.chat_template, sort_keys=True).encode())
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


def check_cache_dir(directory) -> Path:
    """`directory` may take a cache: it is new, empty or an earlier cache (never another folder, which the cache
    would replace)."""
    directory = Path(directory)
    if directory.exists() and (not directory.is_dir() or any(directory.iterdir())) \
            and not (directory / KEY_FILE).is_file():
        raise RecipeError(f"`preprocessed_dir: {directory}` holds something other than preprocessed data (it is a "
                          f"file, or a folder with files but no {KEY_FILE}); name a new or empty folder.")
    return directory


def save_preprocessed(data: PreparedData, directory, key: dict[str, str]) -> Path:
    """Writes the prepared data and its key to `directory`, replacing an earlier cache there (`check_cache_dir`)."""
    directory = check_cache_dir(directory)
    staging = directory.with_name(f".{directory.name}.{os.getpid()}.tmp")
    shutil.rmtree(staging, ignore_errors=True)
    splits = DatasetDict(train=data.train, **({"eval": data.eval} if data.eval is not None else {}))
    splits.save_to_disk(str(staging / DATASETS))
    outputs.write_record(staging, GENERATION_EXAMPLES, data.generation_examples)
    outputs.write_record(staging, outputs.DATA_SUMMARY, data.summary)
    outputs.write_record(staging, KEY_FILE, {"digest": key_digest(key), "parts": key})
    shutil.rmtree(directory, ignore_errors=True)
    os.replace(staging, directory)
    return directory


def load_preprocessed(directory, data_args, tokenizer, seed: int) -> tuple[PreparedData | None, str]:
    """The cached data in `directory` (memory-mapped) when it was written for this data, tokenizer and seed
    (`cache_key`); otherwise None and why ("" when there is no cache there). The key, which reads every data file,
    is computed only when there is a cache to compare it with."""
    directory = Path(directory)
    record = outputs.read_record(directory, KEY_FILE, missing=None)
    if record is None:
        return None, ""
    changes = stale_parts(record.get("parts", {}), cache_key(data_args, tokenizer, seed))
    if changes:
        return None, f"the preprocessed data in {directory} is stale ({'; '.join(changes)})"
    splits = load_from_disk(str(directory / DATASETS))
    summary = outputs.read_record(directory, outputs.DATA_SUMMARY)
    if fingerprint(splits["train"]) != summary["train_fingerprint"]:
        return None, f"the preprocessed train rows in {directory} do not match their recorded fingerprint (damaged)"
    summary["preprocessed"] = {"dir": str(directory), "key": record["digest"]}
    data = PreparedData(splits["train"], splits["eval"] if "eval" in splits else None,
                        outputs.read_record(directory, GENERATION_EXAMPLES), summary)
    return data, ""
