"""Where the raw examples come from: the embedded synthetic set, local files (JSONL, JSON, CSV, Parquet), a
directory written by `datasets`' `save_to_disk`, several files mixed with weights, or a hub dataset id.

Files and hub ids go through `datasets.load_dataset`, so a local file and a hub dataset take the same path.
The eval split is a given file, the source's own validation/test split, or `eval_split_ratio` of train.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from datasets import Dataset, DatasetDict, load_dataset, load_from_disk

from finetune import presets
from finetune.errors import RecipeError

# File suffix → the `datasets` builder that reads it.
FILE_BUILDERS = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}


@dataclass
class Source:
    name: str
    train: Dataset
    eval: Dataset | None = None


@dataclass
class RawData:
    sources: list[Source]
    weights: list[float] | None = None  # sampling probabilities when several sources are mixed


def _builder_for(path: str, key: str) -> str:
    builder = FILE_BUILDERS.get(Path(path).suffix.lower())
    if builder is None:
        raise RecipeError(
            f"`{key}: {path}` has an unsupported suffix; use one of {', '.join(sorted(FILE_BUILDERS))}."
        )
    return builder


def first_bad_json_line(path: str) -> str | None:
    """`path:line: reason` for the first line of a JSONL file (or the spot in a JSON file) that does not parse."""
    text = Path(path).read_text(encoding="utf-8", errors="replace")
    if Path(path).suffix.lower() == ".json":
        try:
            json.loads(text)
        except json.JSONDecodeError as error:
            return f"{path}:{error.lineno}: {error.msg} (column {error.colno})"
        return None
    for number, line in enumerate(text.splitlines(), start=1):
        if line.strip():
            try:
                json.loads(line)
            except json.JSONDecodeError as error:
                return f"{path}:{number}: {error.msg} (column {error.colno})"
    return None


def first_non_utf8_line(path: str) -> str | None:
    """`path:line: not UTF-8 text (byte 0x..)` for the first line of a text file that is not UTF-8."""
    with open(path, "rb") as file:
        for number, line in enumerate(file, start=1):
            try:
                line.decode("utf-8")
            except UnicodeDecodeError as error:
                return f"{path}:{number}: not UTF-8 text (byte 0x{line[error.start]:02x})"
    return None


def _check_utf8(splits: DatasetDict, source: str, files: dict) -> None:
    """Arrow's JSON and CSV readers keep a string's bytes as they are; invalid UTF-8 would surface as a
    UnicodeDecodeError mid-tokenizing. Arrow's full validation checks every string column at C speed."""
    for split in splits.values():
        try:
            split.data.table.validate(full=True)
        except ValueError:  # pyarrow's ArrowInvalid
            bad = next((found for file in files.values() if (found := first_non_utf8_line(file))), None)
            where = bad or f"dataset `{source}`: a text column is not UTF-8"
            raise RecipeError(f"{where}; save the file as UTF-8 (e.g. `iconv -f latin1 -t utf-8`).") from None


def _load(source: str, path: str, **kwargs) -> DatasetDict:
    try:
        splits = DatasetDict(load_dataset(path, **kwargs))
    except Exception as error:  # datasets raises many types; all mean "this source cannot be read"
        if "corresponds to no data" in str(error):
            raise RecipeError(f"the `train` split of the dataset is empty ({source}).") from None
        for file in (kwargs.get("data_files") or {}).values():
            if path in FILE_BUILDERS.values() and path != "parquet" and (bad := first_non_utf8_line(file)):
                raise RecipeError(f"{bad}; save the file as UTF-8 (e.g. `iconv -f latin1 -t utf-8`).") from None
            if path == "json" and (bad := first_bad_json_line(file)):
                raise RecipeError(f"malformed JSON at {bad}; fix or remove that line.") from None
        raise RecipeError(f"cannot load dataset `{source}`: {type(error).__name__}: {error}") from None
    _check_utf8(splits, source, kwargs.get("data_files") or {})
    return splits


def _is_blank(path: str) -> bool:
    """Whether a file holds nothing but whitespace (read until the first other byte)."""
    with open(path, "rb") as file:
        while chunk := file.read(1 << 16):
            if chunk.strip():
                return False
    return True


def _load_file(path: str, key: str) -> Dataset:
    builder = _builder_for(path, key)
    if _is_blank(path):
        raise RecipeError(f"`{key}: {path}` is empty: it holds no examples; point it at your data file.")
    return _load(path, builder, data_files={"train": path})["train"]


def _load_named(dataset: str) -> DatasetDict:
    if dataset == presets.SYNTHETIC_DATASET:
        directory = presets.synthetic_data_dir()
        files = {"train": str(directory / "train.jsonl"), "eval": str(directory / "eval.jsonl")}
        return _load(dataset, "json", data_files=files)
    path = Path(dataset)
    if path.is_file():
        return DatasetDict(train=_load_file(dataset, "dataset"))
    if (path / "dataset_info.json").is_file() or (path / "dataset_dict.json").is_file():
        loaded = load_from_disk(dataset)  # written by save_to_disk
        return loaded if isinstance(loaded, DatasetDict) else DatasetDict(train=loaded)
    return _load(dataset, dataset)  # a local dataset directory or a hub id


def load_raw_data(data_args) -> RawData:
    """Every training source with its eval split (when there is one), and the mixing weights."""
    if data_args.mix_files:
        sources = [Source(Path(path).name, _load_file(path, "mix_files")) for path in data_args.mix_files]
        weights = data_args.mix_weights or [1.0] * len(sources)
        total = sum(weights)
        weights = [weight / total for weight in weights]
    else:
        if data_args.train_file is not None:
            splits = DatasetDict(train=_load_file(data_args.train_file, "train_file"))
        else:
            splits = _load_named(data_args.dataset)
        if "train" not in splits:
            raise RecipeError(f"dataset `{data_args.dataset}` has no `train` split (found: {', '.join(splits)}).")
        eval_split = next((splits[name] for name in ("eval", "validation", "test") if name in splits), None)
        sources, weights = [Source(data_args.train_file or data_args.dataset, splits["train"], eval_split)], None
    if data_args.eval_file is not None:
        sources[0].eval = _load_file(data_args.eval_file, "eval_file")
    for source in sources:
        if len(source.train) == 0:
            raise RecipeError(f"the `train` split of {source.name} is empty.")
        if source.eval is None and data_args.eval_split_ratio > 0:
            try:
                split = source.train.train_test_split(test_size=data_args.eval_split_ratio, seed=0)
            except ValueError as error:  # datasets' own check: one side of the split would be empty
                raise RecipeError(f"`eval_split_ratio: {data_args.eval_split_ratio}` cannot split the "
                                  f"{len(source.train)} example(s) of {source.name} into a train and an eval part "
                                  f"({str(error).splitlines()[0]}): give more examples, an `eval_file`, or "
                                  "`eval_split_ratio: 0`.") from None
            source.train, source.eval = split["train"], split["test"]
        if source.eval is not None and len(source.eval) == 0:
            raise RecipeError(f"the eval split of {source.name} is empty.")
    return RawData(sources, weights)


def load_raw_splits(data_args) -> DatasetDict:
    """The single source's `train` and, when there is one, `eval` split."""
    source = load_raw_data(data_args).sources[0]
    return DatasetDict(train=source.train, **({"eval": source.eval} if source.eval is not None else {}))
