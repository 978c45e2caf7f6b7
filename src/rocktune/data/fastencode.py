"""Tokenise a batch of records at once, with exactly the tokens and labels of ``encode.encode`` record by record.

``encode.encode`` is the reference: it renders segments (prompt / completion, or the turns of a conversation) and
tokenises each one separately, so the prompt/completion boundary is exact in tokens. Here the same segment texts are
tokenised in two batched calls into the fast tokenizer (its Rust side, not a Python loop), and only an example longer
than ``max_length`` goes through truncation, on numpy arrays.

A conversation is rendered once (``encode`` renders two growing prefixes per assistant turn): the template's layout
(the generation prompt before a reply, the end-of-turn text after it) is learned once per tokenizer and proven on
probe conversations against the per-prefix rendering; the turns are then located in the one rendering. A template
that is not laid out that way, or a conversation where a turn is not found (a template that edits the content),
goes through ``encode``'s per-prefix rendering, so the result is the same either way.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from rocktune.data import encode, fidelity
from rocktune.data.encode import IGNORE, Encoded
from rocktune.data.ids import token_ids
from rocktune.data.chat import has_tools
from rocktune.data.truncate import CHARS_PER_TOKEN, MARGIN, Fitted, tokenize_bounded, uncut_calls
from rocktune.errors import UserError, first_line

PROBE_REPLY = "rocktune-probe-reply"
# Conversations the learned layout must reproduce exactly, per-prefix rendering being the judge.
PROBE_CHATS = [
    [("user", "hi"), ("assistant", "a1")],
    [("system", "s"), ("user", "u1"), ("assistant", "a1"), ("user", "u2"), ("assistant", "a2")],
    [("user", "u1"), ("assistant", "a1"), ("user", "u2"), ("assistant", "a2"), ("user", "u3")],
    [("system", "s"), ("user", "u1"), ("assistant", "a1"), ("assistant", "a2")],
]


@dataclass(frozen=True)
class EncodeSettings:
    shape: str  # how records are encoded: an instruction record rendered through the chat template is "messages"
    max_length: int
    train_on_prompt: bool
    truncation: str = "prompt"
    record_shape: str | None = None  # the shape the records come in (None: ``shape``)
    roles: tuple[tuple[str, str], ...] = ()  # data.roles: (tag, role) pairs
    tools: str = "render"  # data.tools: render | drop
    stride: int = 0  # text: tokens between window starts (data.text_stride; textstream.stride_for)
    lossy: str = "error"  # data.lossy_truncation: error | drop | keep (drop: such examples are not kept)
    train_reasoning: bool = False  # data.train_reasoning

    @property
    def source_shape(self) -> str:
        return self.record_shape or self.shape

    @property
    def templated(self) -> bool:
        """Instruction records rendered through the chat template (data.chat_template)."""
        return self.shape == "messages" and self.source_shape != "messages"


@dataclass(frozen=True)
class ChatLayout:
    gen: str  # the generation prompt: what precedes a reply's content
    suffix: str  # what follows a reply's content in its turn (the end-of-turn marker)


def encode_many(recs: list[dict], tokenizer, s: EncodeSettings, locs: list[str],
                layout: ChatLayout | None = None) -> list[Encoded]:
    """``encode.encode`` of each record, batched; ``locs`` name the records in errors. ``layout``: from
    ``chat_layout`` (chat data), learned by the caller once for all batches."""
    segs = [_segments(rec, s, tokenizer, loc, layout) for rec, loc in zip(recs, locs)]
    window = (s.max_length + MARGIN) * CHARS_PER_TOKEN
    toks = _tokenize(segs, tokenizer, s, window, locs)
    out = []
    eos = tokenizer.eos_token_id if s.shape != "messages" else None
    bos = tokenizer.bos_token_id if s.shape != "messages" else None
    for rec, rec_segs, rec_toks in zip(recs, segs, toks):
        ids: list[int] = []
        labels: list[int] = []
        for (_, bears_loss), seg in zip(rec_segs, rec_toks):
            ids += seg
            labels += seg if (bears_loss or s.train_on_prompt) else [IGNORE] * len(seg)
        if eos is not None:
            ids.append(eos)
            labels.append(eos)
        if len(ids) <= s.max_length:  # most examples: nothing to cut, no per-token bookkeeping
            out.append(Encoded(ids, labels, False))
            continue
        is_prompt = [p for (_, bears_loss), seg in zip(rec_segs, rec_toks) for p in [not bears_loss] * len(seg)]
        is_prompt += [False] * (eos is not None)
        keep_first = bos is not None and ids[0] == bos
        fitted = fit_arrays(ids, labels, is_prompt, s.max_length, s.truncation, keep_first)
        if s.shape == "messages":
            fitted = uncut_calls(fitted, [len(t) for t in rec_toks], encode.call_segments(rec), IGNORE)
        out.append(Encoded(fitted.input_ids, fitted.labels, len(ids) > s.max_length, fitted.prompt_cut,
                           fitted.completion_cut))
    return out


def _segments(rec: dict, s: EncodeSettings, tokenizer, loc: str, layout: ChatLayout | None) -> list[tuple[str, bool]]:
    shape = s.shape
    try:
        if shape == "messages" and layout is not None and not has_tools(rec):
            found = chat_segments(rec["messages"], tokenizer, layout)
            if found is not None:
                fidelity.check(rec, found, loc, located=True)
                return found
        return encode._segments(rec, shape, tokenizer, loc, s.train_reasoning)
    except UserError:
        raise
    except Exception as exc:  # noqa: BLE001 - templates raise many types; the record is the cause
        raise UserError(_cannot(loc, exc)) from None


def _cannot(loc: str, exc: Exception) -> str:
    return f"{loc}: this record cannot be tokenised ({type(exc).__name__}: {first_line(exc)}); fix or remove it."


def _tokenize(segs: list[list[tuple[str, bool]]], tokenizer, s: EncodeSettings, window: int,
              locs: list[str]) -> list[list[list[int]]]:
    """Token ids of every segment: one batched call per special-token setting; a text longer than the window that
    truncation could keep goes through ``tokenize_bounded`` (as in ``encode``), alone."""
    out = [[[] for _ in rec] for rec in segs]
    batches: dict[bool, list[tuple[int, int, str]]] = {True: [], False: []}
    for r, rec in enumerate(segs):
        for i, (text, bears_loss) in enumerate(rec):
            if not text:
                continue
            special = i == 0 and s.shape != "messages"
            if len(text) > window:
                keep_end = s.truncation == "prompt" and not bears_loss
                out[r][i] = _guard(lambda t=text, sp=special, k=keep_end: tokenize_bounded(
                    tokenizer, t, sp, s.max_length, k), locs[r])
            else:
                batches[special].append((r, i, text))
    for special, items in batches.items():
        if not items:
            continue
        try:
            ids = token_ids(tokenizer, [t for _, _, t in items], special)
        except Exception:  # noqa: BLE001 - find the record the tokenizer refuses, one by one, to name it
            ids = [_guard(lambda t=t, sp=special: tokenizer(t, add_special_tokens=sp)["input_ids"], locs[r])
                   for r, _, t in items]
        for (r, i, _), seg in zip(items, ids):
            out[r][i] = seg
    return out


def _guard(call, loc: str):
    try:
        return call()
    except Exception as exc:  # noqa: BLE001 - tokenizers raise many types; the record is the cause
        raise UserError(_cannot(loc, exc)) from None


def fit_arrays(ids: list[int], labels: list[int], is_prompt: list[bool], max_length: int, mode: str,
               keep_first: bool) -> Fitted:
    """``truncate.fit`` on numpy arrays: the earliest prompt tokens (after a kept BOS) are dropped at once."""
    excess = len(ids) - max_length
    if excess <= 0:
        return Fitted(ids, labels)
    a_ids, a_labels, prompt = np.asarray(ids), np.asarray(labels), np.asarray(is_prompt, dtype=bool)
    prompt_cut = drop = 0
    if mode == "prompt":
        start = 1 if keep_first else 0
        where = np.flatnonzero(prompt[start:]) + start
        drop = min(excess, len(where) - min(len(where), max_length // 4))
        if drop > 0:
            keep = np.ones(len(a_ids), dtype=bool)
            keep[where[:drop]] = False
            a_ids, a_labels, prompt = a_ids[keep], a_labels[keep], prompt[keep]
            prompt_cut = drop
    tail = int(prompt[max_length:].sum())
    kept = (np.flatnonzero(keep) if mode == "prompt" and drop > 0 else np.arange(len(a_ids)))[:max_length]
    return Fitted(a_ids[:max_length].tolist(), a_labels[:max_length].tolist(), prompt_cut + tail,
                  max(0, len(prompt) - max_length) - tail, kept.tolist())


def chat_layout(tokenizer) -> ChatLayout | None:
    """The template's per-turn layout, when one rendering of a conversation reproduces ``encode``'s per-prefix
    segments on every probe conversation; else None (each conversation is then rendered per prefix)."""
    if not getattr(tokenizer, "chat_template", None):
        return None

    def render(msgs, gen):
        return tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)

    try:
        user = [{"role": "user", "content": "hi"}]
        bare, prompted = render(user, False), render(user, True)
        replied = render(user + [{"role": "assistant", "content": PROBE_REPLY}], False)
        if not prompted.startswith(bare) or PROBE_REPLY not in replied:
            return None
        layout = ChatLayout(prompted[len(bare):], replied.split(PROBE_REPLY, 1)[1])
        for chat in PROBE_CHATS:
            msgs = [{"role": r, "content": c} for r, c in chat]
            if chat_segments(msgs, tokenizer, layout) != encode.chat_segments(msgs, tokenizer, "probe"):
                return None
    except Exception:  # noqa: BLE001 - a template that refuses a probe shape: keep the per-prefix rendering
        return None
    return layout


def chat_segments(messages: list[dict], tokenizer, layout: ChatLayout) -> list[tuple[str, bool]] | None:
    """``encode.chat_segments`` from one rendering; None when a reply is not found where the layout puts it, or
    when its text occurs twice in its stretch of the rendering (a user turn quoting the reply, header and all), so
    that where it is would be a guess."""
    full = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    found = []  # (needle, where the search started, where it was found)
    done = 0
    for i, msg in enumerate(messages):
        if msg["role"] != "assistant":
            continue
        needle = (layout.gen if i else "") + msg["content"] + layout.suffix  # a leading reply: trained from 0
        at = full.find(needle, done)
        if at < 0:
            return None
        found.append((needle, done, at, i))
        done = at + len(needle)
    limits = [at for _, _, at, _ in found[1:]] + [len(full)]
    if any(full.count(needle, begin, max(limit, at + len(needle))) != 1
           for (needle, begin, at, _), limit in zip(found, limits)):
        return None
    segments: list[tuple[str, bool]] = []
    done = 0
    for needle, _, at, i in found:
        start = at + len(layout.gen) if i else 0
        end = at + len(needle)
        segments += [(full[done:start], False), (full[start:end], True)]
        done = end
    if len(full) > done:
        segments.append((full[done:], False))
    return segments
