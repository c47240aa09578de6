"""Where the raw examples come from: the embedded synthetic set, local files (JSONL, JSON, CSV, Parquet), a
directory written by `datasets`' `save_to_disk`, several files mixed with weights, a hub dataset id (a configuration
and split of it), or a `dataset_mixture` of several (finetune.data.mixture).

Files and hub ids go through `datasets.load_dataset`, so a local file, a local dataset folder laid out as a hub
repository and a hub dataset take the same path. The eval split is a given file, the named `eval_split`, the
source's own eval/validation/test split, or `eval_split_ratio` of train.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from datasets import Dataset, DatasetDict, concatenate_datasets, interleave_datasets, load_dataset, load_from_disk

from finetune import presets
from finetune.errors import RecipeError, did_you_mean

# File suffix → the `datasets` builder that reads it.
FILE_BUILDERS = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}


@dataclass
class Source:
    name: str
    train: Dataset
    eval: Dataset | None = None
    format: str | None = None  # this source's own dataset_format (a mixture's entry); None: the recipe's

    def splits(self, max_eval_samples: int | None) -> dict[str, Dataset | None]:
        """Its `train` and `eval` splits (None where there is none), the eval one cut to its first `max_eval_samples`
        rows."""
        evaluation = self.eval
        if max_eval_samples is not None and evaluation is not None:
            evaluation = evaluation.select(range(min(max_eval_samples, len(evaluation))))
        return {"train": self.train, "eval": evaluation}

    def declared_format(self, data_args) -> str:
        """The format this source is read in: its own (a mixture entry's), else the recipe's `dataset_format`."""
        return self.format if self.format not in (None, "auto") else data_args.dataset_format


@dataclass
class RawData:
    sources: list[Source]
    weights: list[float] | None = None  # sampling probabilities when several sources are mixed

    def mixed(self, trains: list[Dataset], seed: int) -> Dataset:
        """The sources' (prepared) training rows as one set: drawn by `weights` until one runs out (`mix_files`), or
        concatenated (a `dataset_mixture`, whose rows per source are already chosen)."""
        if len(trains) == 1:
            return trains[0]
        if self.weights is not None:
            return interleave_datasets(trains, probabilities=self.weights, seed=seed)
        return concatenate_datasets(trains)


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
        loaded = load_dataset(path, **kwargs)
        splits = loaded if isinstance(loaded, DatasetDict) else DatasetDict({kwargs.get("split") or "train": loaded})
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


def _load_file(path: str, key: str, split: str = "train", split_key: str = "dataset_split") -> Dataset:
    """The rows of a data file: its `train` split, or a slice of it (`train[:1000]`, `train[10%:]`) read as
    `load_dataset` reads a slice of any split."""
    builder = _builder_for(path, key)
    if _is_blank(path):
        raise RecipeError(f"`{key}: {path}` is empty: it holds no examples; point it at your data file.")
    if split.split("[")[0].strip() != "train":
        raise RecipeError(f"`{split_key}: {split}`: `{path}` is a file, whose rows are the `train` split; give "
                          "`train` or a slice of it such as `train[:1000]`.")
    return _load(path, builder, data_files={"train": path}, split=split)[split]


def check_no_config(dataset: str, config: str | None, key: str, config_key: str = "dataset_config") -> None:
    """A configuration picks a subset of a hub dataset (or a hub-shaped folder); a file or a `save_to_disk` folder has
    none, and `load_dataset` would ignore it without a word."""
    if config is not None:
        raise RecipeError(f"`{config_key}: {config}` selects a configuration (subset) of a hub dataset, but "
                          f"`{key}: {dataset}` is a local file or saved dataset, which has none: drop `{config_key}`.")


def check_exists(dataset: str, key: str) -> None:
    """A name that looks like a file (a data file's suffix, or a path: finetune.models.loading.looks_local) and names
    nothing here is refused, not sent to the hub as a dataset id."""
    from finetune.models.loading import looks_local

    if Path(dataset).expanduser().exists():
        return
    if Path(dataset).suffix.lower() in FILE_BUILDERS or looks_local(dataset):
        raise RecipeError(f"`{key}: {dataset}`: file {dataset} does not exist{_nearby(dataset)}; check the path "
                          f"(relative to {Path.cwd()}), or give a hub dataset id such as "
                          "`HuggingFaceH4/ultrachat_200k`.")


def _nearby(dataset: str) -> str:
    """` (did you mean `x`?)` for a close name in the folder `dataset` would be in, where that folder exists (one
    listing, never a walk)."""
    folder = os.path.dirname(dataset)
    try:
        names = [os.path.join(folder, entry.name) for entry in Path(folder or ".").expanduser().iterdir()]
    except OSError:  # no such folder, or not one we may read
        return ""
    return did_you_mean(dataset, names)


def _saved_to_disk(path: Path) -> bool:
    return (path / "dataset_info.json").is_file() or (path / "dataset_dict.json").is_file()


def _load_named(dataset: str, config: str | None = None, key: str = "dataset", **kwargs) -> DatasetDict:
    if dataset == presets.SYNTHETIC_DATASET:
        directory = presets.synthetic_data_dir()
        files = {"train": str(directory / "train.jsonl"), "eval": str(directory / "eval.jsonl")}
        return synthetic_tasks(_load(dataset, "json", data_files=files), config)
    from finetune.data.vision import synthetic as vision_synthetic

    if dataset == vision_synthetic.DATASET:  # images drawn in code (finetune.data.vision.synthetic)
        check_no_config(dataset, config, key)
        return vision_synthetic.splits()
    path = Path(dataset)
    if path.is_file() or _saved_to_disk(path):
        check_no_config(dataset, config, key)
    if path.is_file():
        return DatasetDict(train=_load_file(dataset, key))
    if _saved_to_disk(path):
        loaded = load_from_disk(dataset)  # written by save_to_disk
        return loaded if isinstance(loaded, DatasetDict) else DatasetDict(train=loaded)
    check_exists(dataset, key)
    return _load(dataset, dataset, name=config, **kwargs)  # a local dataset directory or a hub id


def synthetic_tasks(splits: DatasetDict, config: str | None) -> DatasetDict:
    """The embedded tasks, all of them or those `dataset_config` names (`add`, or `sort,add`)."""
    if config is None:
        return splits
    tasks = sorted(set(splits["train"]["task"]))
    wanted = [task.strip() for task in config.split(",")]
    unknown = [task for task in wanted if task not in tasks]
    if unknown:
        raise RecipeError(f"`dataset_config: {config}`: the synthetic tasks are {', '.join(tasks)} (one, or several "
                          "separated by commas).")
    return DatasetDict({name: split.filter(lambda row: row["task"] in wanted) for name, split in splits.items()})


def _pick_split(splits: DatasetDict, split: str, source: str, config: str | None,
                split_key: str = "dataset_split") -> Dataset:
    """`split` of `splits` (those of `source`'s `config`); a slice (`train[:1000]`) loaded as `load_dataset` reads it;
    a missing one named with those found."""
    if split in splits:
        return splits[split]
    if Path(source).is_file():  # a file's rows are its `train` split, sliced as `load_dataset` slices one
        return _load_file(source, "dataset", split, split_key)
    if "[" in split and split.split("[")[0] in splits:
        return _load(source, source, name=config, split=split)[split]
    raise RecipeError(f"dataset `{source}` has no `{split}` split (found: {', '.join(splits)}).")


def _load_split(dataset: str, config: str | None, split: str, data_files=None, data_dir=None) -> Dataset:
    """One split of a dataset: a file (its rows are the `train` split), a `save_to_disk` folder, or a local folder
    or hub id through `load_dataset(path, name=config, split=split)`."""
    path = Path(dataset)
    if path.is_file():
        check_no_config(dataset, config, "dataset_mixture` dataset `id", "config")
        return _load_file(dataset, "dataset_mixture", split, "split")
    if _saved_to_disk(path) or data_files is None and data_dir is None:
        splits = _load_named(dataset, config, "dataset_mixture` dataset `id")
        return _pick_split(splits, split, dataset, config, "split")
    check_exists(dataset, "dataset_mixture` dataset `id")
    return _load(dataset, dataset, name=config, split=split, data_files=data_files, data_dir=data_dir)[split]


def _load_mixture(data_args) -> list[Source]:
    """Each dataset of `dataset_mixture` as a source: its split, columns renamed and kept, its rows chosen, and its
    share of `test_split_size` held out for eval (in proportion to its rows)."""
    from finetune.data.mixture import kept_rows

    mixture = data_args.mixture
    loaded = []
    for entry in mixture.entries:
        rows = _load_split(entry.path, entry.config, entry.split, entry.data_files, entry.data_dir)
        if entry.rename:
            missing = [column for column in entry.rename if column not in rows.column_names]
            if missing:
                raise RecipeError(f"`dataset_mixture` dataset {entry.name} has no column `{missing[0]}` to rename "
                                  f"(columns: {', '.join(rows.column_names)}).")
            rows = rows.rename_columns(entry.rename)
        if entry.columns:
            missing = [column for column in entry.columns if column not in rows.column_names]
            if missing:
                raise RecipeError(f"`dataset_mixture` dataset {entry.name} has no column `{missing[0]}` (`columns`; it "
                                  f"has {', '.join(rows.column_names)}).")
            rows = rows.select_columns(list(entry.columns))
        loaded.append(rows)
    sources = []
    for entry, rows, keep in zip(mixture.entries, loaded, kept_rows(mixture, [len(rows) for rows in loaded])):
        if entry.weight is not None:  # the handbook's: a random fraction of the rows, seeded
            rows = rows.shuffle(seed=mixture.seed).select(range(keep))
        else:
            rows = rows.select(range(keep))
        sources.append(Source(entry.name, rows, format=entry.format))
    if mixture.test_split_size is not None:
        _hold_out(sources, mixture.test_split_size, f"dataset_mixture's `test_split_size: {mixture.test_split_size}`",
                  mixture.seed)
    return sources


def _hold_out(sources: list[Source], size, key: str, seed: int = 0) -> None:
    """Eval rows split off each source without an eval split: a fraction of each, or a count of rows shared out in
    proportion to their rows."""
    total = sum(len(source.train) for source in sources if source.eval is None)
    for source in sources:
        if source.eval is not None:
            continue
        held = size if size < 1 else round(int(size) * len(source.train) / total)
        if held:
            split = _split_off(source, held, key, seed)
            source.train, source.eval = split["train"], split["test"]


def _split_off(source: Source, size, key: str, seed: int = 0) -> DatasetDict:
    try:
        return source.train.train_test_split(test_size=size, seed=seed)
    except ValueError as error:  # datasets' own check: one side of the split would be empty
        raise RecipeError(f"{key} cannot split the {len(source.train)} example(s) of {source.name} into a "
                          f"train and an eval part ({str(error).splitlines()[0]}): give more examples, an "
                          "`eval_file`, or no split.") from None


def _eval_of(splits: DatasetDict, data_args) -> Dataset | None:
    wanted = data_args.eval_split
    if wanted is None:
        return next((splits[name] for name in ("eval", "validation", "test") if name in splits), None)
    if wanted.lower() == "none":
        return None
    return _pick_split(splits, wanted, data_args.dataset, data_args.dataset_config, "eval_split")


def load_raw_data(data_args) -> RawData:
    """Every training source with its eval split (when there is one), and the mixing weights."""
    if data_args.mixture is not None:
        sources, weights = _load_mixture(data_args), None
    elif data_args.mix_files:
        sources = [Source(Path(path).name, _load_file(path, "mix_files")) for path in data_args.mix_files]
        weights = data_args.mix_weights or [1.0] * len(sources)
        total = sum(weights)
        weights = [weight / total for weight in weights]
    else:
        if data_args.train_file is not None:
            check_no_config(data_args.train_file, data_args.dataset_config, "train_file")
            splits = DatasetDict(train=_load_file(data_args.train_file, "train_file", data_args.dataset_split))
            train = splits["train"]
        else:
            splits = _load_named(data_args.dataset, data_args.dataset_config)
            train = _pick_split(splits, data_args.dataset_split, data_args.dataset, data_args.dataset_config)
        sources, weights = [Source(data_args.train_file or data_args.dataset, train, _eval_of(splits, data_args))], None
    if data_args.eval_file is not None:
        sources[0].eval = _load_file(data_args.eval_file, "eval_file")
    for source in sources:
        if len(source.train) == 0:
            raise RecipeError(f"the `train` split of {source.name} is empty.")
    if data_args.eval_split_ratio > 0:
        _hold_out(sources, data_args.eval_split_ratio, f"`eval_split_ratio: {data_args.eval_split_ratio}`")
    for source in sources:
        if source.eval is not None and len(source.eval) == 0:
            raise RecipeError(f"the eval split of {source.name} is empty.")
    return RawData(sources, weights)


def load_raw_splits(data_args) -> DatasetDict:
    """The single source's `train` and, when there is one, `eval` split."""
    source = load_raw_data(data_args).sources[0]
    return DatasetDict(train=source.train, **({"eval": source.eval} if source.eval is not None else {}))
