"""Verifiable rewards: each a function of a batch of completions with TRL's reward-function signature, weighted and
summed into one reward per completion (scoring.py calls them).

Built in: ``exact`` (the completion's answer equals the reference), ``numeric`` (its last number is within
``tolerance`` of the reference's), ``regex`` (the completion matches ``pattern``: a format reward), ``length``
(DAPO's overlong penalty: 0 up to ``max_tokens - buffer`` tokens, falling linearly to -1 at ``max_tokens``). Each
reads a completion as text or, for a conversational prompt, as TRL's ``[{"role": "assistant", "content": ...}]``.
The user's own function is named in the config as ``module:function`` and imported only by the training process
that was asked to run it (user_reward.py; report, export and generate read a run directory and never import it).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable

from rocktune.errors import UserError
from rocktune.tasks.grpo import user_reward

BUILT_IN = ("exact", "numeric", "regex", "length")
_NUMBER = re.compile(r"-?\d[\d,]*\.?\d*(?:[eE][-+]?\d+)?|-?\.\d+")
_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")


@dataclass(frozen=True)
class Reward:
    name: str  # metrics: rewards/<name>/mean
    weight: float
    fn: Callable  # TRL's signature
    target: str = ""  # the user's module:function ("": built in, which also receives ``where``, the rows' names)


def text_of(completion) -> str:
    """A completion's text: itself, or the content of TRL's conversational ``[{"role": "assistant", ...}]``."""
    return completion if isinstance(completion, str) else "".join(str(m.get("content") or "") for m in completion)


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


def exact(completions: list, where: list[str], **kwargs) -> list[float]:
    refs = _references(kwargs, "exact", where)
    return [float(final_answer(text_of(c)) == final_answer(a)) for c, a in zip(completions, refs)]


def numeric(tolerance: float) -> Callable:
    def reward(completions: list, where: list[str], **kwargs) -> list[float]:
        out = []
        for c, a, w in zip(completions, _references(kwargs, "numeric", where), where):
            ref = last_number(a)
            if ref is None:
                raise UserError(f"{w}: the 'numeric' reward needs a number as the reference answer, got {a!r:.60}.")
            got = last_number(text_of(c))
            out.append(float(got is not None and abs(got - ref) <= tolerance))
        return out
    return reward


def regex(pattern: str) -> Callable:
    compiled = re.compile(pattern, re.DOTALL)

    def reward(completions: list, **kwargs) -> list[float]:
        return [float(compiled.search(text_of(c)) is not None) for c in completions]
    return reward


def length(max_tokens: int, buffer: int) -> Callable:
    def reward(completion_ids: list[list[int]], **kwargs) -> list[float]:
        start = max_tokens - buffer
        return [0.0 if len(ids) <= start else max(-1.0, (start - len(ids)) / max(buffer, 1)) for ids in completion_ids]
    return reward


def build(specs, max_completion_length: int) -> list[Reward]:
    """The configured rewards, built-in ones made and user functions imported (only here: the training process)."""
    out = []
    for i, s in enumerate(specs):
        fn, target = _built_in(s, max_completion_length), ""
        if fn is None:
            fn, target = user_reward.load(s.function, f"grpo.rewards[{i}]"), s.function
        out.append(Reward(s.name or s.function.rpartition(":")[2], s.weight, fn, target))
    return out


def _built_in(s, max_completion_length: int) -> Callable | None:
    if s.function == "exact":
        return exact
    if s.function == "numeric":
        return numeric(s.tolerance)
    if s.function == "regex":
        return regex(s.pattern)
    if s.function == "length":
        tokens = s.max_tokens or max_completion_length
        return length(tokens, s.buffer if s.buffer is not None else tokens // 4)
    return None
