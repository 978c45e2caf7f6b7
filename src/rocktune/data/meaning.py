"""Keys a record carries beyond what its shape uses: never silently dropped.

A key that changes what should be learned (a KTO label, a preference pair, a record weight) is refused with the reason
and the alternative, because training through it would teach the opposite of what the data says (the undesirable
answers of a KTO set, the rejected side of a pair). Any other key is counted, and the counts are named once in the
run's notes and in ``data preview`` (``unused_note``).
"""

from __future__ import annotations

from rocktune.errors import UserError

USED = {"messages": {"messages", "conversations", "system", "tools", "functions"},
        "alpaca": {"instruction", "input", "output"},
        "prompt_completion": {"prompt", "completion"},
        "text": {"text"}}
CHAT_EXTRAS = {"system", "history"}  # what an instruction record adds when rendered through the chat template
RECORD_WEIGHTS = ("weight", "loss_weight")


def used_keys(shape: str, templated: bool) -> frozenset[str]:
    extras = (CHAT_EXTRAS if shape == "alpaca" else {"system"}) if templated else set()
    return frozenset(USED[shape] | extras | set(RECORD_WEIGHTS))


def refuse(rec: dict, loc) -> None:
    """Raise for a key whose meaning rocktune cannot honour in supervised fine-tuning."""
    if "kto_tag" in rec or isinstance(rec.get("label"), bool):
        key = "kto_tag" if "kto_tag" in rec else "label"
        raise UserError(f"{loc}: the record has a KTO-style '{key}' (desirable or not); supervised fine-tuning would "
                        "train every answer, the undesirable ones included. Keep only the desirable records "
                        f"(e.g. datasets' .filter(lambda r: r['{key}'])) and drop the key, or train them with a KTO "
                        "trainer.")
    for good, bad, whose in (("chosen", "rejected", ""), ("preferred_output", "non_preferred_output", "OpenAI's ")):
        if good in rec and bad in rec:
            raise UserError(f"{loc}: the record is a preference pair ({whose}'{good}' and '{bad}'); supervised "
                            "fine-tuning would learn from both sides alike. Train it with a preference method, "
                            "DPO/ORPO (task: dpo or task: orpo; docs/preference.md; `rocktune data preview` shows "
                            f"it as pairs with task=dpo), or {_preferred_alone(rec, good, bad)}")
    for key in RECORD_WEIGHTS:
        value = rec.get(key)
        if value is not None and (isinstance(value, (str, bool)) or value != 1):
            raise UserError(f"{loc}: the record has {key}={value!r}; rocktune weights every example equally and "
                            "does not scale its loss. Repeat records to weight them up, remove the ones weighted "
                            "0, or drop the key (per-message loss_weight 0/1 in a conversation is honoured).")


def _preferred_alone(rec: dict, good: str, bad: str) -> str:
    """How to fine-tune on the preferred answers alone, keeping the question: a side that is a whole conversation
    (TRL's implicit prompt) is mapped as it is; an answer whose question is elsewhere (OpenAI's ``input``, TRL's
    ``prompt``) has to be joined to it first, which a column mapping cannot do (mapping the answer alone would train
    answers to no question)."""
    side = rec.get(good)
    whole = isinstance(side, list) and any(isinstance(m, dict) and m.get("role") == "user" for m in side)
    if whole and "prompt" not in rec and "input" not in rec:
        return (f"fine-tune on the preferred conversations alone: data.columns: {{messages: {good}}} (each holds its "
                f"question; '{bad}' is then left unused, and said so).")
    if isinstance(side, str) and isinstance(rec.get("prompt"), str):  # TRL's explicit prompt, as plain text
        return (f"fine-tune on the preferred answers alone: data.columns: {{completion: {good}}} (the 'prompt' stays "
                f"the question; '{bad}' is then left unused, and said so).")
    question = "input.messages" if "input" in rec else "prompt"
    return (f"fine-tune on the preferred answers alone by writing each pair as one conversation, the question and its "
            f"preferred answer: {{\"messages\": {question} + {good}}} (e.g. datasets' .map(lambda r: {{'messages': "
            f"r{_path(question)} + r['{good}']}}, remove_columns=[...])); mapping '{good}' alone with data.columns "
            "would train answers without their question.")


def _path(dotted: str) -> str:
    return "".join(f"['{k}']" for k in dotted.split("."))


def unused(rec: dict, used: frozenset[str]) -> list[str]:
    return sorted(k for k in rec if k not in used)


def unused_note(counts: dict[str, int], n_records: int, shape: str, name: str) -> str | None:
    """One note naming every key no part of the shape uses, with how many records carry it."""
    if not counts:
        return None
    parts = ", ".join(f"'{k}' ({n} of {n_records} records)" for k, n in sorted(counts.items(), key=lambda kv: -kv[1]))
    return (f"{name}: keys the {shape} shape does not use were ignored: {parts}; map one with data.columns if it "
            "holds what should be trained")
