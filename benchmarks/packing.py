"""Packing vs padding to the longest example: non-pad token fraction and useful tokens/s.

    python benchmarks/packing.py [--examples 640] [--micro-batch 16] [--row-length 512] [--repeats 3]

Trains the tiny model with Trainer for one epoch over the same long-tailed lengths (log-normal, like
instruction data: median ~55 tokens, a tail to 512) three ways, interleaved: padded micro-batches of
`--micro-batch` examples; packed rows of `--row-length` tokens (as many rows per micro-batch as hold about
the same tokens); padding-free micro-batches of `--micro-batch` examples flattened into one row. Prints the
three side by side with ratios over padded.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import numpy as np
import torch
from datasets import Dataset
from transformers import Trainer, TrainingArguments

from finetune import presets
from finetune.data.collate import data_collator, pack_examples, prepare_model_for_packing
from finetune.data.tokenize import IGNORE_INDEX


def long_tailed_examples(count: int, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(mean=4.0, sigma=0.8, size=count), 8, 512).astype(int)
    examples = []
    for length in lengths:
        ids = rng.integers(0, 250, size=length).tolist()
        prompt = length // 2  # the first half is the prompt: no labels
        examples.append({"input_ids": ids, "attention_mask": [1] * length,
                         "labels": [IGNORE_INDEX] * prompt + ids[prompt:]})
    return examples


MODES = ("padded", "packed", "padding-free")


def datasets_and_micro_batch(examples, mode: str, micro_batch: int, row_length: int):
    if mode != "packed":
        return examples, micro_batch
    rows = pack_examples(Dataset.from_list(examples), row_length)
    mean = sum(len(e["input_ids"]) for e in examples) / len(examples)
    return [rows[i] for i in range(len(rows))], max(1, round(micro_batch * mean / row_length))


def non_pad_fraction(examples, mode: str, micro_batch: int, row_length: int, tokenizer) -> float:
    data, micro = datasets_and_micro_batch(examples, mode, micro_batch, row_length)
    collate = data_collator(tokenizer, packing=mode == "packed", padding_free=mode == "padding-free")
    total = sum(collate([dict(e) for e in data[start:start + micro]])["input_ids"].numel()
                for start in range(0, len(data), micro))
    return sum(len(e["input_ids"]) for e in examples) / total


def useful_tokens_per_second(examples, mode: str, micro_batch: int, row_length: int, tokenizer) -> float:
    data, micro = datasets_and_micro_batch(examples, mode, micro_batch, row_length)
    model = presets.build_model(tokenizer, seed=0)
    if mode != "padded":
        prepare_model_for_packing(model)
    with tempfile.TemporaryDirectory() as output_dir:
        args = TrainingArguments(output_dir, per_device_train_batch_size=micro, num_train_epochs=1, report_to=[],
                                 save_strategy="no", logging_steps=10_000, disable_tqdm=True, use_cpu=True, seed=0)
        trainer = Trainer(model=model, args=args, train_dataset=data,
                          data_collator=data_collator(tokenizer, mode == "packed", mode == "padding-free"))
        start = time.perf_counter()
        trainer.train()
        elapsed = time.perf_counter() - start
    return sum(len(e["input_ids"]) for e in examples) / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=640)
    parser.add_argument("--micro-batch", type=int, default=16)
    parser.add_argument("--row-length", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.manual_seed(0)
    tokenizer = presets.build_tokenizer()
    examples = long_tailed_examples(args.examples)
    lengths = np.array([len(e["input_ids"]) for e in examples])
    speed = {mode: [] for mode in MODES}
    for _ in range(args.repeats):
        for mode in MODES:
            speed[mode].append(useful_tokens_per_second(examples, mode, args.micro_batch, args.row_length, tokenizer))
    print(f"device: CPU ({torch.get_num_threads()} threads); tiny model; {len(examples)} examples, lengths "
          f"p50 {np.percentile(lengths, 50):.0f} / p90 {np.percentile(lengths, 90):.0f} / max {lengths.max()}; "
          f"micro-batch {args.micro_batch} examples (packed: rows of {args.row_length}); one epoch; "
          f"median of {args.repeats}")
    padded = statistics.median(speed["padded"])
    for mode in MODES:
        fraction = non_pad_fraction(examples, mode, args.micro_batch, args.row_length, tokenizer)
        rate = statistics.median(speed[mode])
        print(f"{mode:>12}: non-pad {fraction:6.1%}   useful tokens/s {rate:8,.0f}   vs padded {rate / padded:.2f}x")


if __name__ == "__main__":
    main()
