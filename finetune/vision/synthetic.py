"""Images drawn in code, with questions a small vision-language model can learn to answer: a coloured shape (square,
circle or triangle, in one of four colours) at a random place and size on a light background, asked its colour or
its shape. Seeded: the same seed draws the same rows on every rank."""

from __future__ import annotations

import random

COLOURS = {"red": (220, 40, 40), "green": (40, 170, 60), "blue": (40, 70, 220), "yellow": (230, 200, 30)}
SHAPES = ("square", "circle", "triangle")
QUESTIONS = {"colour": "What colour is the shape?", "shape": "What shape is this?"}


def draw(shape: str, colour: str, side: int = 32, rng: random.Random | None = None):
    """A `side` × `side` image of one `shape` in `colour`: its size and place drawn from `rng`."""
    from PIL import Image, ImageDraw

    rng = rng or random.Random(0)
    background = tuple(rng.randint(225, 255) for _ in range(3))
    image = Image.new("RGB", (side, side), background)
    size = rng.randint(side // 2, side - 4)
    left, top = rng.randint(0, side - size), rng.randint(0, side - size)
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
    """`count` rows in TRL's format: `messages` whose user turn holds an image part and a question, and `images`."""
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
        })
    return out
