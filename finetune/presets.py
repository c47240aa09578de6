"""The embedded default: a tiny Llama-style model, a byte-level tokenizer built in code, and a synthetic dataset.

Nothing here is downloaded; `model_name_or_path: tiny` and `dataset: synthetic` select these presets.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

TINY_MODEL = "tiny"
SYNTHETIC_DATASET = "synthetic"

# Role markers and the end-of-turn marker are single special tokens, so a turn costs few tokens.
SPECIAL_TOKENS = ["<|pad|>", "<|end|>", "<|system|>", "<|user|>", "<|assistant|>"]

# A ChatML-like template without newlines: every character counts on a byte-level vocabulary. Turns end with the
# tokenizer's EOS (`<|end|>` for the tiny tokenizer), so a base model given this template learns to stop.
# `{% generation %}` marks the assistant's tokens so `return_assistant_tokens_mask` can find them.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}"
    "<|assistant|>{% generation %}{{ message['content'] }}{{ eos_token }}{% endgeneration %}"
    "{% else %}"
    "<|{{ message['role'] }}|>{{ message['content'] }}{{ eos_token }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

# About 0.5M parameters: learns the synthetic tasks in a couple of CPU minutes.
TINY_MODEL_CONFIG = dict(
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,
    max_position_embeddings=256,
    tie_word_embeddings=True,
    rms_norm_eps=1e-5,
)


def build_tokenizer():
    """A byte-level BPE tokenizer with no merges: one token per byte, plus the special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {symbol: index for index, symbol in enumerate(alphabet)}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(SPECIAL_TOKENS)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        pad_token="<|pad|>",
        eos_token="<|end|>",
        chat_template=CHAT_TEMPLATE,
        padding_side="right",
        model_max_length=TINY_MODEL_CONFIG["max_position_embeddings"],
    )


def build_model_config(tokenizer):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        **TINY_MODEL_CONFIG,
    )


def build_model(tokenizer, seed: int = 0, dtype=None):
    """A randomly initialised tiny Llama; the same seed gives the same weights on every rank."""
    from transformers import LlamaForCausalLM

    return seeded_model(LlamaForCausalLM, build_model_config(tokenizer), tokenizer, seed, dtype)


def seeded_model(model_class, config, tokenizer, seed: int = 0, dtype=None):
    """`model_class(config)` with weights drawn from `seed` (the same on every rank, the global RNG untouched), in
    `dtype`, generating with the tokenizer's pad and end tokens."""
    import torch

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_class(config)
    if dtype is not None:
        model = model.to(dtype)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model


def synthetic_data_dir() -> Path:
    """Where the generated synthetic dataset ships inside the package."""
    return Path(str(resources.files("finetune") / "datasets" / SYNTHETIC_DATASET))
