"""What a GRPO run shows of its rollouts besides the metrics: the reward on the progress line, a warning when the
rollouts cannot teach, and a sample of prompts, completions and rewards kept in the run directory.

A rollout teaches through the spread of rewards inside each group. Two ways it has none are common and silent: the
completions are cut at ``grpo.max_completion_length`` before their answer (``completions/clipped_ratio``), or every
completion of every group gets the same reward (``frac_reward_zero_std`` 1: every advantage 0, no update). Either
for ``PATIENCE`` steps in a row is said once, on the console and in metrics.jsonl (``{"step", "warnings"}``), with
the settings that change it.

``samples.jsonl`` gets, at each eval point (start, every ``training.eval_every`` steps, end), the greedy completions
of the first ``EVAL_SAMPLES`` held-out prompts and one group of the last step's rollouts, each with its reward
(``rocktune report`` shows them).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

CLIPPED = 0.5  # the share of completions cut at the length limit that counts as "most"
PATIENCE = 3  # steps in a row before a warning
EVAL_SAMPLES = 4  # held-out prompts kept per eval point


def progress(record: dict) -> str:
    """The progress line's reward figure: the step's mean reward and its spread (std) over the completions."""
    if "reward" not in record:
        return ""
    return f"reward {record['reward']:.3f}±{record.get('reward_std', 0.0):.3f}"


@dataclass
class Watch:
    """Each step's rollout statistics against the two silent failures; each said once per run."""

    max_completion_length: int
    temperature: float
    streak: dict[str, int] = field(default_factory=lambda: {"clipped": 0, "flat": 0})
    told: set[str] = field(default_factory=set)

    def check(self, step: int, stats: dict) -> list[str]:
        """The warnings this step makes due (none, or one per failure not said before)."""
        now = {"clipped": stats.get("completions/clipped_ratio", 0.0) > CLIPPED,
               "flat": stats.get("frac_reward_zero_std", 0.0) >= 1.0}
        out = []
        for kind, bad in now.items():
            self.streak[kind] = self.streak[kind] + 1 if bad else 0
            if self.streak[kind] >= PATIENCE and kind not in self.told:
                self.told.add(kind)
                out.append(self._clipped(step, stats) if kind == "clipped" else self._flat(step, stats))
        return out

    def state(self) -> dict:
        """What a checkpoint keeps: the streaks and what was said."""
        return {"streak": dict(self.streak), "told": sorted(self.told)}

    def restore(self, state: dict | None) -> None:
        if state:  # None: a checkpoint of a version without the watch
            self.streak.update(state["streak"])
            self.told = set(state["told"])

    def _clipped(self, step: int, stats: dict) -> str:
        return (f"step {step}: {stats['completions/clipped_ratio']:.0%} of the completions hit "
                f"grpo.max_completion_length={self.max_completion_length} for {PATIENCE} steps in a row: they are "
                "cut before they end, so an answer reward cannot find their answer. Raise grpo.max_completion_length, "
                f"lower grpo.temperature (now {self.temperature:g}), end them earlier with grpo.stop, or ask for "
                "shorter answers in the prompt; a length reward ({function: length}) penalises the long ones.")

    def _flat(self, step: int, stats: dict) -> str:
        mean = stats.get("reward")
        easy = "" if mean is None else (f" The step's mean reward is {mean:.3f}: if that is the best score, the "
                                        "prompts are solved already and harder ones would teach more.")
        return (f"step {step}: every group's completions got the same reward for {PATIENCE} steps in a row "
                f"(frac_reward_zero_std 1.0): every advantage is 0, so the updates teach nothing.{easy} Check that the "
                "rewards can score these completions (the rollouts in samples.jsonl or `rocktune report`; the "
                "references in `rocktune data preview`), raise grpo.temperature or grpo.num_generations for more "
                "varied completions, raise grpo.max_completion_length if they are cut, or add a partial-credit "
                "reward (a format reward: {function: regex, pattern: ...}).")


def length_note(lengths: list[int], max_completion_length: int) -> str | None:
    """Before any step: the share of the data's reference answers longer than ``grpo.max_completion_length`` (a
    completion that answers like them is cut before its answer); None when few are (under a tenth)."""
    over = sorted(n for n in lengths if n > max_completion_length)
    if not lengths or len(over) * 10 < len(lengths):
        return None
    ordered = sorted(lengths)
    keep = ordered[min(len(ordered) - 1, int(len(ordered) * 0.95))]  # what keeps 95% of them whole
    return (f"grpo.max_completion_length={max_completion_length}: {len(over)} of the {len(lengths)} reference "
            f"answers in the data are longer (median {ordered[len(ordered) // 2]} tokens, longest {ordered[-1]}); a "
            f"completion that answers like them is cut before its answer. grpo.max_completion_length: {keep} keeps "
            "95% of them whole (or ask for shorter answers in the prompt).")


def prompt_text(prompt) -> str:
    """A prompt as the report shows it: its text, or a conversation's last user turn."""
    if isinstance(prompt, str):
        return prompt
    users = [m.get("content") for m in prompt if isinstance(m, dict) and m.get("role") == "user"]
    return str(users[-1] if users else prompt[-1].get("content", ""))


def sample_rows(step: int, kind: str, rows: list, texts: list[str], total: list[float], table: dict,
                extra: dict[str, list] | None = None) -> list[dict]:
    """samples.jsonl lines: ``rows`` the Prompt objects, ``table`` each reward function's values by name, ``extra``
    the columns the rewards logged with TRL's ``log_extra`` (one value per completion of the batch)."""
    def number(x: float) -> float | None:
        return None if math.isnan(x) else x
    out = []
    for i, (p, t, r) in enumerate(zip(rows, texts, total)):
        row = {"step": step, "kind": kind, "prompt": prompt_text(p.row.prompt), "output": t, "expected": p.row.answer,
               "reward": number(r), "rewards": {k: number(v[i]) for k, v in table.items()}}
        logged = {k: v[i] for k, v in (extra or {}).items() if i < len(v)}
        out.append({**row, "extra": logged} if logged else row)
    return out


def append(path: Path, rows: list[dict]) -> None:
    with open(path, "a", encoding="utf-8") as f:
        f.writelines(json.dumps(r, default=str) + "\n" for r in rows)  # log_extra's values may be any object
