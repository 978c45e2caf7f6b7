"""Fit one example into ``data.max_length`` tokens: the prompt side is cut first, the completion side last.

Only the completion carries loss, so a long prompt (a document to summarise, a long chat history) must not push it
out. With ``truncation="prompt"`` tokens are taken from the start of the context (the prompt, or the oldest turns of
a conversation), so the end of the prompt stays next to the answer. Only when the completion alone does not fit is it
cut at its end; the prompt then keeps its last ``max_length // 4`` tokens, so the answer is still conditioned on
something. ``truncation="end"`` keeps the first ``max_length`` tokens, whatever they are.

Texts are tokenised through ``tokenize_bounded``: a 5 MB prompt is not tokenised whole when ``max_length`` tokens
of it are all that can be kept.
"""

from __future__ import annotations

from dataclasses import dataclass

MODES = ("prompt", "end")
# A first window of text per token wanted; widened (x4) whenever the tokenizer packs more characters per token.
CHARS_PER_TOKEN = 8
# Tokens beyond what can be kept that a window must yield: the cut edge of a window tokenises differently from the
# full text (a word split in two), and these margin tokens are the ones truncation then removes.
MARGIN = 32


@dataclass
class Fitted:
    input_ids: list[int]
    labels: list[int]
    prompt_cut: int = 0  # prompt-side tokens removed
    completion_cut: int = 0  # completion-side tokens removed
    kept: list[int] | None = None  # where each kept token was in the uncut example (None: nothing was cut)


def tokenize_bounded(tokenizer, text: str, special: bool, max_length: int, keep_end: bool) -> list[int]:
    """Token ids of ``text``, or of the part of it that truncation can keep: the end of it when ``keep_end``.

    A window of the text is used only when it alone yields more than ``max_length + MARGIN`` tokens; the example is
    then certainly truncated, and at least MARGIN tokens from the window's cut edge are among those removed.
    """
    need = max_length + MARGIN
    window = need * CHARS_PER_TOKEN
    while window < len(text):
        part = text[-window:] if keep_end else text[:window]
        ids = tokenizer(part, add_special_tokens=special)["input_ids"]
        if len(ids) >= need:
            return ids
        window *= 4
    return tokenizer(text, add_special_tokens=special)["input_ids"]


def fit(ids: list[int], labels: list[int], is_prompt: list[bool], max_length: int, mode: str,
        keep_first: bool) -> Fitted:
    """Cut ``ids``/``labels`` to ``max_length``; ``keep_first`` protects a leading BOS from the prompt-side cut."""
    excess = len(ids) - max_length
    if excess <= 0:
        return Fitted(ids, labels)
    prompt_cut = 0
    where = list(range(len(ids)))
    if mode == "prompt":
        start = 1 if keep_first else 0
        n_prompt = sum(is_prompt[start:])
        drop = min(excess, n_prompt - min(n_prompt, max_length // 4))
        keep = [True] * len(ids)
        for i in range(start, len(ids)):  # the earliest prompt tokens go first
            if prompt_cut == drop:
                break
            if is_prompt[i]:
                keep[i] = False
                prompt_cut += 1
        ids = [t for t, k in zip(ids, keep) if k]
        labels = [t for t, k in zip(labels, keep) if k]
        is_prompt = [p for p, k in zip(is_prompt, keep) if k]
        where = [w for w, k in zip(where, keep) if k]
    tail = is_prompt[max_length:]
    prompt_cut += sum(tail)
    return Fitted(ids[:max_length], labels[:max_length], prompt_cut, len(tail) - sum(tail), where[:max_length])


def uncut_calls(fitted: Fitted, sizes: list[int], calls: set[int], ignore: int) -> Fitted:
    """A tool call that the cut at the end split in half is not trained: the model would learn to emit a call that
    never closes. ``sizes``: the token count of each segment of the uncut example; ``calls``: the segments that are
    tool calls. The tokens of a split call stay in the example as context, without loss."""
    if fitted.kept is None or not calls or not fitted.kept:
        return fitted
    starts, total = [], 0
    for n in sizes:
        starts.append(total)
        total += n
    last = fitted.kept[-1]
    seg = next((i for i in calls if starts[i] <= last < starts[i] + sizes[i]), None)
    if seg is None or last == starts[seg] + sizes[seg] - 1:  # the call ends inside the example: whole
        return fitted
    lo = starts[seg]
    labels = [ignore if w >= lo else lab for w, lab in zip(fitted.kept, fitted.labels)]
    return Fitted(fitted.input_ids, labels, fitted.prompt_cut, fitted.completion_cut, fitted.kept)


RAISE = "raise data.max_length in the config's data section to keep them whole"


def cut_note(n_cut: int, n_total: int, what: str, max_length: int, lost: str) -> list[str]:
    """The run log's line, at the start, for ``n_cut`` of ``n_total`` ``what`` (conversations, pairs, prompts) cut to
    ``data.max_length``: ``lost`` says what each one loses. run_info.json's ``n_truncated`` alone went unread."""
    if not n_cut:
        return []
    return [f"{n_cut:,} of {n_total:,} {what} ({n_cut / max(n_total, 1):.1%}) are longer than "
            f"data.max_length={max_length} and are cut: {lost}; {RAISE}."]


def describe(n_records: int, n_truncated: int, n_prompt_cut: int, n_completion_cut: int, n_dropped: int,
             max_length: int, mode: str) -> list[str]:
    """The data notes a run shows: how many examples were cut, on which side, and how many had to be dropped."""
    notes = []
    if n_truncated:
        parts = [f"{n_prompt_cut} lost the start of their prompt (its end is kept next to the completion)"
                 if mode == "prompt" else f"{n_prompt_cut} lost prompt tokens",
                 f"{n_completion_cut} had their completion cut at its end"
                 + (" (the completion alone is longer)" if mode == "prompt" else "")]
        notes.append(f"{n_truncated} of {n_records} examples were longer than data.max_length={max_length} "
                     f"(data.truncation={mode}): " + "; ".join(p for p in parts if not p.startswith("0 "))
                     + f" ({n_truncated / max(n_records, 1):.1%} of them; {RAISE})")
    if n_dropped:
        notes.append(f"{n_dropped} examples were dropped: " + why_empty(max_length, mode))
    return notes


def why_empty(max_length: int, mode: str) -> str:
    if mode == "end":
        return (f"with data.truncation=end their prompt fills all data.max_length={max_length} tokens, so no "
                "completion token is left; data.truncation=prompt cuts the start of the prompt instead.")
    return "no token in them carries loss (an empty text or completion); remove them or give them a completion."
