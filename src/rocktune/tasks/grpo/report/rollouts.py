"""The report's samples of a GRPO run (samples.jsonl lines with a ``reward``, written by tasks/grpo/watch.py): the
held-out prompts' greedy completions at the first and the last eval point with their rewards, and one group of the
last kept step's rollouts, each completion with its reward, so a reader sees what the rewards scored."""

from __future__ import annotations

import rocktune.report.page as page


def has_rewards(samples: list[dict]) -> bool:
    return any("reward" in s for s in samples)


def _reward(s: dict | None) -> str:
    if s is None:
        return ""
    value = s.get("reward")
    return "none applied" if value is None else f"{value:.3f}"


def section(samples: list[dict]) -> str:
    held = [s for s in samples if s.get("kind") == "eval"]
    rolled = [s for s in samples if s.get("kind") == "rollout"]
    parts = ["<h2>Samples</h2>"]
    if held:
        first, last = min(s["step"] for s in held), max(s["step"] for s in held)
        before = {s["prompt"]: s for s in held if s["step"] == first}
        rows = [(s["prompt"], before.get(s["prompt"], {}).get("output", ""), _reward(before.get(s["prompt"])),
                 s["output"], _reward(s), s.get("expected") or "") for s in held if s["step"] == last]
        parts.append(f"<p>Held-out prompts completed greedily at step {first} and step {last}, with their rewards "
                     "(every eval point is in samples.jsonl).</p>")
        parts.append(page.table(rows, ("prompt", f"step {first}", "reward", f"step {last}", "reward", "reference")))
    if rolled:
        last = max(s["step"] for s in rolled)
        rolls = [(s["prompt"], s["output"], _reward(s), s.get("expected") or "") for s in rolled if s["step"] == last]
        parts.append(f"<p>Rollouts of step {last}: the sampled completions of one prompt and their rewards (the group "
                     "their advantages compare; one group per eval point is in samples.jsonl).</p>")
        parts.append(page.table(rolls, ("prompt", "completion", "reward", "reference")))
    return "".join(parts)
