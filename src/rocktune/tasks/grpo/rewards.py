"""Verifiable rewards: each a function of a batch of completions (TRL's reward-function signature), weighted and
summed into one reward per completion.

Built in: ``exact`` (the completion's answer equals the reference), ``numeric`` (its last number is within
``tolerance`` of the reference's), ``regex`` (the completion matches ``pattern``: a format reward), ``length``
(DAPO's overlong penalty: 0 up to ``max_tokens - buffer`` tokens, falling linearly to -1 at ``max_tokens``). The
user's own function is named in the config as ``module:function`` and imported only by the training process that
was asked to run it (report, export and generate read a run directory and never import it), and called as TRL calls
its reward functions: ``f(prompts=..., completions=..., completion_ids=..., **row_fields) -> list[float]``.
A reward that raises, or returns anything but one finite number per completion, stops the run naming the row.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Callable

from rocktune.errors import UserError, first_line

BUILT_IN = ("exact", "numeric", "regex", "length")
_NUMBER = re.compile(r"-?\d[\d,]*\.?\d*(?:[eE][-+]?\d+)?|-?\.\d+")
_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")


@dataclass(frozen=True)
class Batch:
    """One rollout's completions and what the rewards may read, one entry per completion."""

    prompts: list  # the prompts as the data gave them (text or messages)
    completions: list[str]
    completion_ids: list[list[int]]
    fields: list[dict]  # each row's other fields (answer, solution, ...), by name
    where: list[str]  # each completion's row, for error messages


@dataclass(frozen=True)
class Reward:
    name: str  # metrics: rewards/<name>/mean
    weight: float
    fn: Callable  # TRL's signature


def final_answer(text: str) -> str:
    """The answer a completion gives: after its last ``####`` (GSM8K), else inside its last ``\\boxed{}``, else the
    whole completion; stripped."""
    if "####" in text:
        return text.rsplit("####", 1)[1].strip()
    boxed = _BOXED.findall(text)
    return boxed[-1].strip() if boxed else text.strip()


def last_number(text: str) -> float | None:
    found = _NUMBER.findall(final_answer(text))
    if not found:
        return None
    try:
        return float(found[-1].replace(",", "").rstrip("."))
    except ValueError:
        return None


def _references(kwargs: dict, name: str, where: list[str]) -> list[str]:
    fields = kwargs.get("answer")
    if fields is None or any(a is None for a in fields):
        missing = where[0] if fields is None else where[[a is None for a in fields].index(True)]
        raise UserError(f"{missing}: the '{name}' reward compares with a reference answer and this row has none "
                        "(give an answer, solution or ground_truth column, or map one with data.columns).")
    return [str(a) for a in fields]


def exact(completions: list[str], where: list[str], **kwargs) -> list[float]:
    refs = _references(kwargs, "exact", where)
    return [float(final_answer(c) == final_answer(a)) for c, a in zip(completions, refs)]


def numeric(tolerance: float) -> Callable:
    def reward(completions: list[str], where: list[str], **kwargs) -> list[float]:
        out = []
        for c, a, w in zip(completions, _references(kwargs, "numeric", where), where):
            ref = last_number(a)
            if ref is None:
                raise UserError(f"{w}: the 'numeric' reward needs a number as the reference answer, got {a!r:.60}.")
            got = last_number(c)
            out.append(float(got is not None and abs(got - ref) <= tolerance))
        return out
    return reward


def regex(pattern: str) -> Callable:
    compiled = re.compile(pattern, re.DOTALL)

    def reward(completions: list[str], **kwargs) -> list[float]:
        return [float(compiled.search(c) is not None) for c in completions]
    return reward


def length(max_tokens: int, buffer: int) -> Callable:
    def reward(completion_ids: list[list[int]], **kwargs) -> list[float]:
        start = max_tokens - buffer
        return [0.0 if len(ids) <= start else max(-1.0, (start - len(ids)) / max(buffer, 1)) for ids in completion_ids]
    return reward


def build(specs, max_completion_length: int) -> list[Reward]:
    """The configured rewards, built-in ones made and user functions imported (only here: the training process)."""
    from rocktune.task_registry import load

    out = []
    for i, s in enumerate(specs):
        key = f"grpo.rewards[{i}]"
        if s.function == "exact":
            fn = exact
        elif s.function == "numeric":
            fn = numeric(s.tolerance)
        elif s.function == "regex":
            fn = regex(s.pattern)
        elif s.function == "length":
            tokens = s.max_tokens or max_completion_length
            fn = length(tokens, s.buffer if s.buffer is not None else tokens // 4)
        else:
            try:
                fn = load(s.function)
            except (ImportError, AttributeError) as exc:
                raise UserError(f"{key}.function={s.function}: could not import it ({first_line(exc)}); the module "
                                "must be importable from where rocktune runs (the working directory or an installed "
                                "package).") from None
            if not callable(fn):
                raise UserError(f"{key}.function={s.function} is not a function.")
        out.append(Reward(s.name or s.function.rpartition(":")[2], s.weight, fn))
    return out


def score(rewards: list[Reward], batch: Batch) -> list[list[float]]:
    """Per reward function, one finite float per completion; anything else is an error naming the row."""
    fields = {k for f in batch.fields for k in f}
    columns = {k: [f.get(k) for f in batch.fields] for k in fields}
    columns.setdefault("answer", [None] * len(batch.completions))
    table = []
    for r in rewards:
        try:
            got = r.fn(prompts=batch.prompts, completions=batch.completions, completion_ids=batch.completion_ids,
                       where=batch.where, **columns)
        except UserError:
            raise
        except Exception as exc:  # noqa: BLE001 -- the user's function: any failure is reported with its rows
            raise UserError(f"the reward '{r.name}' raised {type(exc).__name__}: {first_line(exc)} (on the batch of "
                            f"rows {', '.join(dict.fromkeys(batch.where))}); fix the function.") from None
        table.append(_checked(r.name, got, batch.where))
    return table


def _checked(name: str, got, where: list[str]) -> list[float]:
    if not isinstance(got, (list, tuple)) or len(got) != len(where):
        size = len(got) if isinstance(got, (list, tuple)) else type(got).__name__
        raise UserError(f"the reward '{name}' must return a list of one number per completion ({len(where)}), got "
                        f"{size}.")
    out = []
    for value, w in zip(got, where):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise UserError(f"{w}: the reward '{name}' returned {value!r:.40} for a completion of this row; a reward "
                            "must be a finite number.")
        out.append(float(value))
    return out


def weighted(rewards: list[Reward], table: list[list[float]]) -> list[float]:
    return [sum(r.weight * col[i] for r, col in zip(rewards, table)) for i in range(len(table[0]))]
