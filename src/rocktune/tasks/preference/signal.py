"""Pairs that teach nothing, found before training: a preference loss learns only from what differs between the
chosen and the rejected answer to the same prompt.

- ``identical``: the two answers are the same text, so the loss is constant and its gradient zero;
- ``whitespace``: they differ only in whitespace, so all the pair teaches is spacing;
- ``cut``: they differ only past ``data.max_length``, so the tokens trained are the same;
- ``no-prompt``: the two share no prompt (conversational pairs whose first turns differ, or an empty prompt), so
  each answer is scored against a different question, or against none.

``preference.no_signal`` says what happens to them: ``auto`` drops them with a warning while they are a minority of
the file and refuses a file where they are the majority (a mapping mistake, not a few bad rows); ``drop`` always
drops them; ``refuse`` refuses any. Each is named with its count and first rows.
"""

from __future__ import annotations

from rocktune.errors import UserError

KINDS = {"identical": "chosen and rejected are the same",
         "whitespace": "chosen and rejected differ only in whitespace",
         "cut": "chosen and rejected differ only past data.max_length",
         "no-prompt": "chosen and rejected share no prompt"}
SHOW = 5  # rows named per kind


def kind(text, pair) -> str | None:
    """Why the pair (``PairText`` and its encoded ``Pair``) carries no preference signal; None when it does."""
    chosen, rejected = _flat(text.chosen), _flat(text.rejected)
    if chosen == rejected:
        return "identical"
    if "".join(chosen.split()) == "".join(rejected.split()):
        return "whitespace"
    if not (text.prompt.strip() if isinstance(text.prompt, str) else text.prompt):
        return "no-prompt"
    if pair.chosen == pair.rejected:
        return "cut"
    return None


def _flat(answer) -> str:
    if isinstance(answer, str):
        return answer
    return "\n".join(f"{m['role']}: {m['content']} {m.get('tool_calls') or ''}" for m in answer)


def summary(kinds: list[tuple[object, str | None]]) -> dict[str, dict]:
    """``{kind: {"count", "rows"}}`` of ``(where, kind)``, with the first ``SHOW`` rows of each kind."""
    out: dict[str, dict] = {}
    for where, k in kinds:
        if k is None:
            continue
        entry = out.setdefault(k, {"count": 0, "rows": []})
        entry["count"] += 1
        if len(entry["rows"]) < SHOW:
            entry["rows"].append(str(where))
    return out


def describe(found: dict[str, dict], n_pairs: int, name: str) -> str:
    parts = []
    for k, entry in found.items():
        more = f" and {entry['count'] - len(entry['rows'])} more" if entry["count"] > len(entry["rows"]) else ""
        parts.append(f"{entry['count']} where {KINDS[k]} ({', '.join(entry['rows'])}{more})")
    n_bad = sum(e["count"] for e in found.values())
    return f"{n_bad} of {n_pairs} pairs of {name} carry no preference signal: {'; '.join(parts)}"


def screen(kinds: list[tuple[object, str | None]], policy: str, name: str) -> tuple[list[int], list[str]]:
    """The indices of the pairs to keep and the warning, per ``policy`` (preference.no_signal); raises when the
    policy refuses the file or nothing would remain."""
    found = summary(kinds)
    if not found:
        return list(range(len(kinds))), []
    n_bad = sum(e["count"] for e in found.values())
    said = describe(found, len(kinds), name)
    fix = ("fix the data (a pair needs the same prompt and two different answers; check data.columns maps chosen "
           "and rejected to different fields)")
    if n_bad == len(kinds) or policy == "refuse" or (policy == "auto" and 2 * n_bad > len(kinds)):
        why = "every pair" if n_bad == len(kinds) else ("preference.no_signal=refuse" if policy == "refuse"
                                                        else "most of the file")
        raise UserError(f"{said}. Refused ({why}): training on it would learn nothing from those pairs; {fix}, or "
                        "set preference.no_signal=drop to train on the others.")
    keep = [i for i, (_, k) in enumerate(kinds) if k is None]
    return keep, [f"warning: {said}; they were dropped (preference.no_signal={policy}; refuse stops instead)"]
