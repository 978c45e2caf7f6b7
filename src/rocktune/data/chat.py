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

from rocktune.errors import UserError

# ShareGPT tags (LLaMA-Factory's defaults) and OpenAI roles -> the role a template knows; data.roles adds to these.
ROLE_TAGS = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system",
             "function_call": "function_call", "observation": "tool", "tool": "tool"}
TARGETS = ("system", "user", "assistant", "tool", "function_call")
TEXT_PARTS = ("text", "input_text", "output_text")  # HF's and OpenAI's text part types
WEIGHT_KEYS = ("loss_weight", "weight", "train")  # per-message: LLaMA-Factory/TRL, Axolotl's weight and train


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


def to_chat(rec: dict, loc, roles: dict[str, str]) -> dict:
    """The canonical conversation of a record of the messages shape; ``roles``: data.roles (tag -> role)."""
    key = conversation_key(rec)
    turns = rec.get(key)
    if not isinstance(turns, list) or not turns:
        raise UserError(f"{loc}: '{key}' must be a non-empty list of messages ({{'role', 'content'}}, or ShareGPT's "
                        "{'from', 'value'}).")
    messages, untrained = [], []
    for i, turn in enumerate(turns):
        msg, trained = _message(turn, Where(loc, f"{key}[{i}]"), roles)
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
    if not any(m["role"] == "assistant" for m in messages):
        raise UserError(f"{loc}: the conversation has no assistant turn, so nothing would carry loss (roles seen: "
                        f"{sorted({m['role'] for m in messages})}; map an assistant tag with data.roles).")
    _link_calls(messages)
    out = {"messages": messages}
    tools = _tools(rec.get("tools"), loc)
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
        return {"role": "assistant", "content": "", "tool_calls": _calls_from_text(content, where)}, trained
    if role == "tool" and isinstance(content, dict):  # a tool's JSON result given as an object
        content = json.dumps(content, ensure_ascii=False)
    calls = turn.get("tool_calls")
    if calls is None and isinstance(turn.get("function_call"), dict):  # OpenAI's older single call
        calls = [{"type": "function", "function": turn["function_call"]}]
    msg = {"role": role, "content": _text(content, where, allow_none=role == "assistant" and bool(calls))}
    if calls:
        if role != "assistant":
            raise UserError(f"{where}: only an assistant turn can make tool calls; this one has role {role!r}.")
        msg["tool_calls"] = [_call(c, where.sub(f".tool_calls[{j}]")) for j, c in enumerate(calls)]
    for extra in ("tool_call_id", "name"):  # a tool result names the call it answers (Mistral's template needs it)
        if role == "tool" and isinstance(turn.get(extra), str):
            msg[extra] = turn[extra]
    return msg, trained


def _link_calls(messages: list[dict]) -> None:
    """Ids for calls that have none (ShareGPT's function_call turns), each tool result without one taking the
    oldest unanswered call's: templates that pair results with calls by id (Mistral's, nine alphanumerics) can then
    render data written without them; templates that ignore ids render the same."""
    pending, n = [], 0
    for msg in messages:
        for call in msg.get("tool_calls", ()):
            if "id" not in call:
                n += 1
                call["id"] = f"call{n:05d}"
            pending.append(call["id"])
        if msg["role"] == "tool":
            answered = msg.get("tool_call_id")
            if answered is None and pending:
                msg["tool_call_id"] = pending.pop(0)
            elif answered in pending:
                pending.remove(answered)


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


def _calls_from_text(content, where: Where) -> list[dict]:
    """ShareGPT's function_call value: a JSON object {name, arguments} (or a list of them), usually as a string."""
    value = content
    if isinstance(content, str):
        try:
            value = json.loads(content)
        except ValueError:
            raise UserError(f"{where} is a function_call turn whose value is not JSON ({content[:60]!r}); it must be "
                            '{"name": ..., "arguments": {...}} (or a list of them).') from None
    calls = value if isinstance(value, list) else [value]
    return [_call(c, where.sub(f"[{j}]")) for j, c in enumerate(calls)]


def _call(call, where: Where) -> dict:
    """One tool call in HF's layout; ``arguments`` as an object, since the templates ``tojson`` it (a JSON string
    would be written twice-encoded)."""
    if not isinstance(call, dict):
        raise UserError(f"{where} must be an object, got {type(call).__name__}.")
    fn = call.get("function", call)
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise UserError(f"{where} must name the function: {{'type': 'function', 'function': {{'name': ..., "
                        "'arguments': {...}}}} or {'name': ..., 'arguments': {...}}.")
    args = fn.get("arguments", fn.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except ValueError:
            raise UserError(f"{where}: the arguments of {fn['name']!r} are not JSON ({args[:60]!r}).") from None
    if not isinstance(args, dict):
        raise UserError(f"{where}: the arguments of {fn['name']!r} must be a JSON object, got {type(args).__name__}.")
    out = {"type": "function", "function": {"name": fn["name"], "arguments": args}}
    if isinstance(call.get("id"), str):
        out["id"] = call["id"]
    return out


def _tools(tools, loc) -> list[dict] | None:
    """The tools column: a list of JSON schemas, or a JSON string of one (LLaMA-Factory's); a bare function schema
    is wrapped as OpenAI's ``{"type": "function", "function": ...}``, the form HF templates take."""
    if tools is None or tools == "" or tools == []:
        return None
    if isinstance(tools, str):
        try:
            tools = json.loads(tools)
        except ValueError:
            raise UserError(f"{loc}: 'tools' is a string that is not JSON ({tools[:60]!r}); it must be a list of "
                            "function schemas, or a JSON string of one.") from None
    if isinstance(tools, dict):
        tools = [tools]
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise UserError(f"{loc}: 'tools' must be a list of function schemas ({{'name', 'description', "
                        "'parameters'}, or OpenAI's {'type': 'function', 'function': {...}}).")
    out = []
    for j, tool in enumerate(tools):
        fn = tool.get("function", tool)
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise UserError(f"{loc}: tools[{j}] has no function 'name'; each tool is a function schema.")
        out.append({"type": tool.get("type", "function"), "function": fn})
    return out or None


def has_tools(rec: dict) -> bool:
    """A conversation that the one-rendering layout cannot locate (tool calls, tool turns, a tool list, masked
    turns): it is rendered prefix by prefix instead."""
    return bool(rec.get("tools") or rec.get("untrained")
                or any(m["role"] not in ("system", "user", "assistant") or m.get("tool_calls")
                       for m in rec["messages"]))


def from_instruction(rec: dict, shape: str) -> dict:
    """An Alpaca or prompt/completion record as a single-turn conversation (LLaMA-Factory's rendering of Alpaca
    through the model's template: instruction and input joined by a newline; ``history`` pairs before it)."""
    if shape == "alpaca":
        user = rec["instruction"] + ("\n" + rec["input"] if rec.get("input") else "")
        reply = rec["output"]
    else:
        user, reply = rec["prompt"], rec["completion"]
    messages = [{"role": "system", "content": rec["system"]}] if isinstance(rec.get("system"), str) and \
        rec["system"].strip() else []
    for pair in (rec.get("history") or []) if shape == "alpaca" else []:
        messages += [{"role": "user", "content": pair[0]}, {"role": "assistant", "content": pair[1]}]
    return {"messages": messages + [{"role": "user", "content": user}, {"role": "assistant", "content": reply}]}


def uses_template(setting: str, shape: str, tokenizer) -> bool:
    """Whether instruction records are rendered through the chat template (data.chat_template). auto: Alpaca yes,
    where the tokenizer has a template (LLaMA-Factory renders Alpaca data through the model's template);
    prompt/completion no (TRL trains plain prompt/completion strings as they are)."""
    if shape not in ("alpaca", "prompt_completion") or setting == "never":
        return False
    has = bool(getattr(tokenizer, "chat_template", None))
    if setting == "always":
        if not has:
            raise UserError("data.chat_template=always, but this tokenizer has no chat template; use an instruct "
                            "model's tokenizer, or set data.chat_template=auto.")
        return True
    return shape == "alpaca" and has
