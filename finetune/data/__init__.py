"""Data: load raw examples, turn them into chat messages or text, tokenize with completion-only labels,
summarize, and collate (padded or padding-free packed)."""

from finetune.data.formats import detect_format, to_messages
from finetune.data.loading import load_raw_data, load_raw_splits
from finetune.data.tokenize import encode_example, encode_messages, prepare_datasets

__all__ = ["detect_format", "encode_example", "encode_messages", "load_raw_data", "load_raw_splits",
           "prepare_datasets", "to_messages"]
