"""Tool calls and tool lists as datasets write them, in the layout chat templates take.

A call becomes ``{"type": "function", "function": {"name", "arguments": dict}}`` (the templates ``tojson`` the
arguments, so a JSON string would be written twice-encoded), from OpenAI's layout, its older ``function_call``, or
ShareGPT's ``function_call`` turn; a tool list from a list of schemas or a JSON string of one (LLaMA-Factory's).
"""

from __future__ import annotations

import json

from rocktune.errors import UserError


def link(messages: list[dict]) -> None:
    """Ids for calls that have none (ShareGPT's function_call turns), each tool result without one taking the
    oldest unanswered call's: templates that pair results with calls by id (Mistral's, nine alphanumerics) can then
    render data written without them; templates that ignore ids render the same."""
    pending, n = [], 0
    for msg in messages:
        for made in msg.get("tool_calls", ()):
            if "id" not in made:
                n += 1
                made["id"] = f"call{n:05d}"
            pending.append(made["id"])
        if msg["role"] == "tool":
            answered = msg.get("tool_call_id")
            if answered is None and pending:
                msg["tool_call_id"] = pending.pop(0)
            elif answered in pending:
                pending.remove(answered)


def from_text(content, where) -> list[dict]:
    """ShareGPT's function_call value: a JSON object {name, arguments} (or a list of them), usually as a string."""
    value = _json(content, lambda: f"{where} is a function_call turn whose value is not JSON "
                  f'({str(content)[:60]!r}); it must be {{"name": ..., "arguments": {{...}}}} (or a list of them).')
    calls = value if isinstance(value, list) else [value]
    return [call(c, where.sub(f"[{j}]")) for j, c in enumerate(calls)]


def _json(value, refusal):
    """``value`` parsed when it is a JSON string (datasets and LLaMA-Factory keep nested values as strings), else as
    it is; a string that is not JSON is refused with ``refusal()``, built only then (a JSONL row's location reads
    the file)."""
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except ValueError:
        raise UserError(refusal()) from None


def call(call, where) -> dict:
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


def schemas(tools, loc) -> list[dict] | None:
    """The tools column: a list of JSON schemas, or a JSON string of one (LLaMA-Factory's); a bare function schema
    is wrapped as OpenAI's ``{"type": "function", "function": ...}``, the form HF templates take."""
    if tools is None or tools == "" or tools == []:
        return None
    tools = _json(tools, lambda: f"{loc}: 'tools' is a string that is not JSON ({str(tools)[:60]!r}); it must be "
                  "a list of function schemas, or a JSON string of one.")
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
