"""Where the raw examples come from: the embedded synthetic set, local files, or a hub dataset id.

Everything goes through `datasets.load_dataset`, so a local file and a hub dataset take the same path.
"""

from __future__ import annotations

from pathlib import Path

from datasets import DatasetDict, load_dataset

from finetune import presets
from finetune.errors import RecipeError

# File suffix → the `datasets` builder that reads it.
FILE_BUILDERS = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}


def _builder_for(path: str, key: str) -> str:
    builder = FILE_BUILDERS.get(Path(path).suffix.lower())
    if builder is None:
        raise RecipeError(
            f"`{key}: {path}` has an unsupported suffix; use one of {', '.join(sorted(FILE_BUILDERS))}."
        )
    return builder


def _load(source: str, path: str, **kwargs) -> DatasetDict:
    try:
        return DatasetDict(load_dataset(path, **kwargs))
    except RecipeError:
        raise
    except Exception as error:  # datasets raises many types; all mean "this source cannot be read"
        if "corresponds to no data" in str(error):
            raise RecipeError(f"the `train` split of the dataset is empty ({source}).") from None
        raise RecipeError(f"cannot load dataset `{source}`: {type(error).__name__}: {error}") from None


def load_raw_splits(data_args) -> DatasetDict:
    """A `DatasetDict` with a `train` split and, when one is available, an `eval` split."""
    if data_args.train_file is not None:
        data_files = {"train": data_args.train_file}
        if data_args.eval_file is not None:
            data_files["eval"] = data_args.eval_file
        builders = {_builder_for(path, f"{split}_file") for split, path in data_files.items()}
        if len(builders) > 1:
            raise RecipeError("`train_file` and `eval_file` must have the same format (e.g. both .jsonl).")
        splits = _load(", ".join(data_files.values()), builders.pop(), data_files=data_files)
    elif data_args.dataset == presets.SYNTHETIC_DATASET:
        directory = presets.synthetic_data_dir()
        data_files = {"train": str(directory / "train.jsonl"), "eval": str(directory / "eval.jsonl")}
        splits = _load(data_args.dataset, "json", data_files=data_files)
    elif Path(data_args.dataset).is_file():
        path = data_args.dataset
        splits = _load(path, _builder_for(path, "dataset"), data_files={"train": path})
    else:
        splits = _load(data_args.dataset, data_args.dataset)  # a local dataset directory or a hub id
    if "train" not in splits:
        raise RecipeError(f"dataset `{data_args.dataset}` has no `train` split (found: {', '.join(splits)}).")
    for name in ("validation", "test"):
        if "eval" not in splits and name in splits:
            splits["eval"] = splits.pop(name)
    for name, split in splits.items():
        if len(split) == 0:
            raise RecipeError(f"the `{name}` split of the dataset is empty.")
    return splits
