"""The embedded tiny vision-language model: Qwen2-VL's architecture (its vision tower, its merger, M-RoPE) at toy
widths with random weights, and its processor: the tiny byte-level tokenizer (finetune.presets) extended by Qwen2-VL's
vision tokens, Qwen2-VL's image processor at a small patch, and the tiny chat template rendering image parts as
Qwen2-VL's do (`<|vision_start|><|image_pad|><|vision_end|>`). Nothing is downloaded; `model_name_or_path: tiny-vl`
selects it."""

from __future__ import annotations

from finetune import presets
from finetune.presets import TINY_VL_MODEL, VISION_TOKENS  # noqa: F401  (the names the preset is known by)

# An image of 32 × 32 pixels is 16 patches of 8 × 8, merged 2 × 2 into 4 tokens; images are resized to between
# 16 × 16 and 64 × 64 pixels (as Qwen2-VL's min_pixels and max_pixels bound them, in multiples of 16).
IMAGE_PROCESSOR = dict(patch_size=8, temporal_patch_size=2, merge_size=2, min_pixels=16 * 16, max_pixels=64 * 64)


def build_processor():
    """Qwen2-VL's processor over the tiny tokenizer, in its image-only form (finetune.models.vision.processors): the
    same class, image tokens and expansion, and no video half, which would need torchvision."""
    from transformers import Qwen2VLProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from finetune.models.vision.processors import image_only

    tokenizer = presets.build_vl_tokenizer()
    return image_only(Qwen2VLProcessor)(image_processor=Qwen2VLImageProcessorPil(**IMAGE_PROCESSOR),
                                        tokenizer=tokenizer, chat_template=presets.VL_CHAT_TEMPLATE)


def build_model(processor, seed: int = 0, dtype=None):
    """A randomly initialised tiny Qwen2-VL; the same seed gives the same weights on every rank."""
    from transformers import Qwen2VLForConditionalGeneration

    tokenizer = processor.tokenizer
    return presets.seeded_model(Qwen2VLForConditionalGeneration, presets.build_vl_config(tokenizer), tokenizer, seed,
                                dtype)
