"""A synthetic, learnable prompt/completion task: upper-casing, reversal and one-digit additions.

Generated from a seed, so the demo's data is the same on every machine; eval prompts never occur in training.
"""

from __future__ import annotations

import json
import random
from pathlib import Path


LETTERS = "abcdefghij"
WORD = 4  # fixed lengths keep exact answers within reach of a one-minute run on two CPU cores


def make_example(rng: random.Random) -> dict[str, str]:
    """One of three skills: copy in upper case, reverse, add two digits (answer zero-padded to two digits)."""
    kind = rng.randrange(3)
    word = "".join(rng.choice(LETTERS) for _ in range(WORD))
    if kind == 0:
        return {"prompt": f"upper {word} =", "completion": f" {word.upper()}"}
    if kind == 1:
        return {"prompt": f"reverse {word} =", "completion": f" {word[::-1]}"}
    a, b = rng.randint(0, 9), rng.randint(0, 9)
    return {"prompt": f"add {a} {b} =", "completion": f" {a + b:02d}"}


def make_task(n_train: int, n_eval: int, seed: int = 0) -> tuple[list[dict], list[dict]]:
    rng = random.Random(seed)
    seen: set[str] = set()
    train: list[dict] = []
    evals: list[dict] = []
    while len(evals) < n_eval:
        ex = make_example(rng)
        if ex["prompt"] not in seen:
            seen.add(ex["prompt"])
            evals.append(ex)
    while len(train) < n_train:
        ex = make_example(rng)
        if ex["prompt"] not in seen:
            train.append(ex)
    return train, evals


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path
