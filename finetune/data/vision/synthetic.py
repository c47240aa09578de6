"""Images drawn in code, with questions a small vision-language model can learn to answer: a coloured shape (square,
circle or triangle, in one of four colours) near the centre of a light background, 5/8 to 7/8 of the image wide,
asked its colour or its shape. Seeded: the same seed draws the same rows on every rank.

Measured on the tiny Qwen2-VL (finetune.models.vision.presets), one CPU process, 2,000 rows, 2 epochs at batch 16:
held-out exact match 0.98 of 60 rows (colour 1.0, shape 0.97) in 24 s. With the shape anywhere at half to nearly the
whole width, the shape question stayed near chance (0.37; 0.43 at 64 × 64 pixels and 4 epochs)."""

from __future__ import annotations

import random

COLOURS = {"red": (220, 40, 40), "green": (40, 170, 60), "blue": (40, 70, 220), "yellow": (230, 200, 30)}
SHAPES = ("square", "circle", "triangle")
QUESTIONS = {"colour": "What colour is the shape?", "shape": "What shape is this?"}


def draw(shape: str, colour: str, side: int = 32, rng: random.Random | None = None):
    """A `side` × `side` image of one `shape` in `colour`: its size and a pixel's shift from the centre drawn from
    `rng`."""
    from PIL import Image, ImageDraw

    rng = rng or random.Random(0)
    background = tuple(rng.randint(225, 255) for _ in range(3))
    image = Image.new("RGB", (side, side), background)
    size = rng.randint(side * 5 // 8, side * 7 // 8)
    left, top = (side - size) // 2 + rng.randint(-1, 1), (side - size) // 2 + rng.randint(-1, 1)
    box = (left, top, left + size - 1, top + size - 1)
    pen = ImageDraw.Draw(image)
    fill = COLOURS[colour]
    if shape == "square":
        pen.rectangle(box, fill=fill)
    elif shape == "circle":
        pen.ellipse(box, fill=fill)
    else:
        pen.polygon([(left + size // 2, top), (left, top + size - 1), (left + size - 1, top + size - 1)], fill=fill)
    return image


def rows(count: int, seed: int = 0, side: int = 32) -> list[dict]:
    """`count` rows in TRL's format: `messages` whose user turn holds an image part and a question, and `images`;
    `task` says which question (`colour` or `shape`), for exact match per task."""
    rng = random.Random(seed)
    out = []
    for index in range(count):
        shape, colour = rng.choice(SHAPES), rng.choice(list(COLOURS))
        asked = ("colour", "shape")[index % 2]
        out.append({
            "messages": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTIONS[asked]}]},
                         {"role": "assistant", "content": [{"type": "text",
                                                            "text": colour if asked == "colour" else shape}]}],
            "images": [draw(shape, colour, side, rng)],
            "task": asked,
        })
    return out


DATASET = "synthetic-shapes"  # `dataset: synthetic-shapes`: these rows, drawn in code
TRAIN_ROWS, EVAL_ROWS = 2000, 64


def splits():
    """The named dataset: `train` and `eval` splits of `rows`, drawn from different seeds (no eval image is a
    training one), the images as a `datasets` Image column."""
    from datasets import Dataset, DatasetDict

    return DatasetDict(train=Dataset.from_list(rows(TRAIN_ROWS, seed=0)), eval=Dataset.from_list(rows(EVAL_ROWS,
                                                                                                      seed=1)))
