"""A conversation with images as a vision-language model's inputs, with labels on the assistant's tokens only.

The model's own processor renders the conversation (its chat template puts each image's placeholder where the image
part is), expands each placeholder into the image's tokens and computes the image inputs (`pixel_values`, and what the
model needs beside them: Qwen2-VL's `image_grid_thw` and `mm_token_type_ids`). The learned characters of each
assistant turn are found in the rendered text as the text path finds them (finetune.data.tokenize): from where the
conversation rendered up to the turn stops agreeing with the prompt rendered with the generation prompt, to the last
special token of the turn (`<|im_end|>`, EOS), so the model learns to stop; they are then carried through the
processor's expansion (`text_replacement_offsets`) to its tokens. No image token, no prompt token and no user text is
ever learned; a turn whose text is not where the template put it is refused by name, never trained on shifted labels.
"""

from __future__ import annotations

import bisect

from finetune.data.tokenize import IGNORE_INDEX
from finetune.errors import RecipeError


def image_parts(messages: list[dict]) -> int:
    """How many image parts a conversation holds (`{"type": "image"}` in a message's content list)."""
    return sum(1 for message in messages if isinstance(message.get("content"), list)
               for part in message["content"] if isinstance(part, dict) and part.get("type") == "image")


def answer_text(message: dict) -> str:
    """An assistant message's text: its content string, or its text parts joined."""
    content = message.get("content")
    if isinstance(content, str):
        return content
    return "".join(part.get("text", "") for part in content or [] if isinstance(part, dict)
                   and part.get("type") == "text")


def encode_vision_conversation(messages: list[dict], images: list, processor) -> dict:
    """The model's inputs for one conversation (`input_ids`, `labels`, and the processor's image inputs, unbatched:
    `pixel_values` of all its images' patches, `image_grid_thw` one row an image, ...). `images` are PIL images, in
    the order of the image parts."""
    parts = image_parts(messages)
    if parts != len(images):
        raise RecipeError(f"the conversation has {parts} image part(s) and {len(images)} image(s): give one image "
                          "for each `{\"type\": \"image\"}` part, in order.")
    text = _render(processor, messages)
    spans = [_learned_span(processor, messages, index, text) for index, message in enumerate(messages)
             if message["role"] == "assistant"]
    encoded = processor(text=[text], images=images or None, return_offsets_mapping=True,
                        return_text_replacement_offsets=True)
    input_ids = list(encoded["input_ids"][0])
    offsets = encoded["offset_mapping"][0]
    replaced = (encoded.get("text_replacement_offsets") or [[]])[0]
    ends = [replacement["span"][1] for replacement in replaced]
    gained = [0]
    for replacement in replaced:
        gained.append(replacement["new_span"][1] - replacement["span"][1])
    image_ids = image_token_ids(processor)
    labels = [IGNORE_INDEX] * len(input_ids)
    for span in spans:
        if span is None:
            continue
        start, end = (char + gained[bisect.bisect_right(ends, char)] for char in span)
        for position, (token_start, token_end) in enumerate(offsets):
            if token_start < end and token_end > start and input_ids[position] not in image_ids:
                labels[position] = input_ids[position]
    inputs = {"input_ids": input_ids, "labels": labels}
    for key, value in encoded.items():
        if key not in ("input_ids", "attention_mask", "offset_mapping", "text_replacement_offsets"):
            inputs[key] = value if key in ("pixel_values", "image_grid_thw") else list(value[0])
    return inputs


def _render(processor, messages, add_generation_prompt=False) -> str:
    from jinja2.exceptions import TemplateError

    try:
        return processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    except (TemplateError, TypeError, ValueError) as error:
        raise RecipeError(f"the processor's chat template cannot render the conversation: {error}.") from None


def _learned_span(processor, messages, index: int, text: str) -> tuple[int, int] | None:
    """The characters of assistant turn `index` the model learns, in the whole conversation's `text`; None for an
    empty answer (it would teach only to stop)."""
    message = messages[index]
    answer = answer_text(message).strip()
    if not answer:
        return None
    prompt = _render(processor, messages[:index], add_generation_prompt=True)
    upto = _render(processor, messages[: index + 1])
    if not text.startswith(upto):
        raise RecipeError(f"the processor's chat template renders assistant turn {index} differently once the "
                          "conversation goes on: its labels cannot be placed.")
    start = next((i for i, (a, b) in enumerate(zip(prompt, upto)) if a != b), min(len(prompt), len(upto)))
    closers = [token for token in processor.tokenizer.all_special_tokens if token]
    end = max((upto.rfind(token) + len(token) for token in closers if upto.rfind(token) >= start), default=-1)
    if end < 0 or answer not in upto[start:end]:
        raise RecipeError(f"assistant turn {index} (`{answer[:40]}`) is not where the processor's chat template puts "
                          "it, closed by a special token: its labels cannot be placed.")
    return start, end


def image_token_ids(processor) -> set[int]:
    """The ids the processor expands an image into, and the vision markers around them: never learned."""
    added = processor.tokenizer.added_tokens_encoder  # the added tokens only: no walk of the whole vocabulary
    ids = {getattr(processor, "image_token_id", None), getattr(processor, "video_token_id", None)}
    ids.update(added.get(name) for name in ("<|vision_start|>", "<|vision_end|>", "<start_of_image>", "<end_of_image>",
                                            "<image>"))
    return {token for token in ids if token is not None}


def image_token_count(processor, height: int, width: int) -> int:
    """The tokens an image of `height` × `width` pixels becomes, by the processor's resize rules (Qwen2-VL's family:
    the image resized within its pixel bounds to a multiple of the patch × merge size, one token per merged patch
    group) or its fixed count (LLaVA's `image_seq_length`), without computing a pixel."""
    count = getattr(processor, "_get_num_multimodal_tokens", None)
    if count is not None:
        try:
            return int(count(image_sizes=[[height, width]]).num_image_tokens[0])
        except (NotImplementedError, AttributeError, TypeError):
            pass
    fixed = getattr(processor, "image_seq_length", None)
    if fixed is None:
        raise RecipeError(f"{type(processor).__name__} says neither how many tokens an image becomes nor a fixed "
                          "count (`image_seq_length`): its images cannot be planned.")
    return int(fixed)

