"""Rows with images through the data pipeline `finetune train`, `finetune plan --recipe` and `finetune preprocess`
share (finetune.data.tokenize.prepare_datasets): each row read in the peers' formats (finetune.data.vision.data),
rendered and tokenized by the model's processor with labels on the assistant's tokens only
(finetune.data.vision.encode), under the recipe's length policies, and kept as its tokens and its images (a file by
its path, anything else by its bytes): the pixels are computed as each batch is built (finetune.data.vision.collate),
so none are stored with the dataset.

A row is never cut inside its image tokens: the model needs every token of an image for its features. A row whose
images end past `max_seq_length` is dropped under `overlong_policy: truncate` or `drop` (counted as overlong) and
refused under `error`.
"""

from __future__ import annotations

from pathlib import Path

from finetune.data.tokenize import IGNORE_INDEX, apply_length_policies
from finetune.data.vision.data import vision_row
from finetune.data.vision.encode import encode_vision_conversation, image_token_ids
from finetune.errors import RecipeError

# The token-aligned columns a processor may return beside `input_ids` (Qwen2-VL's `mm_token_type_ids`), with the
# value that pads them
TOKEN_COLUMNS = {"mm_token_type_ids": 0, "token_type_ids": 0}


def data_dir_of(source_name: str | None) -> Path | None:
    """The folder image paths are relative to: the data file's (a `train_file`, a mixture entry's file)."""
    if source_name and Path(source_name).expanduser().is_file():
        return Path(source_name).expanduser().resolve().parent
    if source_name and Path(source_name).expanduser().is_dir():
        return Path(source_name).expanduser().resolve()
    return None


class VisionEncoder:
    """One row with images (and its index) → its tokens, labels, images as stored, the length before the policies
    and why it is dropped: the text path's `Encoder` records (finetune.data.tokenize), for `datasets.map`."""

    def __init__(self, name: str, processor, data_args, data_dir: Path | None):
        self.name, self.processor, self.data_args, self.data_dir = name, processor, data_args, data_dir
        self.image_ids = image_token_ids(processor)  # the image tokens and the vision markers around them

    def __call__(self, example: dict, index: int) -> dict:
        where = f"{self.name} example {index + 1}"
        messages, images, stored = vision_row(example, where, self.data_dir)
        try:
            encoded = encode_vision_conversation(messages, images, self.processor)
        except RecipeError as error:
            raise RecipeError(f"{where}: {error}") from None
        input_ids, labels = encoded["input_ids"], encoded["labels"]
        length, limit = len(input_ids), self.data_args.max_seq_length
        last_image = max((position for position, token in enumerate(input_ids) if token in self.image_ids),
                         default=-1)
        if last_image >= limit:  # cutting would split an image: never trained
            if self.data_args.overlong_policy == "error":
                raise RecipeError(f"{where} has {length} tokens, its images ending at token {last_image + 1}, more "
                                  f"than `max_seq_length: {limit}` (`overlong_policy: error`): raise max_seq_length, "
                                  "or lower `max_pixels` so each image takes fewer tokens.")
            return self._record([], [], {}, stored, length, "overlong", 0)
        input_ids, labels, drop = apply_length_policies(input_ids, labels, self.data_args, where)
        extra = {name: encoded[name][: len(input_ids)] for name in TOKEN_COLUMNS if name in encoded}
        image_tokens = sum(token == self.processor.image_token_id for token in input_ids)
        return self._record(input_ids, labels, extra, stored, length, drop, image_tokens)

    @staticmethod
    def _record(input_ids, labels, extra, stored, length, drop, image_tokens) -> dict:
        return {"input_ids": input_ids, "attention_mask": [1] * len(input_ids), "labels": labels, **extra,
                "images": stored, "original_length": length, "drop": drop,
                "labelled": sum(label != IGNORE_INDEX for label in labels), "image_tokens": image_tokens}


def vision_generation_examples(split, data_dir: Path | None, limit: int) -> list[dict]:
    """The first `limit` eval rows cut before their last assistant turn, with their images, for exact-match
    generation: `{"prompt", "images", "reference", "task"}`."""
    from finetune.data.vision.encode import answer_text, image_parts

    examples = []
    for index, example in enumerate(split):
        if len(examples) >= limit:
            break
        messages, images, _ = vision_row(example, f"eval example {index + 1}", data_dir)
        answers = [i for i, message in enumerate(messages) if message["role"] == "assistant"]
        if not answers:
            continue
        prompt = messages[: answers[-1]]
        examples.append({"prompt": prompt, "images": images[: image_parts(prompt)],
                         "reference": answer_text(messages[answers[-1]]), "task": example.get("task") or "all"})
    return examples


def check_vision_data_options(data_args) -> None:
    """What the text path offers and a row with images cannot take, refused by name before anything is read."""
    if data_args.packing or data_args.padding_free:
        key = "packing" if data_args.packing else "padding_free"
        raise RecipeError(f"`{key}: true` with a vision-language model: its multimodal rotary positions (Qwen2-VL's "
                          "M-RoPE) are computed per row from the image grid, which packed rows would mix; drop "
                          f"`{key}`.")
    if data_args.streaming:
        raise RecipeError("`streaming: true` with a vision-language model: rows with images are read whole (their "
                          "image files beside the data); drop `streaming`.")
