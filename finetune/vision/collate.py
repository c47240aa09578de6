"""Batches of conversations with images: each row encoded through the processor as the batch is built
(finetune.vision.encode), as TRL's vision-language collator does, so no pixels are stored with the dataset; token
columns padded to the batch's longest row, image inputs concatenated in row order."""

from __future__ import annotations

import torch

from finetune.data.tokenize import IGNORE_INDEX
from finetune.vision.encode import encode_vision_conversation

TOKEN_COLUMNS = {"input_ids": None, "labels": IGNORE_INDEX, "mm_token_type_ids": 0, "token_type_ids": 0}


class VisionCollator:
    """Rows of `messages` and `images` (RGB PIL images, or what finetune.vision.data.read_image reads) → the model's
    batch: `input_ids`, `attention_mask`, `labels`, and the image inputs the processor returns."""

    def __init__(self, processor, pad_to_multiple_of: int | None = None):
        self.processor = processor
        self.pad_id = processor.tokenizer.pad_token_id
        self.pad_to_multiple_of = pad_to_multiple_of

    def __call__(self, rows: list[dict]) -> dict:
        from finetune.vision.data import read_image

        encoded = [encode_vision_conversation(row["messages"], [read_image(image) for image in row["images"] or []],
                                              self.processor) for row in rows]
        longest = max(len(row["input_ids"]) for row in encoded)
        if self.pad_to_multiple_of:
            longest = -(-longest // self.pad_to_multiple_of) * self.pad_to_multiple_of
        batch = {}
        for name, fill in TOKEN_COLUMNS.items():
            if name in encoded[0]:
                fill = self.pad_id if fill is None else fill
                batch[name] = torch.tensor([row[name] + [fill] * (longest - len(row[name])) for row in encoded])
        batch["attention_mask"] = torch.tensor([[1] * len(row["input_ids"]) + [0] * (longest - len(row["input_ids"]))
                                                for row in encoded])
        for name in encoded[0]:
            if name not in TOKEN_COLUMNS:
                values = [torch.as_tensor(row[name]) for row in encoded if row.get(name) is not None]
                if values:
                    batch[name] = torch.cat(values)
        return batch
