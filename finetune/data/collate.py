"""Batching: padded to the longest example, packed rows, or padding-free flattened micro-batches.

- `packing: true` packs tokenized examples into rows of at most `max_seq_length` tokens by best-fit
  decreasing (the strategy TRL calls "bfd"): `position_ids` restart at 0 for each example and the first label
  of each example is -100, so no token is predicted across a boundary. Rows of a micro-batch are evened out
  with a filler segment (its own positions, no labels), never with an attention mask.
- `padding_free: true` flattens each micro-batch into one row (Transformers' `DataCollatorWithFlattening`).

Transformers turns restarting `position_ids` into per-example attention (`masking_utils`'
`find_packed_sequence_indices` for sdpa/eager/flex, per row; sequence lengths for flash attention), so no custom
attention path is needed, with two traps:
- it reads packing from `position_ids` only when no KV cache is passed, and with the config's default
  `use_cache: true` the model builds one even in training, so packed examples would silently attend to each other
  (measured on the tiny model: logits off by 0.95 instead of 4e-7). `prepare_model_for_packing` turns the
  training-time cache off.
- flash attention derives sequence lengths from `position_ids` only for a batch of ONE row (`_is_packed_sequence`
  in transformers/modeling_flash_attention_utils.py: `batch_size != 1` → not packed), so a micro-batch of several
  packed rows would run plain causal attention across the examples of each row. Under any flash kind (flash
  attention 2/3 and kernels-hub flash variants, `is_flash_attention_requested`) the packed rows of a micro-batch
  are therefore concatenated into one row (`FlattenedRowsCollator`), as `padding_free` already does.
"""

from __future__ import annotations

import bisect
from dataclasses import replace

import torch
from datasets import Dataset
from transformers import DataCollatorForSeq2Seq, DataCollatorWithFlattening
from transformers.utils.generic import is_flash_attention_requested

from finetune.data.tokenize import IGNORE_INDEX
from finetune.errors import RecipeError

# Attention implementations that Transformers gives per-example masks or sequence lengths for packed rows.
PACKING_ATTENTION = ("sdpa", "eager", "flash_attention_2", "flash_attention_3", "flex_attention")


def best_fit_decreasing(lengths: list[int], capacity: int) -> list[list[int]]:
    """Indices grouped into bins of total length ≤ capacity: longest first, each into the fullest bin it fits."""
    bins: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (free space, bin index), sorted
    for index in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        length = lengths[index]
        at = bisect.bisect_left(free, (length, -1))
        if at == len(free):
            bins.append([index])
            bisect.insort(free, (capacity - length, len(bins) - 1))
            continue
        space, target = free.pop(at)
        bins[target].append(index)
        bisect.insort(free, (space - length, target))
    return bins


def pack_examples(dataset: Dataset, max_length: int) -> Dataset:
    """Rows of whole examples, at most `max_length` tokens each, with per-example `position_ids`."""
    input_ids, labels = dataset["input_ids"], dataset["labels"]
    rows = {"input_ids": [], "labels": [], "position_ids": []}
    for members in best_fit_decreasing([len(ids) for ids in input_ids], max_length):
        row_ids, row_labels, row_positions = [], [], []
        for index in members:
            row_ids += input_ids[index]
            row_labels += [IGNORE_INDEX] + labels[index][1:]  # never predict across a boundary
            row_positions += list(range(len(input_ids[index])))
        rows["input_ids"].append(row_ids)
        rows["labels"].append(row_labels)
        rows["position_ids"].append(row_positions)
    return Dataset.from_dict(rows)


def pack_prepared(data, max_length: int):
    """The prepared data with train and eval packed into rows; the summary notes rows and fill."""
    packed = {"train": pack_examples(data.train, max_length)}
    if data.eval is not None:
        packed["eval"] = pack_examples(data.eval, max_length)
    for split, rows in packed.items():
        tokens = sum(len(ids) for ids in rows["input_ids"])
        data.summary.setdefault("packing", {})[split] = {
            "examples": len(getattr(data, split)), "rows": len(rows), "row_length": max_length,
            "fill": round(tokens / (len(rows) * max_length), 4),
        }
    return replace(data, train=packed["train"], eval=packed.get("eval", data.eval))


class PackedRowsCollator:
    """Stacks packed rows; a shorter row gets a filler segment (pad tokens, positions from 0, no labels)."""

    def __init__(self, pad_token_id: int):
        self.pad_token_id = pad_token_id

    def __call__(self, features: list[dict]) -> dict[str, torch.Tensor]:
        longest = max(len(feature["input_ids"]) for feature in features)
        batch = {"input_ids": [], "labels": [], "position_ids": []}
        for feature in features:
            fill = longest - len(feature["input_ids"])
            batch["input_ids"].append(list(feature["input_ids"]) + [self.pad_token_id] * fill)
            batch["labels"].append(list(feature["labels"]) + [IGNORE_INDEX] * fill)
            batch["position_ids"].append(list(feature["position_ids"]) + list(range(fill)))
        return {key: torch.tensor(value, dtype=torch.long) for key, value in batch.items()}


class FlattenedRowsCollator:
    """Concatenates the packed rows of a micro-batch into one row, for flash attention (see module doc): no filler,
    `position_ids` restarting at each example as packed, and -100 as the first label of every row, as `pack_examples`
    puts at every example's start, so no token is predicted across a boundary whatever made the rows."""

    def __call__(self, features: list[dict]) -> dict[str, torch.Tensor]:
        batch = {"input_ids": [], "labels": [], "position_ids": []}
        for feature in features:
            batch["input_ids"] += list(feature["input_ids"])
            batch["labels"] += [IGNORE_INDEX] + list(feature["labels"])[1:]
            batch["position_ids"] += list(feature["position_ids"])
        return {key: torch.tensor([value], dtype=torch.long) for key, value in batch.items()}


def attention_implementation(model) -> str | None:
    """The attention the model runs (what Transformers dispatches on: `config._attn_implementation`)."""
    return getattr(getattr(model, "config", None), "_attn_implementation", None)


def data_collator(tokenizer, packing: bool = False, padding_free: bool = False, model=None):
    """The collator for the batching asked for; with `packing`, `model`'s attention decides the layout: several
    rows for sdpa/eager/flex, one flattened row for flash attention (module doc). Without `model`, rows."""
    if packing:
        if is_flash_attention_requested(requested_attention_implementation=attention_implementation(model)):
            return FlattenedRowsCollator()
        return PackedRowsCollator(tokenizer.pad_token_id)
    if padding_free:
        return DataCollatorWithFlattening(separator_id=IGNORE_INDEX)
    return DataCollatorForSeq2Seq(tokenizer, padding=True, label_pad_token_id=IGNORE_INDEX)


def prepare_model_for_packing(model) -> None:
    """Makes packed rows safe: no training-time KV cache (see module doc) and an attention that isolates examples."""
    attention = attention_implementation(model)
    if attention not in PACKING_ATTENTION and not is_flash_attention_requested(
            requested_attention_implementation=attention):  # kernels-hub flash variants: varlen from position_ids
        raise RecipeError(f"packing needs an attention implementation that keeps packed examples apart "
                          f"({', '.join(PACKING_ATTENTION)} or a flash kernel); this model uses {attention}: set "
                          "`attn_implementation: sdpa`.")
    model.config.use_cache = False
