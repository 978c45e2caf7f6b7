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


# What a cut removed that the example was written to teach (bits of the "lost" column): its system prompt or tool
# list (the head of a conversation, which data.truncation=prompt cuts first), part of its last trained answer.
HEAD, ANSWER = 1, 2


def has_head(rec: dict, shape: str) -> bool:
    """A conversation that opens with a system prompt or carries a tool list: what its answers are conditioned on."""
    msgs = rec.get("messages") if shape == "messages" else None
    return bool(msgs) and (msgs[0]["role"] == "system" or bool(rec.get("tools")))


def lost(head: bool, prompt_cut: int, completion_cut: int, mode: str) -> int:
    """``HEAD | ANSWER`` bits of one example's cut. The prompt side is cut from its start, so with
    ``truncation=prompt`` any prompt cut removes the head first; the end is cut last, so any completion token cut is
    the end of the last trained answer. Older turns or a long prompt's start going is the cut working as meant."""
    return (HEAD if head and prompt_cut and mode == "prompt" else 0) | (ANSWER if completion_cut else 0)


@dataclass
class Judged:
    """The examples whose cut removed what they teach (``lost``), over one source."""

    n_lossy: int = 0
    n_head: int = 0  # lost their system prompt or tool list
    n_answer: int = 0  # lost part of their last answer
    needed: int = 0  # the max_length that keeps every one of them whole: the longest one's length
    first: str = ""  # where the first of them is
    lengths: dict | None = None  # uncut tokens per example: min, median, p95, max, and how many exceed max_length


def judge(j: Judged, max_length: int, policy: str) -> tuple[str, str] | None:
    """(level, message without its full stop) for data.lossy_truncation's ``policy``, or None when no cut removed
    anything the examples teach."""
    if not j.n_lossy:
        return None
    what = "; ".join(p for p in (f"{j.n_head} lose their system prompt or tool list" if j.n_head else "",
                                 f"{j.n_answer} lose part of their last answer" if j.n_answer else "") if p)
    msg = (f"{j.n_lossy} examples are longer than data.max_length={max_length} and cutting them removes what they "
           f"teach: {what} (the first: {j.first}). {spread(j.lengths)}data.max_length={j.needed} keeps every one "
           "of them whole (the longest is "
           f"{j.needed} tokens); or data.lossy_truncation=drop leaves them out, keep trains them as cut")
    if policy == "drop":
        return "note", msg.replace(" are longer", " were left out (data.lossy_truncation=drop): longer", 1)
    return ("error" if policy == "error" else "warning"), msg


def spread(lengths: dict | None) -> str:
    """The uncut lengths in words, for the messages above and the preview."""
    if not lengths:
        return ""
    return (f"Tokens per example before any cut: min {lengths['min']}, median {lengths['median']:g}, p95 "
            f"{lengths['p95']}, max {lengths['max']}; {lengths['over']} longer than data.max_length. ")
