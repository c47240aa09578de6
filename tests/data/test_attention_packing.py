"""Packed micro-batches under each attention kind: flash attention sees one flattened row whose example boundaries
Transformers' own varlen detection finds; sdpa and eager keep their rows. Checked on CPU through Transformers'
functions, and through its flash code path with a CPU twin of the varlen kernel."""

import pytest
import torch
import transformers.modeling_flash_attention_utils as flash_utils
from datasets import Dataset
from transformers.modeling_flash_attention_utils import _is_packed_sequence, prepare_fa_kwargs_from_position_ids

from finetune import presets
from finetune.data import encode_messages, to_messages
from finetune.data.collate import (
    FlattenedRowsCollator,
    PackedRowsCollator,
    data_collator,
    pack_examples,
    prepare_model_for_packing,
    row_segments,
)
from finetune.data.tokenize import IGNORE_INDEX
from finetune.errors import RecipeError

ROWS = [{"instruction": "reverse", "input": "abcdefghij", "output": "jihgfedcba"},
        {"instruction": "add", "input": "", "output": "7"},
        {"instruction": "sort", "input": "cab", "output": "abc"},
        {"instruction": "reverse", "input": "xyzw", "output": "wzyx"},
        {"instruction": "reverse", "input": "ab", "output": "ba"},
        {"instruction": "upper", "input": "abcde", "output": "ABCDE"}]
ROW_LENGTH = 48
FLASH_KINDS = ["flash_attention_2", "flash_attention_3", "kernels-community/flash-attn2",
               "kernels-community/vllm-flash-attn3"]


@pytest.fixture(scope="module")
def tokenizer():
    return presets.build_tokenizer()


@pytest.fixture(scope="module")
def examples(tokenizer):
    return [encode_messages(to_messages(row, "alpaca"), tokenizer, 64) for row in ROWS]


@pytest.fixture(scope="module")
def packed(examples):
    """The packed rows, and the examples in the order the rows hold them (the packer's own bins)."""
    rows = pack_examples(Dataset.from_list(examples), ROW_LENGTH)
    assert len(rows) >= 2 and any(len(row) > 1 for row in rows["seq_lengths"])  # several rows, several a row
    by_tokens = {tuple(example["input_ids"]): example for example in examples}
    in_order = [by_tokens[tuple(row["input_ids"][start:end])] for row in rows
                for start, end in row_segments(row["seq_lengths"])]
    assert len(in_order) == len(examples)
    return [rows[i] for i in range(len(rows))], in_order


def model_with(tokenizer, attention: str):
    model = presets.build_model(tokenizer, seed=0).eval()
    model.config._attn_implementation = attention  # what Transformers dispatches attention on
    return model


@pytest.mark.parametrize("attention", FLASH_KINDS)
def test_flash_attention_gets_one_row_whose_boundaries_transformers_finds(tokenizer, packed, attention):
    rows, in_order = packed
    collator = data_collator(tokenizer, packing=True, model=model_with(tokenizer, attention))
    assert isinstance(collator, FlattenedRowsCollator)
    batch = collator(rows)
    total = sum(len(example["input_ids"]) for example in in_order)
    assert {key: tuple(value.shape) for key, value in batch.items()} == {
        "input_ids": (1, total), "labels": (1, total), "position_ids": (1, total)}  # no filler, no attention mask

    # What transformers' `_flash_attention_forward` does with it: detect packing, derive cu_seqlens.
    assert _is_packed_sequence(batch["position_ids"], batch_size=1)
    (cu_seqlens, _), (max_length, _) = prepare_fa_kwargs_from_position_ids(batch["position_ids"])
    lengths = [len(example["input_ids"]) for example in in_order]
    boundaries = [sum(lengths[:i]) for i in range(len(lengths) + 1)]
    assert cu_seqlens.tolist() == boundaries and int(max_length) == max(lengths)
    assert batch["input_ids"][0].tolist() == [t for example in in_order for t in example["input_ids"]]
    assert all(batch["labels"][0, start] == IGNORE_INDEX for start in boundaries[:-1])  # nothing crosses a boundary


def test_the_rows_a_flash_model_used_to_get_are_not_seen_as_packed(tokenizer, packed):
    """Why flattening is needed: several packed rows, as sdpa gets them, read as unpacked by the flash path."""
    rows, _ = packed
    batch = PackedRowsCollator(tokenizer.pad_token_id)(rows)
    assert batch["position_ids"].shape[0] == len(rows) >= 2
    assert not _is_packed_sequence(batch["position_ids"], batch_size=len(rows))  # plain causal attention per row


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_sdpa_and_eager_keep_their_rows_and_each_example_sees_only_itself(tokenizer, packed, attention):
    rows, _ = packed
    model = model_with(tokenizer, attention)
    prepare_model_for_packing(model)
    collator = data_collator(tokenizer, packing=True, model=model)
    assert isinstance(collator, PackedRowsCollator)
    batch = collator(rows)
    assert batch["input_ids"].shape == (len(rows), max(len(row["input_ids"]) for row in rows))
    with torch.no_grad():
        together = model(**batch).logits
        for row_index, row in enumerate(rows):
            for start, end in row_segments(row["seq_lengths"]):
                alone = model(input_ids=torch.tensor([row["input_ids"][start:end]])).logits[0]
                torch.testing.assert_close(together[row_index, start:end], alone, atol=1e-5, rtol=1e-5)


def _attention(query, key, value, causal, scale):
    """One sequence, (tokens, heads, head_dim), as flash attention computes it."""
    query, key, value = (tensor.transpose(0, 1) for tensor in (query, key, value))
    repeat = query.shape[0] // key.shape[0]  # grouped-query attention
    key, value = key.repeat_interleave(repeat, 0), value.repeat_interleave(repeat, 0)
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, is_causal=causal, scale=scale)
    return out.transpose(0, 1)


def cpu_flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False):
    return torch.stack([_attention(q[b], k[b], v[b], causal, softmax_scale) for b in range(q.shape[0])])


def cpu_flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                               softmax_scale=None, causal=False):
    bounds = cu_seqlens_q.tolist()
    return torch.cat([_attention(q[s:e], k[s:e], v[s:e], causal, softmax_scale) for s, e in zip(bounds, bounds[1:])])


@pytest.fixture
def cpu_flash_kernel(monkeypatch):
    """Transformers' flash attention path (`_flash_attention_forward`) running on a CPU twin of flash-attn's
    `flash_attn_func` / `flash_attn_varlen_func`: everything but the kernel is Transformers' own."""
    monkeypatch.setattr(flash_utils, "_lazy_imports", lambda *args, **kwargs: (
        cpu_flash_attn_func, cpu_flash_attn_varlen_func, None, flash_utils._pad_input, flash_utils._unpad_input))
    monkeypatch.setattr(flash_utils, "_loaded_implementation", None)


def test_through_transformers_flash_path_flattened_examples_match_alone_and_rows_would_leak(
        tokenizer, packed, cpu_flash_kernel):
    rows, in_order = packed
    model = model_with(tokenizer, "flash_attention_2")
    prepare_model_for_packing(model)
    with torch.no_grad():
        alone = [model(input_ids=torch.tensor([example["input_ids"]])).logits[0] for example in in_order]
        flattened = model(**data_collator(tokenizer, packing=True, model=model)(rows)).logits[0]
        start = 0
        for logits in alone:
            torch.testing.assert_close(flattened[start:start + len(logits)], logits, atol=1e-5, rtol=1e-5)
            start += len(logits)
        # The same rows unflattened: the flash path runs plain causal attention over each whole row.
        leaky = model(**PackedRowsCollator(tokenizer.pad_token_id)(rows)).logits
        second_start = row_segments(rows[0]["seq_lengths"])[1][0]
        second_length = len(in_order[1]["input_ids"])
        assert (leaky[0, second_start:second_start + second_length] - alone[1]).abs().max() > 0.01


def test_packing_refuses_an_attention_that_cannot_keep_examples_apart(tokenizer):
    prepare_model_for_packing(model_with(tokenizer, "kernels-community/flash-attn2"))  # a hub flash kernel: fine
    with pytest.raises(RecipeError, match=r"this model uses my_attention: set `attn_implementation: sdpa`"):
        prepare_model_for_packing(model_with(tokenizer, "my_attention"))


@pytest.mark.parametrize("attention, said", [("flash_attention_2", "not installed|CUDA|toggled"),
                                              ("sdpaa", "not supported")])
def test_an_attention_kernel_that_cannot_load_is_refused_in_one_line_naming_the_key(hub_model_dir, attention, said):
    from finetune.models.loading import load_model, load_tokenizer
    from finetune.recipe.args import ModelArguments

    model_args = ModelArguments(model_name_or_path=str(hub_model_dir), attn_implementation=attention)
    with pytest.raises(RecipeError, match=rf"^`attn_implementation: {attention}` cannot be used here: .*({said})"):
        load_model(model_args, load_tokenizer(model_args))
