"""A synthetic visual task: the colour of a shape drawn on a grey canvas, asked the same way every time, so the
answer can only come from the image. Images are written as PNG files beside the JSONL, named relative to it."""

from __future__ import annotations

import json
import random
from pathlib import Path

COLOURS = {"red": (220, 30, 30), "green": (30, 180, 40), "blue": (30, 60, 220), "yellow": (230, 210, 20)}
QUESTION = "What colour is the shape?"


def draw(colour: str, rng: random.Random, size: int = 56):
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (size, size), (128, 128, 128))
    pen = ImageDraw.Draw(image)
    w = rng.randint(size // 2, size - 4)  # at least half the side: every merged token sees some of the colour
    x, y = rng.randint(0, size - w), rng.randint(0, size - w)
    box = (x, y, x + w, y + w)
    (pen.ellipse if rng.random() < 0.5 else pen.rectangle)(box, fill=COLOURS[colour])
    return image


def write_colour_task(folder: Path, n_train: int, n_eval: int, seed: int = 0) -> tuple[Path, Path]:
    """``train.jsonl`` and ``eval.jsonl`` in ``folder`` (OpenAI content parts, images under ``images/``)."""
    rng = random.Random(seed)
    (folder / "images").mkdir(parents=True, exist_ok=True)
    files = []
    for name, n in (("train", n_train), ("eval", n_eval)):
        rows = []
        for i in range(n):
            colour = rng.choice(sorted(COLOURS))
            rel = f"images/{name}_{i}.png"
            draw(colour, rng).save(folder / rel)
            rows.append(row(rel, colour))
        path = folder / f"{name}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        files.append(path)
    return files[0], files[1]


def row(image: str, answer: str, question: str = QUESTION) -> dict:
    return {"messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": image}},
                                     {"type": "text", "text": question}]},
        {"role": "assistant", "content": answer}]}


SHAPES = ("circle", "square", "triangle", "cross")
SHAPE_QUESTION = "Which shape is drawn?"


def draw_shape(shape: str, rng: random.Random, size: int = 56):
    """One shape, in one colour for all, on the grey canvas: the answer is the outline, not a colour."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (size, size), (128, 128, 128))
    pen = ImageDraw.Draw(image)
    w = rng.randint(size // 2, size - 4)
    x, y = rng.randint(0, size - w), rng.randint(0, size - w)
    colour = (230, 60, 30)
    if shape == "circle":
        pen.ellipse((x, y, x + w, y + w), fill=colour)
    elif shape == "square":
        pen.rectangle((x, y, x + w, y + w), fill=colour)
    elif shape == "triangle":
        pen.polygon([(x + w // 2, y), (x, y + w), (x + w, y + w)], fill=colour)
    else:  # a cross: two bars a third of the side wide
        t = w // 3
        pen.rectangle((x + t, y, x + 2 * t, y + w), fill=colour)
        pen.rectangle((x, y + t, x + w, y + 2 * t), fill=colour)
    return image


def write_shape_task(folder: Path, n_train: int, n_eval: int, seed: int = 0) -> tuple[Path, Path]:
    """Which shape is drawn: a task whose answers differ in length by a token or two (the shape names), so a batch
    order that groups examples by length groups them by answer. The held-out file is balanced (chance 0.25)."""
    rng = random.Random(seed)
    (folder / "images").mkdir(parents=True, exist_ok=True)
    files = []
    for name, n in (("train", n_train), ("eval", n_eval)):
        shapes = [SHAPES[i % len(SHAPES)] for i in range(n)] if name == "eval" else \
            [rng.choice(SHAPES) for _ in range(n)]
        rows = []
        for i, shape in enumerate(shapes):
            rel = f"images/{name}_{i}.png"
            draw_shape(shape, rng).save(folder / rel)
            rows.append(row(rel, shape, SHAPE_QUESTION))
        path = folder / f"{name}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        files.append(path)
    return files[0], files[1]
