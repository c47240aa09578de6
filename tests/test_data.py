import json

import pytest
from datasets import Dataset, DatasetDict

from finetune import presets
from finetune.args import DataArguments
from finetune.data import detect_format, encode_messages, load_raw_splits, to_messages
from finetune.data.tokenize import IGNORE_INDEX, _tokenize_split
from finetune.errors import RecipeError


@pytest.fixture(scope="module")
def tokenizer():
    return presets.build_tokenizer()


def labelled_text(tokenizer, encoded):
    return tokenizer.decode([t for t, label in zip(encoded["input_ids"], encoded["labels"]) if label != IGNORE_INDEX])


def test_only_the_answer_and_its_end_token_carry_labels(tokenizer):
    messages = to_messages({"instruction": "reverse", "input": "abc", "output": "cba"}, "alpaca")
    encoded = encode_messages(messages, tokenizer, max_seq_length=64)
    prompt_length = len(tokenizer("<|user|>reverse\n\nabc<|end|><|assistant|>", add_special_tokens=False)["input_ids"])
    assert encoded["labels"][:prompt_length] == [IGNORE_INDEX] * prompt_length
    assert encoded["labels"][prompt_length:] == encoded["input_ids"][prompt_length:]
    assert labelled_text(tokenizer, encoded) == "cba<|end|>"
    assert encoded["attention_mask"] == [1] * len(encoded["input_ids"])


def test_every_assistant_turn_is_labelled_in_a_multi_turn_conversation(tokenizer):
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "yo"},
        {"role": "user", "content": "again"},
        {"role": "assistant", "content": "ok"},
    ]
    encoded = encode_messages(messages, tokenizer, max_seq_length=128)
    tokens = [tokenizer.decode([t]) for t in encoded["input_ids"]]
    labelled = [tokens[i] for i, label in enumerate(encoded["labels"]) if label != IGNORE_INDEX]
    assert labelled == ["y", "o", "<|end|>", "o", "k", "<|end|>"]


def test_truncation_that_removes_every_answer_token_drops_the_example(tokenizer):
    split = Dataset.from_list([
        {"instruction": "reverse", "input": "abcdefghij", "output": "jihgfedcba"},
        {"instruction": "add", "input": "", "output": "7"},
    ])
    kept, dropped = _tokenize_split(split, tokenizer, max_seq_length=12, dataset_format="alpaca")
    assert dropped == 1 and len(kept) == 1
    assert all(len(ids) <= 12 for ids in kept["input_ids"])


def test_format_detection_names_the_columns_it_needs():
    assert detect_format(["instruction", "input", "output", "task"]) == "alpaca"
    assert detect_format(["messages"]) == "messages"
    with pytest.raises(RecipeError, match=r"columns \(prompt, text\).*alpaca: instruction, output"):
        detect_format(["text", "prompt"])


def test_local_files_load_through_load_dataset(tmp_path):
    rows = [{"instruction": "add", "input": "1+2", "output": "3"}] * 4
    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps(row) + "\n" for row in rows))
    splits = load_raw_splits(DataArguments(train_file=str(train), eval_file=str(train)))
    assert isinstance(splits, DatasetDict) and len(splits["train"]) == 4 and len(splits["eval"]) == 4


def test_embedded_dataset_has_train_and_eval():
    splits = load_raw_splits(DataArguments())
    assert len(splits["train"]) == 6000 and len(splits["eval"]) == 300


def test_empty_or_unsupported_files_are_user_errors(tmp_path):
    empty = tmp_path / "empty.csv"
    empty.write_text("instruction,output\n")
    with pytest.raises(RecipeError, match="`train` split of the dataset is empty"):
        load_raw_splits(DataArguments(train_file=str(empty)))
    odd = tmp_path / "data.txt"
    odd.write_text("x")
    with pytest.raises(RecipeError, match=r"`train_file: .*data.txt` has an unsupported suffix"):
        load_raw_splits(DataArguments(train_file=str(odd)))
