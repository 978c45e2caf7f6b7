"""What one line of ``metrics.jsonl`` stands for, and the lines that say it again.

A run logs each thing once: the training line of a step (it has ``loss``), an eval line (``eval_loss``: at step 0,
every ``eval_every`` steps, and the final one at the last step), and a task's other eval lines (the same keys each
time). A line is a *repeat* when an earlier line of the file stands for the same thing. A log written by two
processes at once (before the run lock, train/runlock.py) or cut back to a wrong line count by an older version has
repeats; the resume's truncation, ``rocktune report`` and the end-of-run summary drop them, keeping the last copy
(the one of the attempt that went on to the end), and say which lines they dropped.
"""

from __future__ import annotations


def line_key(rec: dict) -> tuple:
    """What ``rec`` stands for: (step, "train"), (step, "eval") or (step, its other keys)."""
    step = rec.get("step")
    step = step if isinstance(step, int) else repr(step)  # a damaged line's step may be anything
    if "loss" in rec:
        return step, "train"
    if "eval_loss" in rec:
        return step, "eval"
    return step, tuple(sorted(k for k in rec if k != "step"))


def repeats(rows: list) -> set[int]:
    """Indexes of the rows (dicts; anything else is never a repeat) that a later row stands for again."""
    last: dict[tuple, int] = {}
    for i, rec in enumerate(rows):
        if isinstance(rec, dict):
            last[line_key(rec)] = i
    return {i for i, rec in enumerate(rows) if isinstance(rec, dict) and last[line_key(rec)] != i}


def describe(steps: list) -> str:
    """``steps`` of dropped repeats as a short phrase: "steps 80, 90, 100 (3 lines)"."""
    shown = sorted({s for s in steps if isinstance(s, int)})
    text = ", ".join(str(s) for s in shown[:12]) + (", ..." if len(shown) > 12 else "")
    return f"step{'s' if len(shown) != 1 else ''} {text} ({len(steps)} line{'s' if len(steps) != 1 else ''})"
