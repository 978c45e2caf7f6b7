"""JSON from outside files, with a depth bound: nesting deeper than the interpreter's recursion limit (about 1,000
levels; a million-level ``[[[[...`` costs a few megabytes) stops the C parser with ``RecursionError`` before any
memory grows, and that, malformed JSON and unconvertible numbers become one ``UserError`` naming the file."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rocktune.errors import UserError, first_line


class JsonProblem(ValueError):
    """Why a JSON text cannot be parsed, worded for the user; the caller adds where and how to fix it."""

    def __init__(self, reason: str, lineno: int | None = None):
        super().__init__(reason)
        self.lineno = lineno  # set for malformed JSON only (the line of the error), None for a hostile shape

    @property
    def malformed(self) -> bool:
        """Plain syntax error (e.g. a line cut short by a crash), as opposed to nesting or numbers out of bounds."""
        return self.lineno is not None


def parse_json(text: str | bytes) -> Any:
    """``json.loads`` whose every failure is a ``JsonProblem`` (a ValueError) with a one-line reason."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise JsonProblem(f"malformed JSON ({_where(exc)})", exc.lineno) from None
    except RecursionError:
        raise JsonProblem("the JSON is nested too deeply to parse (deeper than Python's recursion limit, about "
                          "1,000 levels)") from None
    except ValueError as exc:  # e.g. an integer longer than int's digit limit
        raise JsonProblem(f"the JSON cannot be parsed ({first_line(exc)})") from None


def read_json(path: Path, fix: str, expect: type | None = dict) -> Any:
    """The parsed file, or a ``UserError`` naming ``path`` and ending in ``fix`` (how to repair or replace it)."""
    try:
        data = parse_json(Path(path).read_bytes())
    except OSError as exc:
        raise UserError(f"{path} cannot be read ({exc.strerror or exc}); {fix}") from None
    except JsonProblem as exc:
        where = f"{path}:{exc.lineno}" if exc.lineno else str(path)
        raise UserError(f"{where}: {exc}; {fix}") from None
    if expect is not None and not isinstance(data, expect):
        raise UserError(f"{path} does not hold a JSON {_kind(expect)}; {fix}")
    return data


def _where(exc: json.JSONDecodeError) -> str:
    # Some messages already end in "at" ("Unterminated string starting at").
    return f"{exc.msg} column {exc.colno}" if exc.msg.endswith(" at") else f"{exc.msg} at column {exc.colno}"


def _kind(expect: type) -> str:
    return {dict: "object", list: "array"}.get(expect, expect.__name__)


def first_record(train_file: str | None) -> dict | None:
    """The first record of a JSON/JSONL train_file, or None."""
    if not train_file or not Path(train_file).is_file():
        return None
    try:
        with open(train_file, encoding="utf-8") as f:
            head = f.read(1 << 20).lstrip()
        first = parse_json(head.splitlines()[0]) if not head.startswith("[") else parse_json(head)[0]
    except (JsonProblem, IndexError, KeyError, TypeError, OSError, ValueError):
        return None
    return first if isinstance(first, dict) else None
