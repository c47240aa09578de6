"""Vision-language fine-tuning: images in the data, the model's own processor in the pipeline.

- `presets`: the embedded tiny vision-language model (Qwen2-VL's architecture at toy widths, random weights) and its
  processor (the tiny tokenizer extended by Qwen2-VL's vision tokens, Qwen2-VL's image processor), built in code.
- `processors`: loading a model's processor; where a processor also handles videos through a backend this machine
  lacks (torchvision), its image-only form, said so once, videos refused by name.
- `encode`: a conversation with images as the model's inputs (`input_ids`, `pixel_values`, the model's extra inputs
  such as `image_grid_thw` and `mm_token_type_ids`) and labels on the assistant's tokens only.
- `collate`: batches of such rows, encoded as each batch is built (no pixels stored with the dataset).
- `data`: rows with images in the peers' formats, read as one conversation shape and RGB images.
- `synthetic`: images drawn in code (coloured shapes) with questions a model can learn to answer.
"""

from __future__ import annotations

import json
from pathlib import Path

# The attribute a vision-language model's tokenizer carries its processor under (`load_tokenizer` sets it): the
# pipeline's stages take the tokenizer, as for a text model, and ask it for the processor where images are involved
PROCESSOR_ATTRIBUTE = "vision_processor"


def processor_of(tokenizer):
    """The processor a vision-language model's tokenizer carries, or None (a text model's)."""
    return getattr(tokenizer, PROCESSOR_ATTRIBUTE, None)


def with_processor(processor):
    """The processor's tokenizer, carrying the processor (`processor_of`)."""
    tokenizer = processor.tokenizer
    setattr(tokenizer, PROCESSOR_ATTRIBUTE, processor)
    return tokenizer


def is_vision_model(name: str) -> bool:
    """Whether `name` is a vision-language model: the embedded `tiny-vl`; a folder whose config has a vision part
    (`vision_config`) with an image processor saved beside it; or a folder of a run that trained one (its processor
    saved, `processor_config.json`, or a LoRA adapter whose base is one)."""
    from finetune.models.vision.presets import TINY_VL_MODEL

    if name == TINY_VL_MODEL:
        return True
    folder = Path(name).expanduser()
    if (folder / "processor_config.json").is_file():
        return True
    adapter = _read_json(folder / "adapter_config.json")
    if adapter and adapter.get("base_model_name_or_path") and adapter["base_model_name_or_path"] != name:
        return is_vision_model(adapter["base_model_name_or_path"])
    config = _read_json(folder / "config.json")
    return bool(config) and "vision_config" in config and (folder / "preprocessor_config.json").is_file()


def _read_json(path: Path) -> dict | None:
    if not path.is_file():
        return None
    try:
        found = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return found if isinstance(found, dict) else None
