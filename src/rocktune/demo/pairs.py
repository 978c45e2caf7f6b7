"""Preference pairs for the demo task (demo/task.py): the same prompts, a right answer (chosen) and a wrong one in
the shape of a right one (rejected: the letters in the wrong order or case, the sum off by one). Generated from a
seed, so every machine gets the same pairs; eval prompts never occur in training."""

from __future__ import annotations

import random

from rocktune.demo.task import make_task


def wrong(prompt: str, right: str, rng: random.Random) -> str:
    """A wrong answer that looks like a right one: what DPO must learn to rank below it."""
    if prompt.startswith("add"):
        total = int(right) + rng.choice((-1, 1)) if right.strip() not in ("00", "18") else 10
        return f" {total:02d}"
    if prompt.startswith("upper"):
        return right.lower()
    word = right.strip()
    return f" {word[::-1]}" if word[::-1] != word else f" {word}{word[-1]}"  # reverse: the word not reversed


def make_pairs(n_train: int, n_eval: int, seed: int = 0) -> tuple[list[dict], list[dict]]:
    rng = random.Random(f"pairs:{seed}")
    train, evals = make_task(n_train, n_eval, seed)
    return ([{"prompt": r["prompt"], "chosen": r["completion"], "rejected": wrong(r["prompt"], r["completion"], rng)}
             for r in rows] for rows in (train, evals))
