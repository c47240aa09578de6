"""One GGUF file (what llama.cpp and Ollama run) from a fine-tuned causal LM and its tokenizer, in memory.

Written through llama.cpp's own Python package `gguf`: `GGUFWriter` for the file, `get_tensor_name_map` for the
tensor names, `gguf.quants.quantize` for Q8_0 and `SpecialVocab` for the merges and special tokens, laid out as
llama.cpp's converter lays them out (convert_hf_to_gguf.py: `LlamaModel` for Llama and Mistral, with its q/k
permutation; `Qwen2Model`, `Qwen3Model`; `TextModel.set_gguf_parameters`; `_set_vocab_gpt2`; 1-D tensors kept in
F32, a Q8_0 tensor whose rows do not split into blocks of 32 written in F16). Only what Transformers also reads back
(transformers/modeling_gguf_pytorch_utils.py, integrations/ggml.py, integrations/gguf/gguf_tokenizer_mapping.py) is
accepted: those architectures and a byte-level BPE tokenizer; anything else is refused with the reason.
"""

from __future__ import annotations

import json
import math
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from finetune.errors import RecipeError

GGUF_TYPES = ("f16", "q8_0")


@dataclass(frozen=True)
class Layout:
    """How llama.cpp stores one Transformers architecture."""

    arch: str  # the `gguf.MODEL_ARCH` member
    # llama.cpp's LlamaModel reorders the rows of q and k from Transformers' rotate-half rotary layout to the
    # interleaved one its llama graph uses; Transformers' LlamaTensorProcessor undoes it on reading.
    permute_query_key: bool


LAYOUTS = {
    "LlamaForCausalLM": Layout("LLAMA", permute_query_key=True),
    "MistralForCausalLM": Layout("LLAMA", permute_query_key=True),  # llama.cpp converts Mistral as llama
    "Qwen2ForCausalLM": Layout("QWEN2", permute_query_key=False),
    "Qwen3ForCausalLM": Layout("QWEN3", permute_query_key=False),
}


def layout_of(model) -> Layout:
    """The layout of `model`'s architecture, or the reason it has none."""
    if hasattr(model, "peft_config"):
        raise RecipeError("--gguf: the checkpoint is a LoRA adapter, and a GGUF file holds whole weights: pass "
                          "--merge-lora to merge it into its base first.")
    name = type(model).__name__
    if name.endswith("ForSequenceClassification"):
        raise RecipeError(f"--gguf: the checkpoint is a {name} (a reward model or classifier), and this export "
                          "writes causal LMs that generate, not scorers: export it without --gguf (safetensors).")
    if hasattr(model.config, "vision_config"):
        raise RecipeError(f"--gguf: {name} is a vision-language model, which llama.cpp runs as a language model plus a "
                          "separate vision projector file (mmproj) this export does not write: export without --gguf "
                          "(safetensors, with its processor) and convert with llama.cpp's convert_hf_to_gguf.py "
                          "(--mmproj for the vision part).")
    if name not in LAYOUTS:
        raise RecipeError(f"--gguf: {name} is not an architecture this export writes ({', '.join(LAYOUTS)}): export "
                          "without --gguf and convert with llama.cpp's convert_hf_to_gguf.py.")
    rope = getattr(model.config, "rope_parameters", None) or {}
    if rope.get("rope_type", "default") != "default":
        raise RecipeError(f"--gguf: {name} uses {rope['rope_type']} rope scaling, which this export does not write: "
                          "export without --gguf and convert with llama.cpp's convert_hf_to_gguf.py.")
    return LAYOUTS[name]


# --- the tokenizer -----------------------------------------------------------------------------------------------

def pre_tokenizer_name(tokenizer_json: dict) -> str:
    """llama.cpp's name (`tokenizer.ggml.pre`) for how the tokenizer splits text before its merges: GPT-2's regex
    (`ByteLevel` splitting itself), or a `Split` regex Transformers' GGUF reader knows by name. Without merges the
    split changes no token, so any name reads the same (`default`)."""
    from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_PRE_TOKENIZER_SPLITS

    if not tokenizer_json["model"].get("merges"):
        return "default"
    pre = tokenizer_json.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    byte_level = steps[-1] if steps[-1].get("type") == "ByteLevel" else {}
    if byte_level.get("add_prefix_space"):
        raise RecipeError("--gguf: the tokenizer adds a space before the text (ByteLevel add_prefix_space), which "
                          "llama.cpp's byte-level BPE does not do.")
    if len(steps) == 1 and byte_level.get("use_regex", True):
        return "gpt-2"
    split = steps[0].get("pattern", {}).get("Regex") if len(steps) == 2 and steps[0].get("type") == "Split" else None
    names = [name for name, regex in GGUF_PRE_TOKENIZER_SPLITS.items() if regex == split]
    if not byte_level or not names:
        raise RecipeError("--gguf: the tokenizer splits text in a way llama.cpp does not know by name (its "
                          "pre-tokenizer is neither GPT-2's nor a known model family's): convert with llama.cpp's "
                          "convert_hf_to_gguf.py, which can be taught new ones.")
    return names[0]


def check_tokenizer(tokenizer) -> dict:
    """The tokenizer's `tokenizers` JSON, once it is known to be one llama.cpp and Transformers' GGUF reader both
    rebuild: byte-level BPE (`gpt2` in GGUF) with merges, no normalizer."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    tokenizer_json = json.loads(backend.to_str()) if backend is not None else {}
    model, decoder = tokenizer_json.get("model", {}), tokenizer_json.get("decoder") or {}
    if model.get("type") != "BPE" or model.get("byte_fallback") or decoder.get("type") != "ByteLevel":
        kind = ("SentencePiece-style BPE (byte fallback)" if model.get("byte_fallback") else
                 f"{model.get('type') or type(tokenizer).__name__}, not byte-level BPE")
        raise RecipeError(f"--gguf: the tokenizer is {kind}, and this export writes byte-level BPE tokenizers only "
                          "(GPT-2, Llama-3, Qwen style): convert with llama.cpp's convert_hf_to_gguf.py.")
    normalizer = tokenizer_json.get("normalizer") or {"type": "NFC"}
    if normalizer.get("type") != "NFC":  # NFC (Qwen's) changes no text already composed, as text mostly is
        raise RecipeError(f"--gguf: the tokenizer normalizes text ({normalizer.get('type')}) before splitting it, "
                          "which llama.cpp's byte-level BPE does not: convert with llama.cpp's convert_hf_to_gguf.py.")
    if not model.get("merges"):
        # GGUF has no empty arrays (GGUFWriter drops them), llama.cpp refuses a `gpt2` vocabulary without
        # `tokenizer.ggml.merges`, and Transformers' reader then derives merges from token scores it does not have.
        raise RecipeError("--gguf: the tokenizer is byte-level BPE with no merges (one token per byte, as the `tiny` "
                          "demo tokenizer is), which a GGUF file cannot hold: llama.cpp needs the merges list and the "
                          "format has no empty list. Fine-tune a model with a trained BPE tokenizer to export GGUF.")
    pre_tokenizer_name(tokenizer_json)
    return tokenizer_json


def token_table(tokenizer, vocab_size: int) -> tuple[list[str], list[int]]:
    """Every id's token and llama.cpp token type, as `_set_vocab_gpt2` writes them: added special tokens are CONTROL,
    other added ones USER_DEFINED (matched whole in text), ids the tokenizer lacks (a vocabulary padded for speed)
    `[PAD<id>]` and UNUSED."""
    from gguf import TokenType

    by_id = {index: token for token, index in tokenizer.get_vocab().items()}
    added = tokenizer.added_tokens_decoder
    tokens, types = [], []
    for index in range(vocab_size):
        if index not in by_id:
            tokens.append(f"[PAD{index}]")
            types.append(TokenType.UNUSED)
        elif index in added:
            tokens.append(added[index].content)
            types.append(TokenType.CONTROL if added[index].special else TokenType.USER_DEFINED)
        else:
            tokens.append(by_id[index])
            types.append(TokenType.NORMAL)
    return tokens, types


def adds_special_tokens(tokenizer) -> dict[str, bool]:
    """Whether encoding adds BOS and EOS, measured, so llama.cpp adds what training added
    (`tokenizer.ggml.add_bos_token`, read by Transformers too)."""
    plain = tokenizer("a", add_special_tokens=False)["input_ids"]
    ids = tokenizer("a", add_special_tokens=True)["input_ids"]
    start, end = ids[:ids.index(plain[0])], ids[ids.index(plain[0]) + len(plain):]
    return {"bos": tokenizer.bos_token_id is not None and tokenizer.bos_token_id in start,
            "eos": tokenizer.eos_token_id is not None and tokenizer.eos_token_id in end}


def write_tokenizer(writer, tokenizer, tokenizer_json: dict, vocab_size: int) -> None:
    """Tokens, types, merges, special ids, their addition and the chat template training used."""
    from gguf import SpecialVocab

    tokens, types = token_table(tokenizer, vocab_size)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre_tokenizer_name(tokenizer_json))
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    with tempfile.TemporaryDirectory() as saved:  # SpecialVocab reads a tokenizer's files, as the converter does
        tokenizer.save_pretrained(saved)
        special = SpecialVocab(saved, load_merges=True, n_vocab=vocab_size,
                               special_token_types=("bos", "eos", "unk", "pad"))
    special.add_special_token = adds_special_tokens(tokenizer)
    special.chat_template = tokenizer.chat_template  # the one training rendered with (a default one included)
    special.add_to_gguf(writer, quiet=True)


# --- the hyperparameters and tensors -----------------------------------------------------------------------------

def write_hyperparameters(writer, config, name: str, file_type) -> None:
    """`TextModel.set_gguf_parameters` and `LlamaModel`'s additions, for the keys Transformers reads back."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer.add_name(name)
    writer.add_file_type(file_type)
    writer.add_vocab_size(config.vocab_size)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)


def interleave_rotary_rows(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """Within each head, rows `[first half | second half]` become `[h0, h_half, h1, h_half+1, ...]`: the order of
    llama.cpp's interleaved rotary pairs (its converter's `LlamaModel.permute`)."""
    halves = weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:])
    return halves.transpose(1, 2).reshape(weight.shape)


def ggml_type_of(shape, gguf_type: str):
    """The GGML type a weight of `shape` is stored in: 1-D ones (norms, biases) in F32 as llama.cpp keeps them, the
    rest in F16 or Q8_0, where a row that does not split into Q8_0's blocks of 32 falls back to F16 as the converter
    does (gguf's `QuantError`)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    if len(shape) <= 1:
        return GGMLQuantizationType.F32
    if gguf_type == "q8_0" and shape[-1] % GGML_QUANT_SIZES[GGMLQuantizationType.Q8_0][0] == 0:
        return GGMLQuantizationType.Q8_0
    return GGMLQuantizationType.F16


def encoded(weight: torch.Tensor, ggml_type):
    """One weight's data as the file stores it in `ggml_type` (gguf's own F16 cast and Q8_0 quantizer)."""
    from gguf import GGMLQuantizationType, quants

    data = weight.detach().to(torch.float32).cpu().numpy()
    return data if ggml_type == GGMLQuantizationType.F32 else quants.quantize(data, ggml_type)


def encoded_bytes(shape, ggml_type) -> int:
    from gguf import GGML_QUANT_SIZES

    block_size, type_size = GGML_QUANT_SIZES[ggml_type]
    return math.prod(shape) // block_size * type_size


def gguf_tensors(model, layout: Layout):
    """`(GGUF name, shape, weight)` for every weight, in the file's order and llama.cpp's layout (q and k rows
    permuted where its rotary pairs are interleaved); a head tied to the embedding is left out, as llama.cpp does (its
    absence is what says "tied" to llama.cpp and Transformers). `weight()` gives the tensor: a permuted copy exists
    only while it is written."""
    import gguf

    config = model.config
    names = gguf.get_tensor_name_map(getattr(gguf.MODEL_ARCH, layout.arch), config.num_hidden_layers)
    for hf_name, weight in model.state_dict().items():
        if hf_name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if name is None:
            raise RecipeError(f"--gguf: {type(model).__name__}'s weight {hf_name} has no GGUF name: export without "
                              "--gguf and convert with llama.cpp's convert_hf_to_gguf.py.")
        if layout.permute_query_key and ".attn_q." in name:
            heads = config.num_attention_heads
        elif layout.permute_query_key and ".attn_k." in name:
            heads = config.num_key_value_heads
        else:
            heads = None
        yield name, tuple(weight.shape), (lambda weight=weight, heads=heads: weight if heads is None
                                          else interleave_rotary_rows(weight, heads))


def check_convertible(model, tokenizer, gguf_type: str) -> tuple[Layout, dict]:
    """`(layout, tokenizer JSON)` once the model, tokenizer and type are ones a GGUF file holds; else the reason."""
    if gguf_type not in GGUF_TYPES:
        raise RecipeError(f"--gguf-type {gguf_type} is not one of {', '.join(GGUF_TYPES)}.")
    layout = layout_of(model)
    tokenizer_json = check_tokenizer(tokenizer)
    if len(tokenizer) > model.config.vocab_size:
        raise RecipeError(f"--gguf: the tokenizer has {len(tokenizer)} tokens but the model embeds "
                          f"{model.config.vocab_size}: export the tokenizer the model was trained with.")
    return layout, tokenizer_json


def gguf_bytes(model, gguf_type: str) -> int:
    """About the size of `model`'s GGUF file of `gguf_type`, as `encoded` stores its tensors: 1-D ones in F32, the
    rest in F16 or Q8_0 (34 bytes a block of 32: int8 weights and an f16 scale); a tied head is not written."""
    per_weight = 34 / 32 if gguf_type == "q8_0" else 2
    tied = model.config.tie_word_embeddings
    return int(sum(weight.numel() * (4 if weight.ndim <= 1 else per_weight)
                   for name, weight in model.state_dict().items() if not (tied and name == "lm_head.weight")))


def write_gguf(model, tokenizer, path: Path, gguf_type: str = "f16", name: str | None = None) -> Path:
    """`model` (merged weights) and `tokenizer` (with the chat template training used) as the one GGUF file `path`,
    written beside it first and moved into place whole."""
    import gguf

    layout, tokenizer_json = check_convertible(model, tokenizer, gguf_type)
    file_type = gguf.LlamaFileType.MOSTLY_Q8_0 if gguf_type == "q8_0" else gguf.LlamaFileType.MOSTLY_F16
    partial = path.with_name(path.name + ".partial")
    writer = gguf.GGUFWriter(partial, gguf.MODEL_ARCH_NAMES[getattr(gguf.MODEL_ARCH, layout.arch)])
    try:  # nothing half-written is left under `path`'s name
        write_hyperparameters(writer, model.config, name or path.stem, file_type)
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
        write_tokenizer(writer, tokenizer, tokenizer_json, model.config.vocab_size)
        # Streamed: every tensor's name, shape and type first (the header and the tensor index come before the
        # data), then each tensor encoded, written and dropped in turn, so the encoded model is never held whole
        # (gguf's `add_tensor` keeps every array until `write_tensors_to_file`: twice the model in host RAM).
        weights = list(gguf_tensors(model, layout))
        with torch.no_grad():
            for tensor_name, shape, _ in weights:
                ggml_type = ggml_type_of(shape, gguf_type)
                writer.add_tensor_info(tensor_name, shape, np.float32, encoded_bytes(shape, ggml_type),
                                       raw_dtype=ggml_type)
            writer.write_header_to_file()
            writer.write_kv_data_to_file()
            writer.write_ti_data_to_file()
            for _, shape, weight in weights:
                writer.write_tensor_data(encoded(weight(), ggml_type_of(shape, gguf_type)))
    except BaseException:
        writer.close()
        partial.unlink(missing_ok=True)
        raise
    writer.close()
    partial.replace(path)
    return path
