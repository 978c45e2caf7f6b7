"""Synthetic record sets of every shape, for the data benchmark (benchmarks/data_speed.py) and the token-equality
tests: seeded, so a run is repeatable, and varied (lengths, optional Alpaca input, 1-4 chat turns, system or not)."""

from __future__ import annotations

import random

WORDS = ("the of and to in is was for on that with as by at from his her an were which are this be has had not "
         "number answer question model data token train value result first second table list sum square").split()


def _text(rng: random.Random, lo: int, hi: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))


def alpaca(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    return [{"instruction": _text(rng, 4, 30), "input": _text(rng, 0, 40) if rng.random() < 0.4 else "",
             "output": _text(rng, 1, 80)} for _ in range(n)]


def prompt_completion(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt": _text(rng, 1, 60), "completion": " " + _text(rng, 0, 40)} for _ in range(n)]


def text(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    return [{"text": _text(rng, 1, 120)} for _ in range(n)]


def chats(n: int, seed: int = 0) -> list[dict]:
    """1-4-turn conversations, a system prompt in most."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        msgs = [{"role": "system", "content": _text(rng, 3, 20)}] if rng.random() < 0.7 else []
        for _ in range(rng.randint(1, 4)):
            msgs += [{"role": "user", "content": _text(rng, 2, 40)},
                     {"role": "assistant", "content": _text(rng, 1, 60)}]
        out.append({"messages": msgs})
    return out


SETS = {"alpaca": alpaca, "prompt_completion": prompt_completion, "text": text, "messages": chats}
