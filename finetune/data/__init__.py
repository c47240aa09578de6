"""Data: load raw examples, turn them into chat messages, tokenize with completion-only labels."""

from finetune.data.formats import detect_format, to_messages
from finetune.data.loading import load_raw_splits
from finetune.data.tokenize import encode_messages, prepare_datasets

__all__ = ["detect_format", "encode_messages", "load_raw_splits", "prepare_datasets", "to_messages"]
