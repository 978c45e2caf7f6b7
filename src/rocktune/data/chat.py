"""Conversations as the ecosystem writes them, turned into the one form a chat template takes.

ShareGPT (``conversations`` of ``{from, value}``: LLaMA-Factory's default, older Axolotl configs) and OpenAI/HF
``messages`` (``{role, content}``, assistant ``tool_calls``, ``tool`` turns, content as a list of parts), with a
``system`` column and a ``tools`` column, all become ``{"messages": [...], "tools": [...], "untrained": [...]}``:
string contents, HF's tool-call layout (``{"type": "function", "function": {"name", "arguments": dict}}``, which the
templates ``tojson``), and the indices of assistant turns whose ``loss_weight`` is 0. Every refusal names the row and
says what to change.
"""

from __future__ import annotations

import json

from rocktune.data import toolcalls
from rocktune.errors import UserError

# ShareGPT tags (LLaMA-Factory's defaults) and OpenAI roles -> the role a template knows; data.roles adds to these.
# OpenAI's "developer" is its newer name for the system role, "function" its older one for a tool's result.
ROLE_TAGS = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system",
             "developer": "system", "function_call": "function_call", "observation": "tool", "tool": "tool",
             "function": "tool"}
TARGETS = ("system", "user", "assistant", "tool", "function_call")
TEXT_PARTS = ("text", "input_text", "output_text")  # HF's and OpenAI's text part types
WEIGHT_KEYS = ("loss_weight", "weight", "train")  # per-message: LLaMA-Factory/TRL, Axolotl's weight and train
# An assistant turn's reasoning, under each ecosystem's key: Qwen's and DeepSeek's templates read reasoning_content,
# gpt-oss's Harmony template thinking; both are set from whichever the record has, so the template finds its own.
REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")


class Where:
    """A message's place for an error, formatted only when a message needs it: the row's location may cost a read
    of the file (a JSONL line number), which every record would pay if it were formatted up front."""

    __slots__ = ("loc", "path")

    def __init__(self, loc, path: str):
        self.loc, self.path = loc, path

    def sub(self, more: str) -> Where:
        return Where(self.loc, self.path + more)

    def __str__(self) -> str:
        return f"{self.loc}: {self.path}"

    __format__ = lambda self, spec: format(str(self), spec)  # noqa: E731 - f-strings format, not str()


def conversation_key(rec: dict) -> str:
    return "conversations" if "conversations" in rec and "messages" not in rec else "messages"


def to_chat(rec: dict, loc, roles: dict[str, str], drop_tools: bool = False) -> dict:
    """The canonical conversation of a record of the messages shape; ``roles``: data.roles (tag -> role).
    ``drop_tools`` (data.tools: drop): the tool list, tool calls and tool results removed; a conversation left
    without an assistant turn gets an empty one, so that it is counted and dropped like any record without a
    target."""
    key = conversation_key(rec)
    turns = rec.get(key)
    if not isinstance(turns, list) or not turns:
        raise UserError(f"{loc}: '{key}' must be a non-empty list of messages ({{'role', 'content'}}, or ShareGPT's "
                        "{'from', 'value'}).")
    messages, untrained = [], []
    for i, turn in enumerate(turns):
        msg, trained = _message(turn, Where(loc, f"{key}[{i}]"), roles)
        if drop_tools and _tool_only(msg):
            continue
        if msg["role"] == "assistant" and not trained:
            untrained.append(len(messages))
        messages.append(msg)
    system = rec.get("system")
    if system is not None and not isinstance(system, str):
        raise UserError(f"{loc}: 'system' must be a string, got {type(system).__name__}.")
    if system and system.strip():
        if messages[0]["role"] == "system":
            raise UserError(f"{loc}: the record has a 'system' column and its conversation starts with a system "
                            "turn as well; keep one of them.")
        messages.insert(0, {"role": "system", "content": system})
        untrained = [i + 1 for i in untrained]
    if drop_tools and not any(m["role"] == "assistant" for m in messages):
        messages.append({"role": "assistant", "content": ""})
    if not any(m["role"] == "assistant" for m in messages):
        raise UserError(f"{loc}: the conversation has no assistant turn, so nothing would carry loss (roles seen: "
                        f"{sorted({m['role'] for m in messages})}; map an assistant tag with data.roles).")
    toolcalls.link(messages)
    out = {"messages": messages}
    # OpenAI's older fine-tuning format lists its tools as bare function schemas under "functions"
    listed = rec.get("tools") if rec.get("tools") not in (None, "", []) else rec.get("functions")
    tools = None if drop_tools else toolcalls.schemas(listed, loc)
    if tools:
        out["tools"] = tools
    if untrained:
        out["untrained"] = untrained
    return out


def _message(turn, where: Where, roles: dict[str, str]) -> tuple[dict, bool]:
    if not isinstance(turn, dict):
        raise UserError(f"{where} must be an object with 'role' and 'content' (or 'from' and 'value'), got "
                        f"{type(turn).__name__}.")
    tag = turn.get("role", turn.get("from"))
    if not isinstance(tag, str):
        raise UserError(f"{where} has no 'role' (or ShareGPT 'from') string; its keys: {sorted(turn)}.")
    role = roles.get(tag) or ROLE_TAGS.get(tag)
    if role is None:
        raise UserError(f"{where} has the role tag {tag!r}, which rocktune does not know (it knows "
                        f"{', '.join(ROLE_TAGS)}); map it in the config, e.g. data.roles: {{{tag}: assistant}} "
                        f"(a tag maps to one of {', '.join(TARGETS)}).")
    trained = _weight(turn, where, role)
    content = turn.get("content", turn.get("value"))
    if role == "function_call":  # ShareGPT's function_call turn: the assistant calling a tool
        return {"role": "assistant", "content": "", "tool_calls": toolcalls.from_text(content, where)}, trained
    if role == "tool" and isinstance(content, dict):  # a tool's JSON result given as an object
        content = json.dumps(content, ensure_ascii=False)
    calls = turn.get("tool_calls")
    if calls is None and isinstance(turn.get("function_call"), dict):  # OpenAI's older single call
        calls = [{"type": "function", "function": turn["function_call"]}]
    msg = {"role": role, "content": _text(content, where, allow_none=role == "assistant" and bool(calls))}
    if calls:
        if role != "assistant":
            raise UserError(f"{where}: only an assistant turn can make tool calls; this one has role {role!r}.")
        msg["tool_calls"] = [toolcalls.call(c, where.sub(f".tool_calls[{j}]")) for j, c in enumerate(calls)]
    for extra in ("tool_call_id", "name"):  # a tool result names the call it answers (Mistral's template needs it)
        if role == "tool" and isinstance(turn.get(extra), str):
            msg[extra] = turn[extra]
    reasoning = next((turn[k] for k in REASONING_KEYS if isinstance(turn.get(k), str) and turn[k].strip()), None)
    if role == "assistant" and reasoning is not None:
        msg.update(dict.fromkeys(REASONING_KEYS[:2], reasoning))
    return msg, trained


def message(turn, where: Where) -> dict:
    """One message in the canonical form (tool calls in HF's layout, content parts joined): for preference pairs."""
    return _message(turn, where, {})[0]


def _tool_only(msg: dict) -> bool:
    """Whether a message goes entirely with data.tools: drop (a tool result, or a call without text); a call
    beside text loses the call and keeps the text."""
    if msg["role"] == "tool":
        return True
    calls = msg.pop("tool_calls", None)
    return bool(calls) and not msg["content"].strip()


def _weight(turn: dict, where: Where, role: str) -> bool:
    """Whether an assistant turn is trained: loss_weight / weight / train 0 or 1 is a mask; anything else would
    scale the loss, which rocktune does not do, so it is refused rather than read as 1."""
    trained = True
    for key in WEIGHT_KEYS:
        if key not in turn or turn[key] is None:
            continue
        value = turn[key]
        if value in (0, 1) and not isinstance(value, str):
            trained = trained and bool(value)
        else:
            raise UserError(f"{where} has {key}={value!r}; rocktune honours a per-message weight of 0 or 1 (train "
                            "this assistant turn or not) and does not scale the loss by other values; round it to "
                            "0 or 1, or drop the key.")
        if role != "assistant" and value:
            raise UserError(f"{where} is a {role} turn with {key}={value!r}: only assistant turns carry loss; to "
                            "train on prompts too set data.train_on_prompt=true, or drop the key.")
    return trained


def content_text(content, where: Where) -> str:
    """A message's content as one string: text parts joined, media parts refused (as for SFT conversations)."""
    return _text(content, where)


def _text(content, where: Where, allow_none: bool = False) -> str:
    """A string content, or a list of parts flattened: text parts joined by newlines (as vLLM flattens them for
    text-only models); a media part cannot be given to a text model, so it is refused by name."""
    if isinstance(content, str):
        return content
    if content is None and allow_none:
        return ""
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if isinstance(part, str):
                texts.append(part)
                continue
            kind = part.get("type") if isinstance(part, dict) else None
            text = part.get("text", part.get("value")) if isinstance(part, dict) else None
            if kind in (None, *TEXT_PARTS) and isinstance(text, str):
                texts.append(text)
                continue
            keys = sorted(part) if isinstance(part, dict) else part
            what = f"a {kind!r} part" if kind else f"a part with keys {keys}"
            raise UserError(f"{where}.content[{j}] is {what}; rocktune trains text models, which cannot take "
                            "images, audio or video: remove the media parts (or the record), keeping the text.")
        return "\n".join(texts)
    raise UserError(f"{where} needs a string 'content' (or 'value'), or a list of text parts; got "
                    f"{type(content).__name__}.")


def has_tools(rec: dict) -> bool:
    """A conversation that the one-rendering layout cannot locate (tool calls, tool turns, a tool list, masked
    turns): it is rendered prefix by prefix instead."""
    return bool(rec.get("tools") or rec.get("untrained")
                or any(m["role"] not in ("system", "user", "assistant") or m.get("tool_calls")
                       or m.get("reasoning_content") for m in rec["messages"]))
