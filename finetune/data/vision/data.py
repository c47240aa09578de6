"""Rows with images, in the formats the peers read, as chat-template messages (content as parts) and their images.

- TRL and the alignment handbook: `messages` whose content lists `{"type": "image"}` and `{"type": "text", "text"}`
  parts, with the images in an `images` column, in the order of the image parts.
- axolotl: the same `messages`, each image given inside its part (`path`, `url`, `base64` or `image`).
- OpenAI: `{"type": "image_url", "image_url": {"url": ...}}` parts (a `data:` URL carries the image).
- LLaVA and LLaMA-Factory: ShareGPT `conversations` ({from, value}) or `messages` whose text holds `<image>` markers,
  with `images` (a list) or LLaVA's `image` (one path).

An image is a path (relative to the data file's folder), the bytes of a file, a `data:` URL, a `datasets` Image
value ({bytes, path}) or a PIL image; a web URL is refused by name (nothing is downloaded at run time). A missing or
unreadable image, or a marker count that differs from the image count, is one line naming the row.
"""

from __future__ import annotations

import base64
import io
import re
from pathlib import Path

from finetune.data.formats import SHAREGPT_ROLES, openai_message
from finetune.errors import RecipeError

MARKER = "<image>"
INLINE_KEYS = ("path", "url", "base64", "image")


def vision_example(example: dict, row, data_dir: str | Path | None = None) -> tuple[list[dict], list]:
    """`(messages, images)` of one row: messages whose image content is `{"type": "image"}` parts, and the images as
    RGB PIL images in their order. `row` names the row in errors."""
    messages, images, _ = vision_row(example, f"row {row}", data_dir)
    return messages, images


def vision_row(example: dict, where: str, data_dir: str | Path | None = None) -> tuple[list[dict], list, list[dict]]:
    """`(messages, images, stored)` of one row: as `vision_example`, and each image as a dataset keeps it
    (`stored_image`); `where` begins each error."""
    try:
        messages, given = _messages_and_images(example)
        parts = sum(1 for message in messages for part in message["content"] if part["type"] == "image")
        if len(given) != parts:
            raise RecipeError(f"{parts} image marker(s) or part(s) and {len(given)} image(s): give one image for each, "
                              "in order.")
        return messages, [read_image(image, data_dir) for image in given], [stored_image(image, data_dir)
                                                                             for image in given]
    except RecipeError as error:
        raise RecipeError(f"{where}: {error}") from None


def stored_image(image, data_dir: str | Path | None = None) -> dict:
    """An image as a `datasets` Image value keeps it, `{"bytes", "path"}`: a file by its path (resolved against the
    data file's folder; not copied), anything else by its bytes (a PIL image as PNG). `read_image` reads it back."""
    if isinstance(image, dict):
        image = image.get("bytes") or image.get("path")
    if isinstance(image, str) and image.startswith("data:"):
        return {"bytes": _data_url(image), "path": None}
    if isinstance(image, str | Path):
        path = Path(image) if Path(image).is_absolute() or data_dir is None else Path(data_dir) / image
        return {"bytes": None, "path": str(path.resolve())}
    if isinstance(image, bytes | bytearray):
        return {"bytes": bytes(image), "path": None}
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")  # a PIL image (checked readable by `read_image` first)
    return {"bytes": buffer.getvalue(), "path": None}


def _messages_and_images(example: dict) -> tuple[list[dict], list]:
    if "messages" in example:
        messages = [_with_parts(openai_message(message)) for message in example["messages"]]
    elif "conversations" in example:
        messages = []
        for turn in example["conversations"]:
            role = SHAREGPT_ROLES.get(turn.get("from"))
            if role is None:
                raise RecipeError(f"ShareGPT turn with `from: {turn.get('from')}`; expected one of "
                                  f"{', '.join(SHAREGPT_ROLES)}.")
            messages.append(_with_parts({"role": role, "content": turn.get("value")}))
    else:
        raise RecipeError("a row with images needs `messages` or `conversations`.")
    inline = [part.pop("source") for message in messages for part in message["content"] if "source" in part]
    images = example.get("images")
    if images is None and example.get("image") is not None:  # LLaVA: one image a row
        images = [example["image"]]
    if images is not None and not isinstance(images, list | tuple):
        images = [images]
    if inline and images:
        raise RecipeError("images both inside the messages' parts and in an `images` column: give them one way.")
    return messages, list(images or inline)


def _with_parts(message: dict) -> dict:
    """A message whose content is a list of parts, `<image>` markers in its text becoming image parts."""
    content = message.get("content")
    if content is None:
        content = ""
    if isinstance(content, str):
        parts = []
        for index, piece in enumerate(content.split(MARKER)):
            if index:
                parts.append({"type": "image"})
            if piece.strip():
                parts.append({"type": "text", "text": piece.strip("\n") if MARKER in content else piece})
        return {**message, "content": parts}
    if not isinstance(content, list):
        raise RecipeError(f"a message's content must be text or a list of parts, got {type(content).__name__}.")
    parts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text":
            parts.append({"type": "text", "text": str(part.get("text") or "")})
        elif kind == "image":
            source = next((part[key] for key in INLINE_KEYS if part.get(key) is not None), None)
            parts.append({"type": "image", **({"source": _inline(part, source)} if source is not None else {})})
        elif kind == "image_url":
            url = part.get("image_url")
            parts.append({"type": "image", "source": url.get("url") if isinstance(url, dict) else url})
        else:
            raise RecipeError(f"a content part of type `{kind}`; expected text, image or image_url.")
    return {**message, "content": parts}


def _inline(part: dict, source):
    return f"data:image;base64,{source}" if part.get("base64") is not None and isinstance(source, str) else source


def read_image(image, data_dir: str | Path | None = None):
    """One image as an RGB PIL image, from any of the forms the module docstring lists."""
    from PIL import Image, UnidentifiedImageError

    if isinstance(image, Image.Image):
        return image.convert("RGB")
    name, data = "the image", None
    if isinstance(image, dict):  # a `datasets` Image value
        image, name = image.get("bytes") or image.get("path"), image.get("path") or "the image"
    if isinstance(image, bytes | bytearray):
        data = bytes(image)
    elif isinstance(image, str) and image.startswith("data:"):
        name, data = "a data: URL", _data_url(image)
    elif isinstance(image, str) and re.match(r"^[a-z][a-z0-9+.-]*://", image, re.IGNORECASE):
        raise RecipeError(f"image `{image:.120}` is a URL; nothing is downloaded at run time: download it and give "
                          "its path (relative to the data file).")
    elif isinstance(image, str | Path):
        path = Path(image) if Path(image).is_absolute() or data_dir is None else Path(data_dir) / image
        name = f"`{image}`"
        if not path.is_file():
            where = f" (relative to {data_dir})" if data_dir is not None and not Path(image).is_absolute() else ""
            raise RecipeError(f"image {name} does not exist{where}.")
        data = path.read_bytes()
    else:
        raise RecipeError(f"an image given as {type(image).__name__}; expected a path, bytes, a data: URL or a "
                          "datasets Image.")
    try:
        with Image.open(io.BytesIO(data)) as opened:
            return opened.convert("RGB")
    except (UnidentifiedImageError, Image.DecompressionBombError, OSError, ValueError) as error:
        raise RecipeError(f"{name} is not an image that can be read: {error}.") from None


def _data_url(url: str) -> bytes:
    header, _, payload = url.partition(",")
    if ";base64" not in header:
        raise RecipeError("a data: URL image must be base64 (`data:image/png;base64,...`).")
    try:
        return base64.b64decode(payload, validate=True)
    except ValueError:
        raise RecipeError("a data: URL image is not valid base64.") from None
