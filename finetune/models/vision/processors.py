"""A vision-language model's processor, as Transformers builds it (`AutoProcessor`), and its image-only form.

Qwen2-VL's processor (and Qwen2.5-VL's, Qwen3-VL's) carries a video processor that needs torchvision; a machine without
it cannot build the processor at all, even to read images (`AutoProcessor.from_pretrained` raises ImportError). Its
image-only form is the same class without the video processor: the same tokens, expansion and image inputs, built from
the same files. It is used only where the video half cannot be built (torchvision missing, or no video processor saved
in the folder), said on stderr with the reason; a video is then refused by name.
"""

from __future__ import annotations

import sys

from transformers.processing_utils import ProcessorMixin

# The processors whose video half needs torchvision, by class name
VIDEO_BACKED = {"Qwen2VLProcessor", "Qwen2_5_VLProcessor"}


def image_only(processor_class: type) -> type:
    """`processor_class` without its video processor: what it does with images, nothing with videos."""

    class ImageOnly(processor_class):
        def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
            self.image_token = getattr(tokenizer, "image_token", None) or "<|image_pad|>"
            self.video_token = getattr(tokenizer, "video_token", None) or "<|video_pad|>"
            self.image_token_id = getattr(tokenizer, "image_token_id", None) or \
                tokenizer.convert_tokens_to_ids(self.image_token)
            self.video_token_id = getattr(tokenizer, "video_token_id", None) or \
                tokenizer.convert_tokens_to_ids(self.video_token)
            ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)

        def __call__(self, images=None, text=None, videos=None, **kwargs):
            if videos is not None:
                raise ValueError(f"{processor_class.__name__} was built without its video processor (torchvision is "
                                 "not installed): videos cannot be read here.")
            return super().__call__(images=images, text=text, **kwargs)

    ImageOnly.__name__ = ImageOnly.__qualname__ = processor_class.__name__
    return ImageOnly


def load_processor(path: str):
    """The processor saved with a model (`processor_config.json` and the files beside it): `AutoProcessor`'s, or its
    image-only form where its video half cannot be built: torchvision is not installed, or the folder holds no video
    processor (saved in image-only form)."""
    from transformers import AutoImageProcessor, AutoProcessor, AutoTokenizer

    name = _processor_class(path)
    why = _no_video_half(path) if name in VIDEO_BACKED else None
    if why is None:
        return AutoProcessor.from_pretrained(path)
    import transformers

    print(f"note: {name} without its video processor ({why}): reading images only.", file=sys.stderr)
    processor_class = image_only(getattr(transformers, name))
    return processor_class(image_processor=AutoImageProcessor.from_pretrained(path, backend="pil"),
                           tokenizer=AutoTokenizer.from_pretrained(path),
                           chat_template=_chat_template(path))


def _no_video_half(path: str) -> str | None:
    """Why a video-backed processor saved in `path` cannot build its video half here, or None."""
    import importlib.util
    import json
    from pathlib import Path

    if importlib.util.find_spec("torchvision") is None:
        return "it needs torchvision, which is not installed"
    config = Path(path) / "processor_config.json"
    saved = config.is_file() and "video_processor" in json.loads(config.read_text())
    if not saved and not (Path(path) / "video_preprocessor_config.json").is_file():
        return "none was saved with it"
    return None


def _processor_class(path: str) -> str | None:
    import json
    from pathlib import Path

    for name in ("processor_config.json", "preprocessor_config.json", "tokenizer_config.json"):
        file = Path(path) / name
        if file.is_file():
            found = json.loads(file.read_text()).get("processor_class")
            if found:
                return found
    return None


def _chat_template(path: str) -> str | None:
    from pathlib import Path

    file = Path(path) / "chat_template.jinja"
    return file.read_text() if file.is_file() else None


def vision_processor(model_args):
    """The processor of the recipe's vision-language model (`tiny-vl`: built in code), its image sizes bounded by the
    recipe's `min_pixels`/`max_pixels`, its chat template the recipe's `chat_template` when given; returned as its
    tokenizer carrying it (finetune.models.vision.with_processor), which is what the pipeline's stages take."""
    from finetune.models.loading import check_local_path, loading_refusals
    from finetune.models.vision import with_processor
    from finetune.models.vision.presets import TINY_VL_MODEL, build_processor

    name = model_args.tokenizer_name_or_path or model_args.model_name_or_path
    if name == TINY_VL_MODEL:
        processor = build_processor()
    else:
        check_local_path(name, "model_name_or_path")
        with loading_refusals(model_args):
            processor = load_processor(name)
    bound_image_sizes(processor, model_args.min_pixels, model_args.max_pixels)
    tokenizer = processor.tokenizer
    if tokenizer.pad_token is None:  # padding positions carry label -100 and attention 0
        tokenizer.pad_token = tokenizer.eos_token
    if processor.chat_template is None:
        processor.chat_template = tokenizer.chat_template
    if processor.chat_template is None:
        from finetune.errors import RecipeError

        raise RecipeError(f"the processor of {name} has no chat template, which places each image in the "
                          "conversation: give one with `chat_template` (the model card's).")
    return with_processor(processor)


def bound_image_sizes(processor, min_pixels: int | None, max_pixels: int | None) -> None:
    """Sets the pixel bounds an image is resized within (Qwen2-VL's family: `size`'s shortest and longest edge, in
    pixels); refused by name for a processor that resizes otherwise."""
    if min_pixels is None and max_pixels is None:
        return
    from finetune.errors import RecipeError

    image_processor = processor.image_processor
    size = getattr(image_processor, "size", None)
    if getattr(image_processor, "merge_size", None) is None or getattr(size, "longest_edge", None) is None:
        raise RecipeError(f"`min_pixels`/`max_pixels`: {type(image_processor).__name__} does not resize by a pixel "
                          "count (Qwen2-VL's family does); drop them, its images take the size its config sets.")
    low = min_pixels if min_pixels is not None else size.shortest_edge
    high = max_pixels if max_pixels is not None else size.longest_edge
    if low > high:
        raise RecipeError(f"`min_pixels: {low}` is more than `max_pixels: {high}`.")
    image_processor.size = type(size)(shortest_edge=low, longest_edge=high)
