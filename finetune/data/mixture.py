"""`dataset_mixture`: several datasets (hub ids, local dataset folders or files), each a split of a configuration,
mixed into one training set, in the alignment-handbook's schema:

    dataset_mixture:
      datasets:
        - id: HuggingFaceH4/ultrachat_200k   # or `path:` (TRL's name); a hub id, a local folder or a file
          config: default                    # or `name:`; the configuration (subset) to load
          split: train_sft                   # default train
          columns: [messages]                # the columns kept
          weight: 0.5                        # the fraction of its rows kept (shuffled with `seed` first)
      seed: 0
      test_split_size: 1000                  # rows (or, below 1, a fraction) held out for eval, taken from
                                             # each source in proportion to its rows

Instead of `weight`, an entry may give `rows` (its first rows, as LLaMA-Factory's `max_samples`) or `fraction` (TRL's
share of the mixture: normalised over the entries, which must all give one, and as many rows as the datasets hold
without repeating one). Each dataset is loaded with the same `datasets.load_dataset` call a hub id takes, and its
rows are kept in order of the list; Trainer's sampler shuffles the whole. Each keeps its own format (one may be
alpaca, another messages), so each is tokenized as a source of its own and the sources are concatenated.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from finetune.errors import RecipeError

ENTRY_KEYS = {"id", "path", "config", "name", "split", "columns", "weight", "fraction", "rows", "data_files",
              "data_dir", "format", "rename"}
MIXTURE_KEYS = {"datasets", "seed", "test_split_size"}


@dataclass(frozen=True)
class MixtureEntry:
    path: str
    config: str | None = None
    split: str = "train"
    columns: tuple[str, ...] | None = None
    weight: float | None = None  # the fraction of its rows kept, shuffled with the mixture's seed (handbook)
    fraction: float | None = None  # its share of the mixture (TRL)
    rows: int | None = None  # its first rows (LLaMA-Factory's max_samples)
    data_files: Any = None
    data_dir: str | None = None
    format: str = "auto"  # dataset_format of this source
    rename: dict[str, str] = field(default_factory=dict)  # column renames applied on load (theirs → ours)

    @property
    def name(self) -> str:
        config = f" ({self.config})" if self.config else ""
        return f"{self.path}{config} {self.split}"


@dataclass(frozen=True)
class Mixture:
    entries: tuple[MixtureEntry, ...]
    seed: int = 0
    test_split_size: float | None = None

    def to_dict(self) -> dict:
        return {"datasets": [{key: value for key, value in vars(entry).items() if value not in (None, {}, "auto")}
                             for entry in self.entries], "seed": self.seed, "test_split_size": self.test_split_size}


def _read(value: Any) -> dict:
    """The mixture as a mapping: given as one in the recipe, or as YAML/JSON text, or a file holding it."""
    if isinstance(value, dict):
        return value
    text = str(value)
    if Path(text).is_file():
        text = Path(text).read_text(encoding="utf-8")
    try:
        read = yaml.safe_load(text)
    except yaml.YAMLError as error:
        raise RecipeError(f"`dataset_mixture` is neither a mapping, a YAML/JSON text nor a file: {error}") from None
    if not isinstance(read, dict):
        raise RecipeError(f"`dataset_mixture` must be a mapping with `datasets:`, got {text!r:.80}.")
    return read


def _number(entry: dict, key: str, kind: type, where: str):
    """`entry[key]` as a positive finite number of `kind` (None when unset): a count of rows is whole (`rows: 2.7`
    would be read as 2 by `int`), and NaN, infinity or a flag (`true`) is refused, not carried into the sampling."""
    value = entry.get(key)
    if value is None:
        return None
    try:
        if isinstance(value, bool):
            raise TypeError(value)
        number = float(value)
    except (TypeError, ValueError):
        raise RecipeError(f"{where}: `{key}: {value}` is not a number.") from None
    if kind is int and math.isfinite(number) and not number.is_integer():
        raise RecipeError(f"{where}: `{key}: {value}` is not a whole number of rows; give a count such as "
                          f"`{key}: {max(int(number), 1)}`, or `weight` for a fraction of its rows.")
    if not math.isfinite(number) or number <= 0 or (key == "weight" and number > 1):
        limit = "in (0, 1] (the fraction of its rows kept; no row is repeated)" if key == "weight" else \
            "a positive finite number"
        raise RecipeError(f"{where}: `{key}: {value}` must be {limit}.")
    return kind(number)


def check_mix_weights(files: list[str] | None, weights: list | None) -> None:
    """`mix_weights`: one positive finite number per file of `mix_files`, the one at fault named with its file."""
    if weights is None:
        return
    files = files or []
    if len(weights) != len(files):
        raise RecipeError(f"`mix_weights` needs one positive weight per file of `mix_files` ({len(files)}), got "
                          f"{weights}.")
    for index, (file, weight) in enumerate(zip(files, weights), start=1):
        _number({"mix_weights": weight}, "mix_weights", float, f"`mix_weights` weight {index} (of {file})")


def parse_mixture(value: Any) -> Mixture:
    """The checked mixture; a `RecipeError` naming the entry and key at fault otherwise."""
    mixture = _read(value)
    unknown = set(mixture) - MIXTURE_KEYS
    if unknown:
        raise RecipeError(f"`dataset_mixture` has unknown key(s) {', '.join(sorted(unknown))}; it takes "
                          f"{', '.join(sorted(MIXTURE_KEYS))}.")
    datasets = mixture.get("datasets")
    if not isinstance(datasets, list) or not datasets:
        raise RecipeError("`dataset_mixture` needs `datasets:`, a list of datasets (each with `id` or `path`).")
    entries = []
    for index, entry in enumerate(datasets, start=1):
        where = f"`dataset_mixture` dataset {index}"
        if not isinstance(entry, dict):
            raise RecipeError(f"{where} must be a mapping (`id`, `config`, `split`, ...), got {entry!r:.80}.")
        unknown = set(entry) - ENTRY_KEYS
        if unknown:
            raise RecipeError(f"{where} has unknown key(s) {', '.join(sorted(unknown))}; it takes "
                              f"{', '.join(sorted(ENTRY_KEYS))}.")
        path = entry.get("id") or entry.get("path")
        if not path:
            raise RecipeError(f"{where} names no dataset: give `id` (a hub id, a local folder or a file).")
        where = f"{where} ({path})"
        chosen = [key for key in ("weight", "fraction", "rows") if entry.get(key) is not None]
        if len(chosen) > 1:
            raise RecipeError(f"{where} gives {' and '.join(f'`{key}`' for key in chosen)}; give one.")
        columns = entry.get("columns")
        if isinstance(columns, str):
            columns = [columns]
        entries.append(MixtureEntry(
            path=str(path), config=entry.get("config") or entry.get("name"), split=str(entry.get("split") or "train"),
            columns=tuple(columns) if columns else None, weight=_number(entry, "weight", float, where),
            fraction=_number(entry, "fraction", float, where), rows=_number(entry, "rows", int, where),
            data_files=entry.get("data_files"), data_dir=entry.get("data_dir"), format=entry.get("format") or "auto",
            rename=dict(entry.get("rename") or {})))
    given = [entry.fraction is not None for entry in entries]
    if any(given) and not all(given):
        raise RecipeError("`dataset_mixture`: `fraction` (a share of the mixture) must be given for every dataset or "
                          "for none.")
    test_split_size = mixture.get("test_split_size")
    if test_split_size is not None:
        size = float(test_split_size)
        if size <= 0 or (size >= 1 and size != int(size)):
            raise RecipeError(f"`dataset_mixture`: `test_split_size: {test_split_size}` is a fraction in (0, 1) or a "
                              "whole count of rows.")
        test_split_size = int(size) if size >= 1 else size
    return Mixture(tuple(entries), seed=int(mixture.get("seed") or 0), test_split_size=test_split_size)


def kept_rows(mixture: Mixture, lengths: list[int]) -> list[int]:
    """How many rows of each dataset the mixture keeps."""
    if mixture.entries[0].fraction is not None:  # shares of the mixture, as many rows as no dataset repeats
        shares = [entry.fraction / sum(e.fraction for e in mixture.entries) for entry in mixture.entries]
        total = min(length / share for length, share in zip(lengths, shares))
        return [round(share * total) for share in shares]
    kept = []
    for entry, length in zip(mixture.entries, lengths):
        if entry.weight is not None:
            kept.append(int(length * entry.weight))
        else:
            kept.append(min(entry.rows, length) if entry.rows is not None else length)
    return kept


def describe(mixture: Mixture) -> str:
    return json.dumps(mixture.to_dict(), sort_keys=True)
