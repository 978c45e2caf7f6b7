"""A synthetic, learnable prompt/completion task: upper-casing, shifting, digits, rotation, reversal, addition.

Generated from a seed, so the data is the same on every machine; eval prompts never occur in training.

Which skills a task mixes decides what its held-out figures mean. Upper-casing, shifting (a -> b) and digits
(a -> 0, ..., j -> 9) map each letter to one answer character at a fixed distance from it: an unseen word is
answered by the same per-letter rule as the seen ones, so held-out exact match measures the skill and sits on a
plateau at 100% once it is learned. The other skills do not, on the demo's 2-layer model: one-digit addition has only
100 facts, and the held-out ones are facts the model never saw; reversal and rotation (abcd -> bcda) read answer
letter k from a place that moves with k, which the model partly memorises per word instead of learning. Whether
such answers come out right is decided by rounding: the earlier demo (upper, reverse, add) gave 69-75% held-out on
different CPUs, and rotation 100% with this CPU's kernels but 83% with ATen's default ones (500 steps). The demo
therefore uses the three per-letter maps; the tests keep the default mix (their recorded losses were measured on
it over a few steps).
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path

LETTERS = "abcdefghij"
WORD = 4  # fixed lengths keep exact answers within reach of a short run on two CPU cores


def _upper(rng: random.Random, word: str) -> dict[str, str]:
    return {"prompt": f"upper {word} =", "completion": f" {word.upper()}"}


def _reverse(rng: random.Random, word: str) -> dict[str, str]:
    return {"prompt": f"reverse {word} =", "completion": f" {word[::-1]}"}


def _shift(rng: random.Random, word: str) -> dict[str, str]:
    """Each letter to the next one of the alphabet (a -> b, ..., j -> k)."""
    return {"prompt": f"shift {word} =", "completion": " " + "".join(chr(ord(c) + 1) for c in word)}


def _rotate(rng: random.Random, word: str) -> dict[str, str]:
    """The first letter moved to the end (abcd -> bcda)."""
    return {"prompt": f"rotate {word} =", "completion": f" {word[1:]}{word[0]}"}


def _digits(rng: random.Random, word: str) -> dict[str, str]:
    """Each letter to its place in the alphabet, from 0 (a -> 0, ..., j -> 9)."""
    return {"prompt": f"digits {word} =", "completion": " " + "".join(str(LETTERS.index(c)) for c in word)}


def _add(rng: random.Random, word: str) -> dict[str, str]:
    a, b = rng.randint(0, 9), rng.randint(0, 9)
    return {"prompt": f"add {a} {b} =", "completion": f" {a + b:02d}"}  # zero-padded to two digits


SKILLS: dict[str, Callable[[random.Random, str], dict[str, str]]] = {
    "upper": _upper, "reverse": _reverse, "shift": _shift, "rotate": _rotate, "digits": _digits, "add": _add}
DEFAULT_SKILLS = ("upper", "reverse", "add")  # the tests' mix (their recorded losses were measured on it)
DEMO_SKILLS = ("upper", "shift", "digits")  # rules only: held-out figures that do not hang on rounding


def make_example(rng: random.Random, skills: tuple[str, ...] = DEFAULT_SKILLS) -> dict[str, str]:
    """One example of a skill drawn uniformly from ``skills``.

    The word is drawn for every skill (addition ignores it) so that a seed gives the same records as before skills
    could be chosen: the tests' recorded losses stay valid.
    """
    skill = SKILLS[skills[rng.randrange(len(skills))]]
    word = "".join(rng.choice(LETTERS) for _ in range(WORD))
    return skill(rng, word)


def make_task(n_train: int, n_eval: int, seed: int = 0,
              skills: tuple[str, ...] = DEFAULT_SKILLS) -> tuple[list[dict], list[dict]]:
    rng = random.Random(seed)
    seen: set[str] = set()
    train: list[dict] = []
    evals: list[dict] = []
    while len(evals) < n_eval:
        ex = make_example(rng, skills)
        if ex["prompt"] not in seen:
            seen.add(ex["prompt"])
            evals.append(ex)
    while len(train) < n_train:
        ex = make_example(rng, skills)
        if ex["prompt"] not in seen:
            train.append(ex)
    return train, evals


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path
