"""Preference pairs for the demo task (demo/task.py): the same prompts, and two answers that are both right but in
two styles, the preferred one (chosen) ending with an exclamation mark. A style is what preference tuning teaches best
(the SFT data already taught what is right), and one that does not depend on the prompt shows on held-out prompts
after a minute on a CPU. Generated from a seed, so every machine gets the same pairs; eval prompts never occur in
training."""

from __future__ import annotations

from rocktune.demo.task import DEFAULT_SKILLS, make_task

STYLE = "!"  # what the chosen answers end with


def make_pairs(n_train: int, n_eval: int, seed: int = 0,
               skills: tuple[str, ...] = DEFAULT_SKILLS) -> tuple[list[dict], list[dict]]:
    train, evals = make_task(n_train, n_eval, seed, skills)
    return _styled(train), _styled(evals)


def _styled(rows: list[dict]) -> list[dict]:
    return [{"prompt": r["prompt"], "chosen": r["completion"] + STYLE, "rejected": r["completion"]} for r in rows]
