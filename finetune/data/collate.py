"""Batching: padded to the longest example, packed rows, or padding-free flattened micro-batches.

- `packing: true` packs tokenized examples into rows of at most `max_seq_length` tokens with TRL's
  `pack_dataset` (Arrow-native best-fit decreasing over the whole dataset; `packing_strategy: bfd_split` cuts
  over-long examples into row-long pieces instead of truncating them). A row keeps TRL's `seq_lengths`; the
  collators turn them into `position_ids` restarting at 0 for each example and -100 as each example's first label,
  so no token is predicted across a boundary. Rows of a micro-batch are evened out with a filler segment (its own
  positions, no labels), never with an attention mask.
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

from dataclasses import replace

import numpy as np
import pyarrow.compute as pc
import torch
from datasets import Dataset
from transformers import DataCollatorForSeq2Seq, DataCollatorWithFlattening
from transformers.utils.generic import is_flash_attention_requested
from trl.data_utils import pack_dataset

from finetune.data.tokenize import IGNORE_INDEX
from finetune.errors import RecipeError

# Attention implementations that Transformers gives per-example masks or sequence lengths for packed rows.
PACKING_ATTENTION = ("sdpa", "eager", "flash_attention_2", "flash_attention_3", "flex_attention")


# Packing strategies of `trl.pack_dataset` a recipe may ask for (`packing_strategy`): `bfd` keeps every example whole
# (SFT); `bfd_split` cuts an example longer than a row into row-long pieces that are packed like examples
# (continued pre-training: no token lost). TRL's `wrapped` cuts every example anywhere and is not offered.
PACKING_STRATEGIES = ("bfd", "bfd_split")
PACKED_COLUMNS = ("input_ids", "labels")


def pack_examples(dataset: Dataset, max_length: int, strategy: str = "bfd") -> Dataset:
    """Rows of at most `max_length` tokens: `trl.pack_dataset` over the WHOLE dataset in one Arrow batch (one
    best-fit-decreasing binning of every example, not one per thousand), keeping `input_ids` and `labels` and TRL's
    per-row `seq_lengths`, from which the collators build per-example `position_ids` and the boundary labels."""
    if strategy not in PACKING_STRATEGIES:
        raise RecipeError(f"`packing_strategy: {strategy}` is not one of {', '.join(PACKING_STRATEGIES)}.")
    dataset = dataset.select_columns(list(PACKED_COLUMNS))
    return pack_dataset(dataset, max_length, strategy,
                        map_kwargs={"batch_size": max(len(dataset), 1), "desc": f"packing ({strategy})"})


def packing_summary(examples: int, rows: Dataset, max_length: int) -> dict:
    """Examples in, rows out and how full the rows are, counted from the Arrow column (no Python lists)."""
    lengths = rows.with_format("arrow")["seq_lengths"]
    tokens = pc.sum(pc.list_flatten(lengths)).as_py() or 0
    return {"examples": examples, "rows": len(rows), "row_length": max_length,
            "fill": round(tokens / (len(rows) * max_length), 4) if len(rows) else 0.0}


def pack_prepared(data, max_length: int, strategy: str = "bfd"):
    """The prepared data with train and eval packed into rows; the summary notes rows and fill."""
    packed = {"train": pack_examples(data.train, max_length, strategy)}
    if data.eval is not None:
        packed["eval"] = pack_examples(data.eval, max_length, strategy)
    for split, rows in packed.items():
        data.summary.setdefault("packing", {})[split] = {
            **packing_summary(len(getattr(data, split)), rows, max_length), "strategy": strategy}
    return replace(data, train=packed["train"], eval=packed.get("eval", data.eval))


def row_segments(seq_lengths) -> list[tuple[int, int]]:
    """`[start, end)` of each example (or piece of one) in a packed row, from its `seq_lengths`."""
    ends = np.cumsum(seq_lengths).tolist()
    return list(zip([0] + ends[:-1], ends))


def _unpacked(feature: dict) -> tuple[list[int], list[int], list[int]]:
    """A packed row's `input_ids`, its labels with -100 at every example's first token (no token is predicted
    across a boundary, whatever made the row) and `position_ids` restarting at 0 for each example."""
    labels = list(feature["labels"])
    positions = []
    for start, end in row_segments(feature["seq_lengths"]):
        labels[start] = IGNORE_INDEX
        positions += range(end - start)
    return list(feature["input_ids"]), labels, positions


class PackedRowsCollator:
    """Stacks packed rows; a shorter row gets a filler segment (pad tokens, positions from 0, no labels)."""

    def __init__(self, pad_token_id: int):
        self.pad_token_id = pad_token_id

    def __call__(self, features: list[dict]) -> dict[str, torch.Tensor]:
        longest = max(len(feature["input_ids"]) for feature in features)
        batch = {"input_ids": [], "labels": [], "position_ids": []}
        for feature in features:
            input_ids, labels, positions = _unpacked(feature)
            fill = longest - len(input_ids)
            batch["input_ids"].append(input_ids + [self.pad_token_id] * fill)
            batch["labels"].append(labels + [IGNORE_INDEX] * fill)
            batch["position_ids"].append(positions + list(range(fill)))
        return {key: torch.tensor(value, dtype=torch.long) for key, value in batch.items()}


class FlattenedRowsCollator:
    """Concatenates the packed rows of a micro-batch into one row, for flash attention (see module doc): no filler,
    `position_ids` restarting at each example, and -100 as the first label of every example."""

    def __call__(self, features: list[dict]) -> dict[str, torch.Tensor]:
        batch = {"input_ids": [], "labels": [], "position_ids": []}
        for feature in features:
            input_ids, labels, positions = _unpacked(feature)
            batch["input_ids"] += input_ids
            batch["labels"] += labels
            batch["position_ids"] += positions
        return {key: torch.tensor([value], dtype=torch.long) for key, value in batch.items()}


class SequenceShardedCollator:
    """Batches DeepSpeed Ulysses can cut along the sequence over `ranks` processes (sequence parallelism): every row
    carries `position_ids` (each token keeps its place in the whole sequence after the cut; Ulysses masks causally
    from them, not from an attention mask), and the length is a multiple of `ranks`, filled with pad tokens that come
    after every real token, have no labels and continue the positions. With `length`, every batch is filled to that
    length (rounded up to a multiple of `ranks`): over gloo (CPU processes) Ulysses gathers the ranks' batches with
    an all-gather that takes tensors of one shape only."""

    def __init__(self, collator, ranks: int, pad_token_id: int, length: int | None = None):
        self.collator, self.ranks, self.pad_token_id = collator, ranks, pad_token_id
        self.length = None if length is None else -(-length // ranks) * ranks

    def __call__(self, features: list[dict]) -> dict[str, torch.Tensor]:
        batch = dict(self.collator(features))
        rows, length = batch["input_ids"].shape
        if "position_ids" not in batch:
            batch["position_ids"] = torch.arange(length).repeat(rows, 1)
        fill = -length % self.ranks if self.length is None else max(self.length - length, 0)
        if fill:
            filler = {"input_ids": self.pad_token_id, "labels": IGNORE_INDEX}
            for key, tensor in batch.items():
                if not torch.is_tensor(tensor) or tensor.dim() != 2 or tensor.shape[1] != length:
                    continue
                if key == "position_ids":
                    extra = tensor[:, -1:] + torch.arange(1, fill + 1)
                else:
                    extra = torch.full((rows, fill), filler.get(key, 0), dtype=tensor.dtype)
                batch[key] = torch.cat([tensor, extra], dim=1)
        return batch


def attention_implementation(model) -> str | None:
    """The attention the model runs (what Transformers dispatches on: `config._attn_implementation`)."""
    return getattr(getattr(model, "config", None), "_attn_implementation", None)


def data_collator(tokenizer, packing: bool = False, padding_free: bool = False, model=None):
    """The collator for the batching asked for; with `packing`, `model`'s attention decides the layout: several
    rows for sdpa/eager/flex, one flattened row for flash attention (module doc). Without `model`, rows. (A
    parallelism axis may wrap it: finetune.axes, `Axis.collator`.)"""
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
