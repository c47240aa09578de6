"""The embedded tiny vision-language model: Qwen2-VL's architecture (its vision tower, its merger, M-RoPE) at toy
widths with random weights, and its processor: the tiny byte-level tokenizer (finetune.presets) extended by Qwen2-VL's
vision tokens, Qwen2-VL's image processor at a small patch, and the tiny chat template rendering image parts as
Qwen2-VL's do (`<|vision_start|><|image_pad|><|vision_end|>`). Nothing is downloaded; `model_name_or_path: tiny-vl`
selects it."""

from __future__ import annotations

from finetune import presets

TINY_VL_MODEL = "tiny-vl"
VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]

# The tiny chat template, with content given as a list of parts: images as Qwen2-VL's placeholder, text as is.
CHAT_TEMPLATE = (
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

# An image of 32 × 32 pixels is 16 patches of 8 × 8, merged 2 × 2 into 4 tokens; images are resized to between
# 16 × 16 and 64 × 64 pixels (as Qwen2-VL's min_pixels and max_pixels bound them, in multiples of 16).
IMAGE_PROCESSOR = dict(patch_size=8, temporal_patch_size=2, merge_size=2, min_pixels=16 * 16, max_pixels=64 * 64)
VISION_CONFIG = dict(depth=2, embed_dim=64, num_heads=2, mlp_ratio=2, patch_size=8, temporal_patch_size=2,
                     spatial_merge_size=2)
TEXT_CONFIG = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=3, num_attention_heads=4,
                   num_key_value_heads=4, max_position_embeddings=512, rms_norm_eps=1e-5,
                   rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 6, 6]})


def build_processor():
    """Qwen2-VL's processor over the tiny tokenizer, in its image-only form (finetune.vision.processors): the same
    class, image tokens and expansion, and no video half, which would need torchvision."""
    from transformers import Qwen2VLProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from finetune.vision.processors import image_only

    tokenizer = presets.build_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": VISION_TOKENS})
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.model_max_length = TEXT_CONFIG["max_position_embeddings"]
    return image_only(Qwen2VLProcessor)(image_processor=Qwen2VLImageProcessorPil(**IMAGE_PROCESSOR),
                                        tokenizer=tokenizer, chat_template=CHAT_TEMPLATE)


def build_model(processor, seed: int = 0, dtype=None):
    """A randomly initialised tiny Qwen2-VL; the same seed gives the same weights on every rank."""
    from transformers import Qwen2VLForConditionalGeneration

    tokenizer = processor.tokenizer
    return presets.seeded_model(Qwen2VLForConditionalGeneration, build_config(tokenizer), tokenizer, seed, dtype)


def build_config(tokenizer):
    """The tiny Qwen2-VL's config, its vocabulary and vision token ids those of `tokenizer` (the processor's)."""
    from transformers import Qwen2VLConfig

    token = tokenizer.convert_tokens_to_ids
    return Qwen2VLConfig(
        text_config=dict(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                         eos_token_id=tokenizer.eos_token_id, bos_token_id=None, **TEXT_CONFIG),
        vision_config=dict(hidden_size=TEXT_CONFIG["hidden_size"], **VISION_CONFIG),
        image_token_id=token("<|image_pad|>"), video_token_id=token("<|video_pad|>"),
        vision_start_token_id=token("<|vision_start|>"), vision_end_token_id=token("<|vision_end|>"),
        tie_word_embeddings=True)
