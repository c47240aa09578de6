"""Rows with images in the formats of TRL, axolotl, OpenAI, LLaVA and LLaMA-Factory (written from their documented
schemas) read as the same messages and images, encode with labels on the answers only, and each bad input is one
line naming the row."""

import base64
import io

import pytest
from PIL import Image

from finetune.data.tokenize import IGNORE_INDEX
from finetune.data.vision.data import vision_example
from finetune.data.vision.encode import encode_vision_conversation
from finetune.errors import RecipeError
from finetune.models.vision.presets import build_processor

RED = (220, 40, 40)


def png(colour=RED, size=(24, 20)) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", size, colour).save(buffer, format="PNG")
    return buffer.getvalue()


def claimed_size_png(width: int, height: int) -> bytes:
    """A 1 × 1 PNG whose header claims `width` × `height` pixels (a decompression bomb's header)."""
    import struct
    import zlib

    data = bytearray(png(size=(1, 1)))
    header = struct.pack(">II", width, height) + bytes(data[24:29])
    data[16:29] = header
    data[29:33] = struct.pack(">I", zlib.crc32(b"IHDR" + header))
    return bytes(data)


@pytest.fixture()
def data_dir(tmp_path):
    (tmp_path / "images").mkdir()
    (tmp_path / "images" / "red.png").write_bytes(png())
    (tmp_path / "broken.png").write_bytes(b"not an image")
    return tmp_path


QUESTION, ANSWER = "What colour is it?", "red"
FORMATS = {
    "trl": {"messages": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]},
                         {"role": "assistant", "content": [{"type": "text", "text": ANSWER}]}],
            "images": ["images/red.png"]},
    "trl-datasets-image": {"messages": [{"role": "user", "content": [{"type": "image"},
                                                                     {"type": "text", "text": QUESTION}]},
                                        {"role": "assistant", "content": ANSWER}],
                           "images": [{"bytes": png(), "path": None}]},
    "axolotl-path": {"messages": [{"role": "user", "content": [{"type": "image", "path": "images/red.png"},
                                                               {"type": "text", "text": QUESTION}]},
                                  {"role": "assistant", "content": [{"type": "text", "text": ANSWER}]}]},
    "axolotl-base64": {"messages": [{"role": "user", "content": [
        {"type": "image", "base64": base64.b64encode(png()).decode()}, {"type": "text", "text": QUESTION}]},
        {"role": "assistant", "content": ANSWER}]},
    "openai-data-url": {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(png()).decode()}},
        {"type": "text", "text": QUESTION}]}, {"role": "assistant", "content": ANSWER}]},
    "llava": {"image": "images/red.png", "conversations": [{"from": "human", "value": f"<image>\n{QUESTION}"},
                                                           {"from": "gpt", "value": ANSWER}]},
    "llama-factory": {"messages": [{"role": "user", "content": f"<image>{QUESTION}"},
                                   {"role": "assistant", "content": ANSWER}], "images": ["images/red.png"]},
}


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_each_format_reads_as_the_same_conversation_and_learns_only_the_answer(name, data_dir):
    messages, images = vision_example(FORMATS[name], 7, data_dir)
    assert messages == [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]},
                        {"role": "assistant", "content": [{"type": "text", "text": ANSWER}]}]
    assert len(images) == 1 and images[0].mode == "RGB" and images[0].getpixel((0, 0)) == RED
    processor = build_processor()
    encoded = encode_vision_conversation(messages, images, processor)
    learned = [token for token, label in zip(encoded["input_ids"], encoded["labels"]) if label != IGNORE_INDEX]
    assert processor.tokenizer.decode(learned) == ANSWER + processor.tokenizer.eos_token


@pytest.mark.parametrize("row, message", [
    ({"messages": FORMATS["trl"]["messages"], "images": ["images/missing.png"]},
     r"^row 3: image `images/missing.png` does not exist \(relative to .*\)\.$"),
    ({"messages": FORMATS["trl"]["messages"], "images": ["https://example.com/cat.png"]},
     r"^row 3: image `https://example.com/cat.png` is a URL; nothing is downloaded at run time"),
    ({"messages": FORMATS["trl"]["messages"], "images": ["broken.png"]},
     r"^row 3: `broken.png` is not an image that can be read: "),
    ({"messages": FORMATS["trl"]["messages"], "images": [b"\x89PNG\r\n\x1a\n" + b"\0" * 64]},
     r"^row 3: the image is not an image that can be read: "),
    ({"messages": FORMATS["trl"]["messages"], "images": [claimed_size_png(50_000, 50_000)]},
     r"^row 3: the image is not an image that can be read: Image size \(2500000000 pixels\) exceeds limit"),
    ({"messages": FORMATS["trl"]["messages"], "images": [None]},
     r"^row 3: an image given as NoneType; expected a path, bytes, a data: URL or a datasets Image\.$"),
    ({"messages": FORMATS["trl"]["messages"], "images": []},
     r"^row 3: 1 image marker\(s\) or part\(s\) and 0 image\(s\)"),
    ({"conversations": [{"from": "human", "value": "<image><image>Same?"}, {"from": "gpt", "value": "yes"}],
      "images": ["images/red.png"]}, r"^row 3: 2 image marker\(s\) or part\(s\) and 1 image\(s\)"),
    ({"messages": [{"role": "user", "content": [{"type": "video"}]}]}, r"^row 3: a content part of type `video`"),
    ({"messages": FORMATS["axolotl-path"]["messages"], "images": ["images/red.png"]},
     r"^row 3: images both inside the messages' parts and in an `images` column"),
])
def test_a_bad_row_is_one_line_naming_it(row, message, data_dir):
    with pytest.raises(RecipeError, match=message) as refused:
        vision_example(row, 3, data_dir)
    assert "\n" not in str(refused.value)
