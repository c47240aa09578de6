"""Data at real size: packing against `trl.pack_dataset` alone, and tokenizing with and without `dataset_num_proc`.

    python benchmarks/data_at_scale.py pack [--examples 200000] [--row-length 2048] [--repeats 3]
    python benchmarks/data_at_scale.py tokenize [--conversations 200000] [--num-proc 2]

`pack`: tokenized-looking rows (`input_ids`, `attention_mask`, `labels`, log-normal lengths like instruction data,
median ~250 tokens, a tail to the row length), saved and memory-mapped as a tokenizing `map` leaves them. Times,
interleaved, the median of `--repeats`:
- `trl.pack_dataset(ds, row_length, "bfd")` as TRL's SFTTrainer calls it (best fit within each `map` batch of 1,000),
- the same over the whole dataset in one batch (one best-fit-decreasing binning of every example),
- finetune's `pack_prepared`, which packs the whole dataset with TRL's function and adds its checks and summary
  (columns kept, rows, fill),
and prints rows, fill and each time over TRL's whole-dataset call (the same fill).

`tokenize`: conversations through finetune's tokenizing (chat template, learned spans verified, length policies,
summary) with the embedded tokenizer, once in one process and once with `dataset_num_proc`.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import tempfile
import time

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from datasets import Dataset, disable_caching, load_from_disk
from trl.data_utils import pack_dataset

from finetune.data.collate import pack_prepared
from finetune.data.tokenize import IGNORE_INDEX, PreparedData, _tokenize_split


def tokenized_like(examples: int, row_length: int, seed: int = 0) -> Dataset:
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(mean=5.5, sigma=0.8, size=examples), 8, row_length).astype(np.int32)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    ids = rng.integers(0, 32_000, size=int(offsets[-1]), dtype=np.int32)
    labels = ids.copy()
    labels[offsets[:-1]] = IGNORE_INDEX
    column = lambda values: pa.ListArray.from_arrays(pa.array(offsets), pa.array(values))  # noqa: E731
    table = pa.table({"input_ids": column(ids), "attention_mask": column(np.ones_like(ids, dtype=np.int8)),
                      "labels": column(labels)})
    return Dataset(table)


def fill(rows: Dataset, row_length: int) -> float:
    lengths = pc.list_value_length(rows.with_format("arrow")["input_ids"])
    return pc.sum(lengths).as_py() / (len(rows) * row_length)


def pack(args) -> None:
    disable_caching()  # every repeat packs: none reads the cache file an earlier one wrote
    with tempfile.TemporaryDirectory() as directory:
        tokenized_like(args.examples, args.row_length).save_to_disk(os.path.join(directory, "tokenized"))
        dataset = load_from_disk(os.path.join(directory, "tokenized"))  # memory-mapped, as `map` leaves it
        tokens = pc.sum(pc.list_value_length(dataset.with_format("arrow")["input_ids"])).as_py()
        ways = {
            "trl.pack_dataset, map batches of 1,000": lambda: pack_dataset(dataset, args.row_length, "bfd"),
            "trl.pack_dataset, whole dataset": lambda: pack_dataset(
                dataset, args.row_length, "bfd", map_kwargs={"batch_size": len(dataset)}),
            "finetune pack_prepared (TRL + checks, summary)": lambda: pack_prepared(
                PreparedData(dataset, None, [], {}), args.row_length).train,
        }
        seconds = {name: [] for name in ways}
        rows = {}
        for _ in range(args.repeats):
            for name, way in ways.items():
                started = time.perf_counter()
                rows[name] = way()
                seconds[name].append(time.perf_counter() - started)
        print(f"device: CPU, {os.cpu_count()} cores; {len(dataset):,} examples, {tokens:,} tokens, rows of "
              f"{args.row_length}; median of {args.repeats}, interleaved")
        reference = statistics.median(seconds["trl.pack_dataset, whole dataset"])
        for name in ways:
            median = statistics.median(seconds[name])
            filled = fill(rows[name], args.row_length)
            print(f"{name:>48}: {median:7.2f} s  rows {len(rows[name]):>7,}  fill {filled:.2%}"
                  f"  × TRL whole-dataset time {median / reference:.2f}")


def conversations(count: int, seed: int = 0) -> Dataset:
    rng = random.Random(seed)
    words = ("the model learns to answer each question with care and a short clear reason while the data "
             "holds many turns of different length").split()
    rows = []
    for _ in range(count):
        messages = [{"role": "system", "content": "You are a helpful assistant."}] if rng.random() < 0.3 else []
        for _ in range(rng.choice((1, 1, 2, 3))):
            messages.append({"role": "user", "content": " ".join(rng.choices(words, k=rng.randint(5, 80)))})
            messages.append({"role": "assistant", "content": " ".join(rng.choices(words, k=rng.randint(5, 160)))})
        rows.append({"messages": messages})
    return Dataset.from_list(rows)


def tokenize(args) -> None:
    from finetune import presets
    from finetune.recipe.args import DataArguments

    disable_caching()  # both runs tokenize; neither reads the other's cache
    tokenizer = presets.build_tokenizer()
    data = conversations(args.conversations)
    seconds = {}
    for num_proc in (None, args.num_proc):
        data_args = DataArguments(max_seq_length=2048, dataset_num_proc=num_proc)
        started = time.perf_counter()
        _, summary = _tokenize_split(data, "train", tokenizer, data_args, "messages")
        seconds[num_proc] = time.perf_counter() - started
    print(f"device: CPU, {os.cpu_count()} cores; {len(data):,} conversations, {summary['tokens']:,} tokens, "
          f"{summary['labelled_tokens']:,} learned; embedded tokenizer and chat template")
    for num_proc, took in seconds.items():
        print(f"dataset_num_proc {num_proc or 1}: {took:7.1f} s  {len(data) / took:8,.0f} conversations/s  "
              f"× one process {seconds[None] / took:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parts = parser.add_subparsers(dest="part", required=True)
    packing = parts.add_parser("pack")
    packing.add_argument("--examples", type=int, default=200_000)
    packing.add_argument("--row-length", type=int, default=2048)
    packing.add_argument("--repeats", type=int, default=3)
    tokenizing = parts.add_parser("tokenize")
    tokenizing.add_argument("--conversations", type=int, default=200_000)
    tokenizing.add_argument("--num-proc", type=int, default=2)
    args = parser.parse_args()
    pack(args) if args.part == "pack" else tokenize(args)


if __name__ == "__main__":
    main()
