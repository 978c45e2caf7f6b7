"""The rows of a source as the non-SFT readers take them (preference pairs, GRPO prompts): opened as SFT opens
them, with ``data.columns`` applied, each with the place an error names; and one chat message of such a row."""

from __future__ import annotations

from rocktune.data import chat
from rocktune.data.chat import Where, content_text
from rocktune.errors import UserError


def read_rows(spec: str, d, cache_dir, key: str, eval_side: bool = False) -> list[tuple[object, dict]]:
    """``(where, row)`` of every row of a source, opened as SFT opens it (files, save_to_disk folders, hub ids,
    ``data.columns``); ``where`` formats as the file:line (JSONL) or row an error names. JSON and JSONL are read by
    rocktune's own reader: a pair's fields may differ in kind from row to row (text here, messages there, a wrong
    type to be named), which a table's columns cannot hold."""
    from pathlib import Path

    from rocktune.data.dataset import source_settings
    from rocktune.data.records import read_records
    from rocktune.data.sources import RowLoc, open_source

    if Path(spec).is_file() and Path(spec).suffix.lower() in (".json", ".jsonl"):
        rows = read_records(spec)
        missing = {src for src in d.columns.values() if nested(rows[0][1], src) is None}
        if missing:
            raise UserError(f"data.columns maps to {sorted(missing)}, which {rows[0][0]} does not have (its keys: "
                            f"{sorted(rows[0][1])}; a nested field is named with dots, e.g. input.messages); fix "
                            "data.columns.")
        return [(where, mapped(row, d.columns)) for where, row in rows]
    src = open_source(spec, source_settings(d, cache_dir, eval_side), key)
    return [(RowLoc(src.name, src.kind, i), row) for i, row in enumerate(src.dataset)]


def nested(row: dict, path: str):
    """``row``'s field at ``path``: a key, or keys joined by dots for a nested field (``input.messages``)."""
    if path in row:
        return row[path]
    value = row
    for key in path.split("."):
        if not isinstance(value, dict) or key not in value:
            return None
        value = value[key]
    return value


def mapped(row: dict, columns: dict[str, str]) -> dict:
    """``row`` with each mapped field under its record key (a top-level source key renamed, a nested one copied)."""
    out = {k: v for k, v in row.items() if k not in columns.values()}
    out.update({key: nested(row, src) for key, src in columns.items()})
    return out


def message(msg, where: str) -> dict:
    """A chat message of a row, in the layout chat templates take (a tool call or result as data/chat.py lays it
    out), or a UserError naming ``where``."""
    if isinstance(msg, dict) and (msg.get("tool_calls") or msg.get("function_call")
                                  or msg.get("role") in ("tool", "function")):
        return chat.message(msg, Where(where, "message"))  # a call or a result, in the layout templates take
    if not (isinstance(msg, dict) and isinstance(msg.get("content"), (str, list))
            and msg.get("role") in ("system", "developer", "user", "assistant")):
        raise UserError(f"{where} must be an object with 'role' (system, user, assistant) and string 'content'.")
    # content parts (OpenAI's and HF's lists of text parts) are joined as SFT joins them; OpenAI's developer role
    # is its newer name for the system role
    role = "system" if msg["role"] == "developer" else msg["role"]
    return {"role": role, "content": content_text(msg["content"], Where(where, "message"))}
