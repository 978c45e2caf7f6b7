"""Calling the reward functions as TRL's ``GRPOTrainer._calculate_rewards`` calls them, and checking what they return.

Each function gets ``prompts``, ``completions`` and ``completion_ids`` by keyword, every other column of the rows
(``answer``, ``solution``, ...) as a keyword with one value per completion, and ``trainer_state`` (transformers'
``TrainerState``: ``global_step``, ``max_steps``, ``epoch``), ``log_extra(column, values)`` and
``log_metric(name, value)``. A conversational prompt (a list of messages) gets its completion as
``[{"role": "assistant", "content": text}]``, a text prompt as the text. A reward returns one number per completion,
or None where it does not apply (TRL's convention: left out of the sum; a completion no reward scores is left out of
its group's mean and std and gets advantage 0). Anything else — raising, another length or type, NaN or infinity —
is a UserError naming the reward's ``module:function``, the line of the user's code that raised, and the row.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import numbers
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from rocktune.errors import UserError, first_line
from rocktune.tasks.grpo.rewards import Reward
from rocktune.tasks.grpo.user_reward import user_frame


@dataclass(frozen=True)
class Batch:
    """One rollout's completions and what the rewards may read, one entry per completion."""

    prompts: list  # the prompts as the data gave them (text or messages)
    completions: list  # text, or TRL's [{"role": "assistant", "content": text}] where the prompt is messages
    completion_ids: list[list[int]]
    fields: list[dict]  # each row's other fields (answer, solution, ...), by name
    where: list[str]  # each completion's row, for error messages
    trainer_state: Any = None  # transformers' TrainerState at this rollout


@dataclass
class RewardLog:
    """What reward functions logged through TRL's ``log_extra`` and ``log_metric`` hooks."""

    extra: dict[str, list] = field(default_factory=lambda: defaultdict(list))
    metrics: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))

    def log_extra(self, column: str, values: list) -> None:
        self.extra[column].extend(values)

    def log_metric(self, name: str, value: float) -> None:
        self.metrics[name].append(float(value))

    def means(self) -> dict[str, float]:
        """Each logged metric's mean (a non-finite one left out: metrics.jsonl holds finite numbers)."""
        out = {k: sum(v) / len(v) for k, v in self.metrics.items() if v}
        return {k: x for k, x in out.items() if math.isfinite(x)}


def completions_for(prompts: list, texts: list[str]) -> list:
    """Each completion in TRL's shape for its prompt."""
    return [[{"role": "assistant", "content": t}] if isinstance(p, list) else t for p, t in zip(prompts, texts)]


def score(rewards: list[Reward], batch: Batch, log: RewardLog | None = None) -> list[list[float]]:
    """Per reward function, one float per completion (NaN where it returned None)."""
    names = {k for f in batch.fields for k in f}
    columns = {k: [f.get(k) for f in batch.fields] for k in names - {"prompt", "completion", "completion_ids"}}
    log = log or RewardLog()
    hooks = {"trainer_state": batch.trainer_state, "log_extra": log.log_extra, "log_metric": log.log_metric}
    table = []
    for r in rewards:
        kwargs = {**columns, **hooks}
        if not r.target:  # the built-ins name the rows in their errors and say when a row has no reference
            kwargs = {"answer": [None] * len(batch.where), **kwargs, "where": batch.where}
        try:
            got = r.fn(prompts=batch.prompts, completions=batch.completions, completion_ids=batch.completion_ids,
                       **kwargs)
            if inspect.isawaitable(got):  # an async reward (TRL awaits those; e.g. a judge over the network)
                got = asyncio.run(_awaited(got))
        except UserError:
            raise
        except Exception as exc:  # noqa: BLE001 -- the user's function: any failure is reported with its rows
            raise UserError(f"{_name(r)} raised {type(exc).__name__} at {user_frame(exc.__traceback__)}: "
                            f"{first_line(exc)} (on the batch of rows {', '.join(dict.fromkeys(batch.where))}); fix "
                            "the function.") from None
        table.append(_checked(r, got, batch.where))
    return table


async def _awaited(pending):
    return await pending


def _name(r: Reward) -> str:
    return f"the reward {r.target}" if r.target else f"the reward '{r.name}'"


def _checked(r: Reward, got, where: list[str]) -> list[float]:
    if isinstance(got, (str, bytes, dict)) or not hasattr(got, "__len__") or len(got) != len(where):
        size = f"{len(got)} values" if hasattr(got, "__len__") and not isinstance(got, str) else \
            f"a {type(got).__name__}"
        raise UserError(f"{_name(r)} must return a list of one number (or None) per completion ({len(where)} "
                        f"here), got {size}.")
    out = []
    for value, w in zip(got, where):
        if value is None:  # TRL: this reward does not apply to this completion
            out.append(math.nan)
            continue
        if not isinstance(value, numbers.Real) and getattr(value, "ndim", None) == 0:
            value = value.item()  # a 0-d tensor or array, as torch.tensor(list) takes it in TRL
        if not isinstance(value, numbers.Real) or not math.isfinite(value):
            raise UserError(f"{w}: {_name(r)} returned {value!r:.40} for a completion of this row; a reward must be "
                            "a finite number, or None where it does not apply.")
        out.append(float(value))
    return out


def weighted(rewards: list[Reward], table: list[list[float]]) -> list[float]:
    """TRL's sum over functions: NaN (None) values left out; NaN where every function returned None."""
    out = []
    for i in range(len(table[0]) if table else 0):
        values = [(r.weight, col[i]) for r, col in zip(rewards, table) if not math.isnan(col[i])]
        out.append(sum(w * x for w, x in values) if values else math.nan)
    return out


def nan_mean(values: list[float]) -> float:
    """The mean of the values that are not NaN (NaN if none is)."""
    kept = [x for x in values if not math.isnan(x)]
    return sum(kept) / len(kept) if kept else math.nan
