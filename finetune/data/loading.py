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


def load_raw_splits(data_args) -> DatasetDict:
    """A `DatasetDict` with a `train` split and, when one is available, an `eval` split."""
    if data_args.train_file is not None:
        data_files = {"train": data_args.train_file}
        if data_args.eval_file is not None:
            data_files["eval"] = data_args.eval_file
        builders = {_builder_for(path, f"{split}_file") for split, path in data_files.items()}
        if len(builders) > 1:
            raise RecipeError("`train_file` and `eval_file` must have the same format (e.g. both .jsonl).")
        splits = load_dataset(builders.pop(), data_files=data_files)
    elif data_args.dataset == presets.SYNTHETIC_DATASET:
        directory = presets.synthetic_data_dir()
        data_files = {"train": str(directory / "train.jsonl"), "eval": str(directory / "eval.jsonl")}
        splits = load_dataset("json", data_files=data_files)
    elif Path(data_args.dataset).exists():
        path = Path(data_args.dataset)
        if path.is_file():
            splits = load_dataset(_builder_for(str(path), "dataset"), data_files={"train": str(path)})
        else:
            splits = load_dataset(str(path))
    else:
        splits = load_dataset(data_args.dataset)  # a hub dataset id
    splits = DatasetDict(splits)
    if "train" not in splits:
        raise RecipeError(f"dataset `{data_args.dataset}` has no `train` split (found: {', '.join(splits)}).")
    for name in ("validation", "test"):
        if "eval" not in splits and name in splits:
            splits["eval"] = splits.pop(name)
    for name, split in splits.items():
        if len(split) == 0:
            raise RecipeError(f"the `{name}` split of the dataset is empty.")
    return splits
