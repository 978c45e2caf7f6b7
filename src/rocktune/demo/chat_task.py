"""A small chat skill a pretrained chat model does not have: turning a shop order into one line of JSON.

"Please send three large blue mugs" -> {"item": "mug", "qty": 3, "size": "large", "color": "blue"}. The base model
answers such a message in prose (or asks questions), so its exact match is 0; the skill needs parsing (a number word to
a digit, a plural to its singular) and a fixed key order, so a LoRA must learn something, but it is regular enough
to be learned from a few hundred examples. Generated from a seed; eval orders never occur in training.
"""

from __future__ import annotations

import json
import random

ITEMS = ["shirt", "hat", "mug", "lamp", "chair", "book", "sock", "bag", "pen", "cup", "box", "kite"]
SIZES = ["small", "medium", "large"]
COLORS = ["red", "blue", "green", "black", "white", "yellow", "pink", "gray"]
NUMBERS = ["one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
PHRASES = ["Order {what}", "Please send {what}", "I'd like {what}", "Can I get {what}?"]


def make_order(rng: random.Random) -> tuple[tuple, dict[str, str]]:
    """One order as (its identity, a prompt/completion pair in chat form)."""
    item, size, color = rng.choice(ITEMS), rng.choice(SIZES), rng.choice(COLORS)
    qty = rng.randint(1, 9)
    what = f"{NUMBERS[qty - 1]} {size} {color} {item if qty == 1 else item + 's'}"
    answer = json.dumps({"item": item, "qty": qty, "size": size, "color": color})
    return (item, size, color, qty), {"prompt": rng.choice(PHRASES).format(what=what), "completion": answer}


def make_chat_task(n_train: int, n_eval: int, seed: int = 0) -> tuple[list[dict], list[dict]]:
    """``messages`` records (user, assistant) without a system turn: the template adds the model's default one."""
    rng = random.Random(seed)
    held_out: set[tuple] = set()
    evals, train = [], []
    while len(evals) < n_eval:
        key, ex = make_order(rng)
        if key not in held_out:
            held_out.add(key)
            evals.append(ex)
    while len(train) < n_train:
        key, ex = make_order(rng)
        if key not in held_out:
            train.append(ex)
    return [_chat(x) for x in train], [_chat(x) for x in evals]


def _chat(ex: dict[str, str]) -> dict:
    return {"messages": [{"role": "user", "content": ex["prompt"]}, {"role": "assistant", "content": ex["completion"]}]}
