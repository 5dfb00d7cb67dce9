"""The built-in vision task ``squares``: "How many squares?" about a picture drawn on the fly.

A 56x56 picture (the tiny VLM's image processor makes it 4 image tokens, one per 28x28 cell)
with a white square, at a small random offset, in 1 to 4 of its four cells; the answer is how
many. A reply that starts with the count scores 1.0, one that starts with another count 0.1 (a
random policy rarely starts with a digit: the partial score is what it learns the format from),
anything else 0. Counting needs the picture: no reply without it scores above 0.325 on average
(the best blind guess is right a quarter of the time)."""

from __future__ import annotations

import random

from rlhpc.data.images import PLACEHOLDER, from_png

SIZE, CELL, SQUARE = 56, 28, 16
QUESTION = "How many squares?"


def picture(cells: list[int], rng: random.Random):
    """A black picture with a white square in each of ``cells`` (0-3: top left, top right, bottom left, bottom right)."""
    from PIL import Image, ImageDraw

    img = Image.new("RGB", (SIZE, SIZE))
    draw = ImageDraw.Draw(img)
    for c in cells:
        x = (c % 2) * CELL + rng.randint(2, CELL - SQUARE - 2)
        y = (c // 2) * CELL + rng.randint(2, CELL - SQUARE - 2)
        draw.rectangle([x, y, x + SQUARE - 1, y + SQUARE - 1], fill=(255, 255, 255))
    return img


def make(count: int, rng: random.Random) -> list[dict]:
    rows = []
    for i in range(count):
        n = rng.randint(1, 4)
        cells = sorted(rng.sample(range(4), n))
        image = from_png(f"data.task squares picture {i} (cells {cells})", picture(cells, rng))
        rows.append(
            {"prompt": [{"role": "user", "content": PLACEHOLDER + QUESTION}], "answer": str(n), "images": [image]}
        )
    return rows


def reward(prompt: str, response: str, answer: str) -> float:
    head = response.strip()[:1]
    if head == answer:
        return 1.0
    return 0.1 if head in "1234" and head else 0.0
