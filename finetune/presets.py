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


# --- the embedded tiny vision-language model (`model_name_or_path: tiny-vl`) -----------------------------------------
# Qwen2-VL's architecture (its vision tower, its merger, M-RoPE) at toy widths, over the tiny tokenizer extended by
# Qwen2-VL's vision tokens, with a chat template rendering image parts as Qwen2-VL's does. Its config lives here, where
# the planner reads shapes; finetune.models.vision.presets builds the model and its processor.
TINY_VL_MODEL = "tiny-vl"
VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]

# The tiny vision-language chat template, content given as a list of parts: images as Qwen2-VL's placeholder, text as
# is.
VL_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['content'] is string %}{% set content = message['content'] %}"
    "{% else %}{% set content = namespace(text='') %}"
    "{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}"
    "{% set content.text = content.text + '<|vision_start|><|image_pad|><|vision_end|>' %}"
    "{% elif part['type'] == 'text' %}{% set content.text = content.text + part['text'] %}{% endif %}"
    "{% endfor %}{% set content = content.text %}{% endif %}"
    "{% if message['role'] == 'assistant' %}"
    "<|assistant|>{% generation %}{{ content }}{{ eos_token }}{% endgeneration %}"
    "{% else %}"
    "<|{{ message['role'] }}|>{{ content }}{{ eos_token }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

VL_VISION_CONFIG = dict(depth=2, embed_dim=64, num_heads=2, mlp_ratio=2, patch_size=8, temporal_patch_size=2,
                        spatial_merge_size=2)
VL_TEXT_CONFIG = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=3, num_attention_heads=4,
                      num_key_value_heads=4, max_position_embeddings=512, rms_norm_eps=1e-5,
                      rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 6, 6]})


def build_vl_tokenizer():
    """The tiny tokenizer extended by Qwen2-VL's vision tokens, with the tiny vision-language chat template."""
    tokenizer = build_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": VISION_TOKENS})
    tokenizer.chat_template = VL_CHAT_TEMPLATE
    tokenizer.model_max_length = VL_TEXT_CONFIG["max_position_embeddings"]
    return tokenizer


def build_vl_config(tokenizer):
    """The tiny Qwen2-VL's config, its vocabulary and vision token ids those of `tokenizer` (the processor's)."""
    from transformers import Qwen2VLConfig

    token = tokenizer.convert_tokens_to_ids
    return Qwen2VLConfig(
        text_config=dict(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                         eos_token_id=tokenizer.eos_token_id, bos_token_id=None, **VL_TEXT_CONFIG),
        vision_config=dict(hidden_size=VL_TEXT_CONFIG["hidden_size"], **VL_VISION_CONFIG),
        image_token_id=token("<|image_pad|>"), video_token_id=token("<|video_pad|>"),
        vision_start_token_id=token("<|vision_start|>"), vision_end_token_id=token("<|vision_end|>"),
        tie_word_embeddings=True)
