"""`streaming: true`: the training data read as a stream (`datasets.IterableDataset`), for corpora too large to
tokenize, or even hold, ahead of training.

- Read: `load_dataset(..., streaming=True)` for a hub id, a local hub-shaped folder or a file; a `save_to_disk`
  folder becomes an iterable dataset of several shards.
- Tokenized and, with `packing`, packed as it is read: the same `Encoder` (chat template, verified spans, length
  policies) and TRL's `pack_dataset`, which bins each batch of 1,000 examples as it arrives (a stream cannot be
  sorted whole).
- Sharded by Accelerate, each process reading its own rows: whole shards of the stream when it has at least one per
  process, else every process reading the stream and keeping its own rows of each batch (`IterableDatasetShard`);
  never rank 0 reading for all (`dispatch_batches` is off), so the rows a rank trains on do not depend on another
  rank's speed.
- Steps: a stream has no length, so `max_steps` or `max_tokens` ends the run.
- Resume: Trainer skips the batches the checkpoint had trained on (Accelerate's `skip_first_batches`), reading the
  stream up to there again, so a resumed run sees the rows the uninterrupted one would have.
- The data summary tokenizes the first `SAMPLE_ROWS` examples of the stream and says so; eval comes from
  `eval_split` or `eval_file` (its first `max_eval_samples` rows, 1,000 when unset).
"""

from __future__ import annotations

from pathlib import Path

from datasets import Dataset, IterableDataset, load_dataset, load_from_disk
from trl.data_utils import pack_dataset

from finetune import presets
from finetune.data.cache import cache_key, key_digest
from finetune.data.formats import detect_format
from finetune.data.loading import FILE_BUILDERS, _builder_for, _saved_to_disk, check_exists, check_no_config
from finetune.data.tokenize import ENCODER_RECORDS, Encoder, PreparedData, _tokenize_split, generation_examples
from finetune.errors import RecipeError

SAMPLE_ROWS = 1000  # examples of the stream the data summary (and the planner) tokenizes
EVAL_ROWS = 1000  # eval examples taken from a streamed eval split when `max_eval_samples` is unset
SHARDS_PER_PROCESS = 4  # shards a `save_to_disk` folder is streamed in, per process


def open_stream(data_args, split: str, world_size: int = 1) -> IterableDataset:
    """`split` of the recipe's dataset as a stream."""
    if "[" in split:  # datasets slices a split it has counted; a stream is read in order and never counted
        key = "dataset_split" if split == data_args.dataset_split else "eval_split"
        raise RecipeError(f"`{key}: {split}`: a stream cannot be sliced (`streaming: true` reads the split in order "
                          f"without counting it); give the split `{split.split('[')[0].strip()}` and bound the run "
                          "with `max_steps` or `max_tokens`, or drop `streaming` to train on the slice.")
    try:
        if data_args.train_file is None and data_args.dataset == presets.SYNTHETIC_DATASET:  # one file per split
            if data_args.dataset_config is not None:
                raise RecipeError(f"`dataset_config: {data_args.dataset_config}` picks synthetic tasks of the files "
                                  "read whole; with `streaming: true` every task is streamed: drop one of them.")
            path = str(presets.synthetic_data_dir() / f"{split}.jsonl")
            return load_dataset("json", data_files={"train": path}, split="train", streaming=True)
        if data_args.train_file is not None:
            check_no_config(data_args.train_file, data_args.dataset_config, "train_file")
            return load_dataset(_builder_for(data_args.train_file, "train_file"),
                                data_files={"train": data_args.train_file}, split=split, streaming=True)
        folder = Path(data_args.dataset)
        if folder.is_file() or _saved_to_disk(folder):
            check_no_config(data_args.dataset, data_args.dataset_config, "dataset")
        if folder.is_file() and folder.suffix.lower() in FILE_BUILDERS:
            return load_dataset(_builder_for(str(folder), "dataset"), data_files={"train": str(folder)}, split=split,
                                streaming=True)
        if _saved_to_disk(folder):
            saved = load_from_disk(str(folder))
            rows = saved[split] if hasattr(saved, "keys") else saved
            return rows.to_iterable_dataset(num_shards=min(len(rows), SHARDS_PER_PROCESS * max(world_size, 1)))
        check_exists(data_args.dataset, "dataset")
        return load_dataset(data_args.dataset, name=data_args.dataset_config, split=split, streaming=True)
    except RecipeError:
        raise
    except Exception as error:  # datasets raises many types; all mean "this stream cannot be opened"
        raise RecipeError(f"cannot stream split `{split}` of `{data_args.train_file or data_args.dataset}`: "
                          f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}") from None


def _first_rows(stream: IterableDataset, count: int, what: str) -> Dataset:
    rows = list(stream.take(count))
    if not rows:
        raise RecipeError(f"the stream of {what} holds no example.")
    return Dataset.from_list(rows)


def sample_of(data_args, stream: IterableDataset | None = None) -> Dataset:
    """The first `SAMPLE_ROWS` examples of the training stream: what the data summary and the planner describe it
    by."""
    stream = stream if stream is not None else open_stream(data_args, data_args.dataset_split)
    return _first_rows(stream, SAMPLE_ROWS, data_args.train_file or data_args.dataset)


def prepare_stream(recipe, tokenizer) -> PreparedData:
    """The training stream (tokenized, packed), the eval rows and the data summary of a streaming recipe."""
    data_args, args = recipe.data, recipe.training
    name = data_args.train_file or data_args.dataset
    stream = open_stream(data_args, data_args.dataset_split, args.world_size)
    sample = sample_of(data_args, stream)
    dataset_format = detect_format(sample.column_names, data_args.dataset_format)
    _, sampled = _tokenize_split(sample, "train", tokenizer, data_args, dataset_format)
    encoded = stream.map(Encoder("train", tokenizer, data_args, dataset_format), with_indices=True,
                         remove_columns=sample.column_names)
    train = encoded.filter(lambda drop: drop == "", input_columns="drop").remove_columns(ENCODER_RECORDS)
    if data_args.packing:
        train = pack_dataset(train.select_columns(["input_ids", "labels"]), data_args.max_seq_length,
                             data_args.packing_strategy)
    evaluation, eval_summary, examples = None, None, []
    eval_rows = _eval_rows(data_args, args.world_size)
    if eval_rows is not None:
        evaluation, eval_summary = _tokenize_split(eval_rows, "eval", tokenizer, data_args, dataset_format)
        if data_args.packing:
            from finetune.data.collate import pack_examples

            evaluation = pack_examples(evaluation, data_args.max_seq_length, data_args.packing_strategy)
        examples = generation_examples(eval_rows, dataset_format, data_args.generation_eval_samples)
    summary = {
        "sources": [{"name": name, "format": dataset_format, "train": {**sampled, "sampled_from_stream": True},
                     "eval": eval_summary}],
        "weights": None, "train_rows": None, "eval_rows": len(evaluation) if evaluation is not None else 0,
        "streaming": {"sampled_rows": len(sample), "split": data_args.dataset_split,
                      "packing": f"{data_args.packing_strategy}, per batch of 1,000 examples" if data_args.packing
                      else None},
        # what a checkpoint records of the data: the stream's source and everything that shapes its rows
        "train_fingerprint": f"stream of {name}, key {key_digest(cache_key(data_args, tokenizer, args.seed))}",
    }
    return PreparedData(train, evaluation, examples, summary)


def _eval_rows(data_args, world_size: int) -> Dataset | None:
    limit = data_args.max_eval_samples or EVAL_ROWS
    if data_args.eval_file is not None:
        from finetune.data.loading import _load_file

        rows = _load_file(data_args.eval_file, "eval_file")
        return rows.select(range(min(limit, len(rows))))
    if data_args.eval_split is None or data_args.eval_split.lower() == "none":
        return None
    return _first_rows(open_stream(data_args, data_args.eval_split, world_size), limit, f"split {data_args.eval_split}")
