"""Batches of rows with images: the tokens the data pipeline encoded (finetune.data.vision.pipeline), padded to the
batch's longest row, and the pixels of the rows' images, computed here by the processor's image processor (none are
stored with the dataset), concatenated in row order with its extra inputs (Qwen2-VL's `image_grid_thw`)."""

from __future__ import annotations

import torch

from finetune.data.tokenize import IGNORE_INDEX
from finetune.data.vision.pipeline import TOKEN_COLUMNS


class VisionCollator:
    """Rows of `input_ids`, `labels` (and a processor's token-aligned columns) with `images` (as stored:
    finetune.data.vision.data.stored_image, or PIL images) → the model's batch."""

    def __init__(self, processor, pad_to_multiple_of: int | None = None):
        self.processor = processor
        self.pad_id = processor.tokenizer.pad_token_id
        self.pad_to_multiple_of = pad_to_multiple_of

    def __call__(self, rows: list[dict]) -> dict:
        from finetune.data.vision.data import read_image

        longest = max(len(row["input_ids"]) for row in rows)
        if self.pad_to_multiple_of:
            longest = -(-longest // self.pad_to_multiple_of) * self.pad_to_multiple_of
        fills = {"input_ids": self.pad_id, "labels": IGNORE_INDEX, **TOKEN_COLUMNS}
        batch = {name: torch.tensor([list(row[name]) + [fill] * (longest - len(row[name])) for row in rows])
                 for name, fill in fills.items() if name in rows[0]}
        batch["attention_mask"] = torch.tensor([[1] * len(row["input_ids"]) + [0] * (longest - len(row["input_ids"]))
                                                for row in rows])
        images = [read_image(image) for row in rows for image in row.get("images") or []]
        if images:
            batch.update(self.processor.image_processor(images=images, return_tensors="pt"))
        return batch
