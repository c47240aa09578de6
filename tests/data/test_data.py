import json
from types import SimpleNamespace

import pandas as pd
import pytest
import torch
from datasets import Dataset, DatasetDict

from finetune import presets
from finetune.data import detect_format, encode_example, encode_messages, load_raw_data, load_raw_splits, to_messages
from finetune.data.collate import data_collator, pack_examples, prepare_model_for_packing, row_segments
from finetune.data.tokenize import IGNORE_INDEX, _tokenize_split, prepare_datasets
from finetune.errors import RecipeError
from finetune.recipe.args import DataArguments


@pytest.fixture(scope="module")
def tokenizer():
    return presets.build_tokenizer()


class OneProcess:
    """The part of TrainingArguments that prepare_datasets uses, for a single process."""

    seed = 0

    @staticmethod
    def main_process_first(desc=""):
        import contextlib

        return contextlib.nullcontext()


def labelled_text(tokenizer, input_ids, labels):
    return tokenizer.decode([t for t, label in zip(input_ids, labels) if label != IGNORE_INDEX])


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def prepare(tokenizer, **data_args):
    args = DataArguments(**data_args)
    return prepare_datasets(load_raw_data(args), tokenizer, args, OneProcess())


def test_only_the_answer_and_its_end_token_carry_labels(tokenizer):
    messages = to_messages({"instruction": "reverse", "input": "abc", "output": "cba"}, "alpaca")
    encoded = encode_messages(messages, tokenizer, max_seq_length=64)
    prompt_length = len(tokenizer("<|user|>reverse\n\nabc<|end|><|assistant|>", add_special_tokens=False)["input_ids"])
    assert encoded["labels"][:prompt_length] == [IGNORE_INDEX] * prompt_length
    assert encoded["labels"][prompt_length:] == encoded["input_ids"][prompt_length:]
    assert labelled_text(tokenizer, encoded["input_ids"], encoded["labels"]) == "cba<|end|>"
    assert encoded["attention_mask"] == [1] * len(encoded["input_ids"])


MULTI_TURN = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "hi"},
    {"role": "assistant", "content": "yo"},
    {"role": "user", "content": "again"},
    {"role": "assistant", "content": "ok"},
]


def test_every_assistant_turn_is_labelled_token_by_token_in_a_multi_turn_conversation(tokenizer):
    encoded = encode_messages(MULTI_TURN, tokenizer, max_seq_length=128)
    tokens = [tokenizer.decode([t]) for t in encoded["input_ids"]]
    expected = ["<|system|>", *"be brief", "<|end|>", "<|user|>", *"hi", "<|end|>", "<|assistant|>", "y", "o",
                "<|end|>", "<|user|>", *"again", "<|end|>", "<|assistant|>", "o", "k", "<|end|>"]
    assert tokens == expected
    first, second = tokens.index("<|assistant|>") + 1, len(tokens) - 3  # "yo<|end|>" and "ok<|end|>"
    expected = [first <= i < first + 3 or i >= second for i in range(len(tokens))]
    assert [label != IGNORE_INDEX for label in encoded["labels"]] == expected
    assert all(label in (IGNORE_INDEX, token) for label, token in zip(encoded["labels"], encoded["input_ids"]))


def test_sharegpt_multi_turn_masks_exactly_like_messages(tokenizer):
    roles = {"system": "system", "user": "human", "assistant": "gpt"}
    sharegpt = {"conversations": [{"from": roles[m["role"]], "value": m["content"]} for m in MULTI_TURN]}
    assert detect_format(sharegpt) == "sharegpt"
    assert encode_example(sharegpt, "sharegpt", tokenizer) == encode_example({"messages": MULTI_TURN}, "messages",
                                                                             tokenizer)
    with pytest.raises(RecipeError, match="`from: bot`"):
        encode_example({"conversations": [{"from": "bot", "value": "x"}]}, "sharegpt", tokenizer)


def test_prompt_completion_learns_the_completion_and_eos(tokenizer):
    input_ids, labels = encode_example({"prompt": "2+2=", "completion": "4"}, "prompt_completion", tokenizer)
    assert tokenizer.decode(input_ids) == "2+2=4<|end|>"
    assert labelled_text(tokenizer, input_ids, labels) == "4<|end|>"


def test_plain_text_learns_every_token(tokenizer):
    input_ids, labels = encode_example({"text": "hello"}, "text", tokenizer)
    assert labels == input_ids and tokenizer.decode(input_ids) == "hello<|end|>"


FORMAT_ROWS = {
    "alpaca": ({"instruction": "reverse", "input": "ab", "output": "ba"}, "ba<|end|>"),
    "sharegpt": ({"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]}, "yo<|end|>"),
    "messages": ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]},
                 "yo<|end|>"),
    "prompt_completion": ({"prompt": "1+1=", "completion": "2"}, "2<|end|>"),
    "text": ({"text": "plain words"}, "plain words<|end|>"),
}


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".csv", ".parquet"])
@pytest.mark.parametrize("dataset_format", sorted(FORMAT_ROWS))
def test_each_format_from_each_file_type(tmp_path, tokenizer, dataset_format, suffix):
    row, learned = FORMAT_ROWS[dataset_format]
    if suffix == ".csv" and dataset_format in ("sharegpt", "messages"):
        pytest.skip("CSV has no nested columns")
    path = tmp_path / f"train{suffix}"
    rows = [row] * 3
    if suffix == ".jsonl":
        write_jsonl(path, rows)
    elif suffix == ".json":
        path.write_text(json.dumps(rows))
    elif suffix == ".csv":
        pd.DataFrame(rows).to_csv(path, index=False)
    else:
        pd.DataFrame(rows).to_parquet(path)
    data = prepare(tokenizer, train_file=str(path), generation_eval_samples=0)
    assert data.summary["sources"][0]["format"] == dataset_format
    assert len(data.train) == 3
    assert labelled_text(tokenizer, data.train[0]["input_ids"], data.train[0]["labels"]) == learned


def test_a_directory_written_by_save_to_disk_loads(tmp_path, tokenizer):
    DatasetDict(train=Dataset.from_list([FORMAT_ROWS["alpaca"][0]] * 4),
                test=Dataset.from_list([FORMAT_ROWS["alpaca"][0]] * 2)).save_to_disk(tmp_path / "saved")
    source = load_raw_data(DataArguments(dataset=str(tmp_path / "saved"))).sources[0]
    assert len(source.train) == 4 and len(source.eval) == 2  # `test` serves as the eval split


def test_files_of_different_formats_mix_by_weight(tmp_path, tokenizer):
    alpaca = write_jsonl(tmp_path / "a.jsonl", [FORMAT_ROWS["alpaca"][0]] * 400)
    text = write_jsonl(tmp_path / "t.jsonl", [FORMAT_ROWS["text"][0]] * 400)
    data = prepare(tokenizer, mix_files=[str(alpaca), str(text)], mix_weights=[3, 1], generation_eval_samples=0)
    assert [s["format"] for s in data.summary["sources"]] == ["alpaca", "text"]
    assert data.summary["weights"] == [0.75, 0.25]
    texts = sum(1 for labels in data.train["labels"] if IGNORE_INDEX not in labels)  # text rows learn every token
    # Drawn 3:1 until the alpaca file runs out: about 400 alpaca rows and 133 text rows.
    assert len(data.train) - texts == 400 and 100 < texts < 170


def test_eval_split_by_ratio(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "train.jsonl", [{"instruction": "add", "input": f"{i}+1", "output": str(i + 1)}
                                                  for i in range(100)])
    data = prepare(tokenizer, train_file=str(path), eval_split_ratio=0.1, generation_eval_samples=5)
    assert len(data.train) == 90 and len(data.eval) == 10 and len(data.generation_examples) == 5
    train_inputs = {tuple(ids) for ids in data.train["input_ids"]}
    assert not any(tuple(ids) in train_inputs for ids in data.eval["input_ids"])


def test_malformed_json_line_names_the_file_and_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "fine"}\n{"text": "fine"}\n{"text": broken}\n')
    with pytest.raises(RecipeError, match=r"malformed JSON at .*bad.jsonl:3: Expecting value"):
        load_raw_data(DataArguments(train_file=str(path)))


def test_empty_or_unsupported_files_are_user_errors(tmp_path):
    empty = tmp_path / "empty.csv"
    empty.write_text("instruction,output\n")
    with pytest.raises(RecipeError, match="`train` split of the dataset is empty"):
        load_raw_splits(DataArguments(train_file=str(empty)))
    odd = tmp_path / "data.txt"
    odd.write_text("x")
    with pytest.raises(RecipeError, match=r"`train_file: .*data.txt` has an unsupported suffix"):
        load_raw_splits(DataArguments(train_file=str(odd)))


def test_a_missing_column_is_named(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "train.jsonl", [{"instruction": "x", "answer": "y"}])
    with pytest.raises(RecipeError, match=r"columns \(answer, instruction\).*alpaca: instruction, output"):
        prepare(tokenizer, train_file=str(path))
    with pytest.raises(RecipeError, match="`dataset_format: alpaca` needs column\\(s\\) output"):
        prepare(tokenizer, train_file=str(path), dataset_format="alpaca")


def test_an_empty_value_stops_with_the_example_number(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "train.jsonl", [FORMAT_ROWS["alpaca"][0], {"instruction": "x", "output": None}])
    with pytest.raises(RecipeError, match=r"train example 2: a assistant turn has no text \(None\)"):
        prepare(tokenizer, train_file=str(path))


LONG = {"instruction": "reverse", "input": "abcdefghij", "output": "jihgfedcba"}  # 36 tokens
SHORT = {"instruction": "add", "input": "", "output": "7"}  # 16 tokens


def tokenize(tokenizer, rows, **policy):
    args = SimpleNamespace(**{"max_seq_length": 12, "overlong_policy": "truncate", "unlabeled_policy": "drop",
                              **policy})
    return _tokenize_split(Dataset.from_list(rows), "train", tokenizer, args, "alpaca")


def test_truncation_that_removes_every_answer_token_drops_the_example_and_counts_it(tokenizer):
    kept, summary = tokenize(tokenizer, [LONG, SHORT], max_seq_length=20)
    assert len(kept) == 1 and summary["dropped"] == {"no_answer_tokens": 1} and summary["truncated_rows"] == 0
    assert summary["length_percentiles"]["max"] == len(encode_example(LONG, "alpaca", tokenizer)[0])
    with pytest.raises(RecipeError, match="train example 1 has no answer token left .*unlabeled_policy: error"):
        tokenize(tokenizer, [LONG, SHORT], max_seq_length=20, unlabeled_policy="error")


def test_overlong_examples_truncate_drop_or_stop_as_the_recipe_says(tokenizer):
    long_length = len(encode_example(LONG, "alpaca", tokenizer)[0])
    kept, summary = tokenize(tokenizer, [LONG, SHORT], max_seq_length=long_length - 2)
    assert len(kept) == 2 and summary["truncated_rows"] == 1 and summary["dropped"] == {}
    assert max(len(ids) for ids in kept["input_ids"]) == long_length - 2
    kept, summary = tokenize(tokenizer, [LONG, SHORT], max_seq_length=long_length - 2, overlong_policy="drop")
    assert len(kept) == 1 and summary["dropped"] == {"overlong": 1} and summary["tokens"] == len(kept[0]["input_ids"])
    with pytest.raises(RecipeError, match=f"train example 1 has {long_length} tokens, more than `max_seq_length"):
        tokenize(tokenizer, [LONG, SHORT], max_seq_length=long_length - 2, overlong_policy="error")


def test_nothing_left_after_the_policies_is_an_error_not_a_nan_loss(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "train.jsonl", [LONG] * 3)
    with pytest.raises(RecipeError, match="no training example of .* is left after the data policies"):
        prepare(tokenizer, train_file=str(path), max_seq_length=12)


def test_embedded_dataset_has_train_and_eval():
    splits = load_raw_splits(DataArguments())
    assert len(splits["train"]) == 6000 and len(splits["eval"]) == 300


def test_mix_arguments_are_checked(tmp_path):
    path = write_jsonl(tmp_path / "a.jsonl", [FORMAT_ROWS["text"][0]])
    with pytest.raises(RecipeError, match="one positive weight per file"):
        DataArguments(mix_files=[str(path), str(path)], mix_weights=[1.0])
    with pytest.raises(RecipeError, match="either `train_file` or `mix_files`"):
        DataArguments(train_file=str(path), mix_files=[str(path)])


def test_a_split_or_slice_of_a_local_file_is_honoured_and_a_configuration_refused(tmp_path):
    path = write_jsonl(tmp_path / "train.jsonl", [{"text": f"row {i}"} for i in range(10)])
    for key in ("train_file", "dataset"):
        sliced = load_raw_data(DataArguments(**{key: str(path)}, dataset_split="train[:5]")).sources[0]
        assert sliced.train["text"] == [f"row {i}" for i in range(5)]  # the whole file was trained on
        with pytest.raises(RecipeError, match=r"^`dataset_split: test`: `.*train.jsonl` is a file, whose rows are "
                                              r"the `train` split"):
            load_raw_data(DataArguments(**{key: str(path)}, dataset_split="test"))
        with pytest.raises(RecipeError, match=rf"^`dataset_config: all` selects a configuration \(subset\) of a hub "
                                              rf"dataset, but `{key}: .*train.jsonl` is a local file"):
            load_raw_data(DataArguments(**{key: str(path)}, dataset_config="all"))
    held_out = load_raw_data(DataArguments(dataset=str(path), eval_split="train[8:]")).sources[0]
    assert held_out.eval["text"] == ["row 8", "row 9"]


@pytest.mark.parametrize("dataset", ["nope.jsonl", "data/nope", "./nope", "a/b/c"])
def test_a_local_file_that_does_not_exist_is_named_not_sent_to_the_hub(tmp_path, monkeypatch, dataset):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()
    with pytest.raises(RecipeError, match=rf"^`dataset: {dataset}`: file {dataset} does not exist; check the path"):
        load_raw_data(DataArguments(dataset=dataset))



@pytest.mark.parametrize("dataset, suggestion", [("trian.jsonl", "train.jsonl"), ("data/evl.jsonl", "data/eval.jsonl")])
def test_a_misspelled_data_file_is_named_with_the_file_nearby(tmp_path, monkeypatch, dataset, suggestion):
    monkeypatch.chdir(tmp_path)
    write_jsonl(tmp_path / "train.jsonl", FORMAT_ROWS["text"])
    (tmp_path / "data").mkdir()
    write_jsonl(tmp_path / "data" / "eval.jsonl", FORMAT_ROWS["text"])
    with pytest.raises(RecipeError, match=rf"^`dataset: {dataset}`: file {dataset} does not exist \(did you mean "
                                          rf"`{suggestion}`\?\); check the path"):
        load_raw_data(DataArguments(dataset=dataset))

def test_bfd_split_with_an_overlong_policy_that_drops_or_refuses_is_refused():
    with pytest.raises(RecipeError, match=r"^`packing_strategy: bfd_split` cuts .* so `overlong_policy: error` would "
                                          r"never apply: use `packing_strategy: bfd` to refuse"):
        DataArguments(packing=True, packing_strategy="bfd_split", overlong_policy="error")
    with pytest.raises(RecipeError, match="`overlong_policy: drop` would never apply"):
        DataArguments(packing=True, packing_strategy="bfd_split", overlong_policy="drop")
    assert DataArguments(packing=True, packing_strategy="bfd_split").overlong_policy == "truncate"


@pytest.mark.parametrize("weights, message", [
    ([1.0, float("nan")], r"^`mix_weights` weight 2 \(of .*b.jsonl\): `mix_weights: nan` must be a positive finite"),
    ([0, 1.0], r"^`mix_weights` weight 1 \(of .*a.jsonl\): `mix_weights: 0` must be a positive finite"),
    (["heavy", 1.0], r"^`mix_weights` weight 1 \(of .*a.jsonl\): `mix_weights: heavy` is not a number"),
])
def test_a_mix_weight_that_is_not_a_positive_number_is_named_with_its_file(tmp_path, weights, message):
    files = [str(write_jsonl(tmp_path / name, [FORMAT_ROWS["text"][0]])) for name in ("a.jsonl", "b.jsonl")]
    with pytest.raises(RecipeError, match=message):
        DataArguments(mix_files=files, mix_weights=weights)


def per_example_losses(logits, labels):
    """Mean next-token loss of each labelled run in `labels` (one row), separated by -100 at boundaries."""
    return torch.nn.functional.cross_entropy(logits[:-1], labels[1:], ignore_index=IGNORE_INDEX, reduction="none")


def per_example_losses_match(model, packed_batch, features, starts_by_row):
    """Each example's token losses inside the packed batch equal its losses computed alone."""
    with torch.no_grad():
        packed_logits = model(**packed_batch).logits  # exactly what Trainer passes
        for feature, (row, start) in zip(features, starts_by_row):
            length = len(feature["input_ids"])
            labels = torch.tensor(feature["labels"])
            alone = model(input_ids=torch.tensor([feature["input_ids"]])).logits[0]
            together = packed_logits[row, start:start + length]
            torch.testing.assert_close(per_example_losses(together, labels), per_example_losses(alone, labels),
                                       atol=1e-5, rtol=1e-5)


PACK_ROWS = [FORMAT_ROWS["alpaca"][0], LONG, SHORT, {"instruction": "sort", "input": "cab", "output": "abc"},
             {"instruction": "reverse", "input": "xyzw", "output": "wzyx"}]


def test_packed_rows_give_the_same_per_example_losses_as_unpacked(tokenizer):
    model = presets.build_model(tokenizer, seed=0).eval()
    prepare_model_for_packing(model)  # what finetune train does with `packing: true`
    features = [encode_messages(to_messages(row, "alpaca"), tokenizer, 64) for row in PACK_ROWS]
    rows = pack_examples(Dataset.from_list(features), max_length=48)
    lengths = [len(f["input_ids"]) for f in features]
    assert all(len(ids) <= 48 for ids in rows["input_ids"]) and sum(map(len, rows["input_ids"])) == sum(lengths)
    assert len(rows) < len(features)  # several examples share a row
    batch = data_collator(tokenizer, packing=True)([rows[i] for i in range(len(rows))])
    assert "attention_mask" not in batch
    # Where each example landed: match it by its tokens within its row.
    starts = []
    for feature in features:
        for row, ids in enumerate(rows["input_ids"]):
            at = next((start for start, _ in row_segments(rows["seq_lengths"][row])
                       if ids[start:start + len(feature["input_ids"])] == feature["input_ids"]), None)
            if at is not None:
                starts.append((row, at))
                break
    assert len(starts) == len(features)
    per_example_losses_match(model, batch, features, starts)


def test_padding_free_batch_gives_the_same_per_example_losses_as_unpacked(tokenizer):
    model = presets.build_model(tokenizer, seed=0).eval()
    prepare_model_for_packing(model)
    features = [encode_messages(to_messages(row, "alpaca"), tokenizer, 64) for row in PACK_ROWS]
    batch = data_collator(tokenizer, padding_free=True)([dict(f) for f in features])
    assert batch["input_ids"].shape == (1, sum(len(f["input_ids"]) for f in features))  # no padding at all
    offsets = [sum(len(f["input_ids"]) for f in features[:i]) for i in range(len(features))]
    per_example_losses_match(model, batch, features, [(0, offset) for offset in offsets])


def _rows_of(lengths: list[int]) -> Dataset:
    """Examples whose tokens name them (example i holds i+1 repeated), labels equal to their tokens."""
    ids = [[index + 1] * length for index, length in enumerate(lengths)]
    return Dataset.from_dict({"input_ids": ids, "attention_mask": [[1] * n for n in lengths], "labels": ids})


def test_packing_bins_the_whole_dataset_best_fit_decreasing_and_the_collator_marks_each_boundary(tokenizer):
    lengths = [5, 4, 3, 3, 2, 2, 1]
    rows = pack_examples(_rows_of(lengths), max_length=8)
    assert rows.column_names == ["input_ids", "labels", "seq_lengths"]  # no attention mask: the collator's job
    assert sorted(map(sum, rows["seq_lengths"])) == [4, 8, 8]  # 20 tokens: two full rows and the rest
    assert sorted(n for row in rows["seq_lengths"] for n in row) == sorted(lengths)  # every example, whole
    batch = data_collator(tokenizer, packing=True)([rows[i] for i in range(len(rows))])
    for row, ids, labels, positions in zip(rows, batch["input_ids"].tolist(), batch["labels"].tolist(),
                                           batch["position_ids"].tolist()):
        filled = sum(row["seq_lengths"])
        starts = [i for i, position in enumerate(positions[:filled]) if position == 0]
        assert starts == [start for start, _ in row_segments(row["seq_lengths"])]
        assert all(labels[i] == (IGNORE_INDEX if i in starts else ids[i]) for i in range(filled))  # no token
        assert set(labels[filled:]) <= {IGNORE_INDEX}  # is predicted across a boundary; the filler learns nothing


def test_bfd_split_cuts_an_overlong_example_into_row_long_pieces_and_loses_no_token(tokenizer):
    lengths = [20, 3, 2]
    rows = pack_examples(_rows_of(lengths), max_length=8, strategy="bfd_split")
    assert sum(map(len, rows["input_ids"])) == sum(lengths)  # `bfd` would have kept 8 of the 20
    assert sorted(n for row in rows["seq_lengths"] for n in row) == [2, 3, 4, 8, 8]
    truncated = pack_examples(_rows_of(lengths), max_length=8)
    assert sum(map(len, truncated["input_ids"])) == 8 + 3 + 2
    with pytest.raises(RecipeError, match="`packing_strategy: wrapped` is not one of bfd, bfd_split"):
        pack_examples(_rows_of(lengths), max_length=8, strategy="wrapped")


def test_packing_without_prepare_would_mix_examples_so_it_is_required(tokenizer):
    """The trap prepare_model_for_packing closes: with the config's KV cache on, packed rows cross-attend."""
    model = presets.build_model(tokenizer, seed=0).eval()
    features = [encode_messages(to_messages(row, "alpaca"), tokenizer, 64) for row in (LONG, SHORT)]
    packed = data_collator(tokenizer, padding_free=True)([dict(f) for f in features])
    second = len(features[0]["input_ids"])
    with torch.no_grad():
        alone = model(input_ids=torch.tensor([features[1]["input_ids"]])).logits[0]
        leaky = model(**packed).logits[0, second:]
        prepare_model_for_packing(model)
        isolated = model(**packed).logits[0, second:]
    assert (leaky - alone).abs().max() > 0.01
    torch.testing.assert_close(isolated, alone, atol=1e-5, rtol=1e-5)


def test_group_by_length_batches_examples_of_similar_length(tmp_path, tokenizer):
    """Trainer's own `train_sampling_strategy: group_by_length` works on the prepared data (lengths from
    `input_ids`)."""
    from transformers import Trainer, TrainingArguments
    from transformers.trainer_pt_utils import LengthGroupedSampler

    rows = [{"text": "x" * (2 + i % 5 if i % 2 else 58 + i % 5)} for i in range(80)]  # half short, half long
    data = prepare(tokenizer, train_file=str(write_jsonl(tmp_path / "t.jsonl", rows)), generation_eval_samples=0)
    args = TrainingArguments(str(tmp_path / "out"), train_sampling_strategy="group_by_length",
                             per_device_train_batch_size=2, use_cpu=True, report_to=[])
    trainer = Trainer(model=presets.build_model(tokenizer), args=args, train_dataset=data.train,
                      data_collator=data_collator(tokenizer))
    sampler = trainer._get_train_sampler()
    assert isinstance(sampler, LengthGroupedSampler)
    lengths = [len(data.train[i]["input_ids"]) for i in sampler]
    mixed = sum(1 for i in range(0, len(lengths), 2) if abs(lengths[i] - lengths[i + 1]) > 10)
    assert mixed <= 4, lengths  # random pairing would mix about 20 of the 40 pairs


def test_a_chat_template_for_prompt_completion_data_is_refused_not_saved_unused(tmp_path, tokenizer):
    from finetune.data.pipeline import prepare_data
    from finetune.recipe.args import ModelArguments

    path = write_jsonl(tmp_path / "pairs.jsonl", [FORMAT_ROWS["prompt_completion"][0]] * 4)
    training = SimpleNamespace(output_dir=str(tmp_path / "run"), world_size=1, process_index=0, seed=0,
                               main_process_first=OneProcess.main_process_first)

    def recipe(**model):
        return SimpleNamespace(model=ModelArguments(**model), training=training,
                               data=DataArguments(train_file=str(path), generation_eval_samples=0))

    with pytest.raises(RecipeError, match=r"^`chat_template` is set, but .*pairs.jsonl holds prompt/completion "
                                          r"strings, which train as plain text .* Write the examples as `messages`"):
        prepare_data(recipe(chat_template="chatml"), tokenizer, None)
    data = prepare_data(recipe(), tokenizer, None)  # no template: trained as text, as TRL trains a string pair
    assert labelled_text(tokenizer, data.train[0]["input_ids"], data.train[0]["labels"]) == "2<|end|>"
