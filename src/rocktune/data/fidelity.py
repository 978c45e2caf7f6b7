"""Meaning never lost to a template: what a conversation says must be in the text its chat template renders.

A chat template renders what it was written for and silently drops the rest: a ChatML template without tool
support (SmolLM2's, the demo model's) renders an assistant turn that only calls a tool as an empty turn and ignores
``tools=``, so a tool-calling set would teach the model to answer with nothing; a template without a system role may
skip the system prompt. Each record is checked on its own rendering (the segments the encoder cut it into), never
by the template's name: every message's text, each tool call's name and arguments (in the reply that trains them)
and, by rendering once without it, the tool list. Text is compared with whitespace, punctuation and case removed,
so a template that trims, quotes or JSON-escapes what it writes still passes; what it does not write at all fails.
"""

from __future__ import annotations

import json
import re

from rocktune.errors import UserError

_NOT_WORD = re.compile(r"[\W_]+")
FIX_TOOLS = ("The one-line fix: data.chat_template: builtin-tools, rocktune's own tool-calling template in the "
             "model's turn format (ChatML, Llama 3 or Gemma turns; it adds no system prompt, and training, generate, "
             "export and the Ollama TEMPLATE all use it); or data.chat_template naming a .jinja file written for the "
             "model that renders tools; or train without them, explicitly: data.tools: drop (the tool list, the "
             "calls and the tool results are removed, and a conversation left without an answer is dropped).")
FIX_TEXT = ("Use a chat template that renders it (data.chat_template naming a .jinja file that does, or a model whose "
            "own template does), or remove that part from the records if the model is meant to learn without it.")


def words(text: str) -> str:
    """``text`` reduced to its letters and digits, case folded: what any rendering of it keeps."""
    return _NOT_WORD.sub("", text).casefold()


class _Text:
    """A rendered text, searched raw first (C speed) and reduced to words only when the raw search fails."""

    def __init__(self, text: str):
        self.text, self._words = text, None

    def has(self, piece: str) -> bool:
        piece = piece.strip()
        if not piece or piece in self.text:
            return True
        if self._words is None:
            self._words = words(self.text)
        return words(piece) in self._words


def check(rec: dict, segments: list[tuple[str, bool]], loc, tools_rendered: bool = True,
          located: bool = False, opener: str = "") -> None:
    """Raise when the rendering (``segments``: a prompt and a reply segment per assistant turn, then the rest, as
    the encoder cuts it) lacks any part of the canonical conversation ``rec``. ``tools_rendered``: whether the
    rendering with ``tools=`` differs from the one without (the caller renders both). ``located``: the replies were
    found verbatim in the rendering (the one-rendering layout, which has no tool calls), so only the other turns
    need looking for. ``opener``: what the generation prompt writes into a reply (Qwen3.5's "<think>\n"), sought
    with the reply where the prompt before it ends with it."""
    if rec.get("tools") and not tools_rendered:
        names = ", ".join(t["function"]["name"] for t in rec["tools"])
        raise UserError(f"{loc}: the model's chat template does not render the record's tool list ({names}): the "
                        "rendering is the same with and without it, so the model would be trained to call tools "
                        f"it was never shown. {FIX_TOOLS}")
    full = _Text("".join(text for text, _ in segments))
    n_reply = 0
    for i, msg in enumerate(rec["messages"]):
        if msg["role"] != "assistant":
            if not full.has(msg["content"]):
                _lost(loc, i, msg, f"its {msg['role']} text", FIX_TEXT)
            continue
        n_reply += 1
        if located:
            continue
        k = 2 * n_reply - 1
        head = opener if opener and k < len(segments) and segments[k - 1][0].endswith(opener) else ""
        reply = _Text(head + segments[k][0] if k < len(segments) else "")
        for call in msg.get("tool_calls", ()):
            fn = call["function"]
            missing = [p for p in (fn["name"], *_leaves(fn["arguments"])) if not reply.has(p)]
            if missing:
                _lost(loc, i, msg, f"its call of {fn['name']!r} (the reply renders as {reply.text[:80]!r})",
                      FIX_TOOLS)
        if not reply.has(msg["content"]):
            _lost(loc, i, msg, f"its text (the reply renders as {reply.text[:80]!r})", FIX_TEXT)


def _leaves(value) -> list[str]:
    """The keys and scalar values of a call's arguments, as text."""
    if isinstance(value, dict):
        return [x for k, v in value.items() for x in (str(k), *_leaves(v))]
    if isinstance(value, list):
        return [x for v in value for x in _leaves(v)]
    if value is None:  # null / None / nothing, by how a template writes it: nothing to look for
        return []
    return [value if isinstance(value, str) else json.dumps(value)]


def _lost(loc, i: int, msg: dict, what: str, fix: str) -> None:
    raise UserError(f"{loc}: messages[{i}] ({msg['role']}): the model's chat template does not render {what}, so "
                    f"training would not see what the record says. {fix}")


def check_answer(messages: list[dict], rendered: str, loc) -> None:
    """One answer of a preference pair (its assistant messages, rendered as ``rendered``): its text and its tool
    calls must be there, or the pair would compare answers the loss never sees."""
    text = _Text(rendered)
    for i, msg in enumerate(messages):
        for call in msg.get("tool_calls", ()):
            fn = call["function"]
            if not all(text.has(p) for p in (fn["name"], *_leaves(fn["arguments"]))):
                _lost(loc, i, msg, f"its call of {fn['name']!r} (the answer renders as {rendered[:80]!r})",
                      FIX_TEXT)
        if not text.has(msg["content"]):
            _lost(loc, i, msg, f"its text (the answer renders as {rendered[:80]!r})", FIX_TEXT)
