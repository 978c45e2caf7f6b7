"""Read JSON / JSONL files into records, detect their shape and validate every record.

Errors name the file and line (JSONL) or record index (JSON array) and say how to fix the input. Whatever stops
a record from parsing (malformed JSON, nesting deeper than the parser's recursion limit, an integer too long to
convert) is such an error, never a traceback.
"""

from __future__ import annotations

from pathlib import Path

from rocktune.data import chat, instruct, meaning
from rocktune.errors import UserError
from rocktune.readers.json_file import JsonProblem, parse_json

# Keys that identify each shape; detection looks at the first record, validation checks every record.
SHAPES: dict[str, tuple[str, ...]] = {
    "messages": ("messages",),
    "prompt_completion": ("prompt", "completion"),
    "alpaca": ("instruction", "output"),
    "text": ("text",),
}
# A conversation under another name: ShareGPT's (LLaMA-Factory's default); its turns are normalised by data/chat.py.
ALIASES = {"conversations": "messages"}
# What the model learns from in each shape: a record whose targets are all empty teaches nothing.
TARGETS = {"prompt_completion": "completion", "alpaca": "output", "text": "text"}


def read_records(path: str | Path) -> list[tuple[str, dict]]:
    """Return ``(location, record)`` pairs; location is ``file:line`` or ``file[index]``."""
    path = Path(path)
    if not path.is_file():
        where = "" if path.is_absolute() else f" (relative to the working directory {Path.cwd()})"
        raise UserError(f"data file {path} does not exist{where}; set data.train_file / data.eval_file to a "
                        "JSON/JSONL file.")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise UserError(f"{path}: not UTF-8 text (byte {exc.start}: {exc.reason}); save the file as UTF-8.") from None
    except OSError as exc:
        raise UserError(f"data file {path} cannot be read ({exc.strerror or exc}); check its permissions.") from None
    if not text.strip():
        raise UserError(f"data file {path} is empty; it needs at least one record.")
    if path.suffix == ".json" or text.lstrip().startswith("["):
        records = _read_json_array(path, text)
    else:
        records = _read_jsonl(path, text)
    for loc, rec in records:
        if not isinstance(rec, dict):
            raise UserError(f"{loc}: each record must be a JSON object, got {type(rec).__name__}.")
    if not records:
        raise UserError(f"data file {path} holds no records.")
    return records


MAX_BAD_LINES = 20  # a file of bad lines is named by its first few, with the count of the rest


def _read_jsonl(path: Path, text: str) -> list[tuple[str, dict]]:
    """Every bad line is reported at once (up to MAX_BAD_LINES), so one fix-and-rerun round fixes them all."""
    out, bad, n_bad = [], [], 0
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            out.append((f"{path}:{lineno}", parse_json(line)))
            continue
        except JsonProblem as exc:
            why = _why(exc)
        n_bad += 1
        if n_bad <= MAX_BAD_LINES:
            bad.append(f"{path}:{lineno}: {why}")
    if n_bad:
        raise UserError(_bad_lines(path, bad, n_bad))
    return out


def scan_jsonl(path: Path) -> int:
    """A JSONL file checked line by line as ``read_records`` checks it (every bad line named, file:line), but
    streamed: memory is bounded by the longest line, never the file, so a file of any size is checked before a
    worker starts. Returns the number of records."""
    bad, n_bad, n = [], 0, 0
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise UserError(f"{path}:{lineno}: not UTF-8 text (byte {exc.start} of the line: {exc.reason}); "
                                "save the file as UTF-8.") from None
            if not line.strip():
                continue
            try:
                rec = parse_json(line)
                why = None if isinstance(rec, dict) else f"each record must be a JSON object, got {type(rec).__name__}"
            except JsonProblem as exc:
                why = _why(exc)
            n += why is None
            n_bad += why is not None
            if why is not None and n_bad <= MAX_BAD_LINES:
                bad.append(f"{path}:{lineno}: {why}")
    if n_bad:
        raise UserError(_bad_lines(path, bad, n_bad))
    if not n:
        raise UserError(f"data file {path} holds no records.")
    return n


def _why(exc: JsonProblem) -> str:
    return str(exc) if exc.malformed else _advice(exc).rstrip(".")


def _bad_lines(path: Path, bad: list[str], n_bad: int) -> str:
    more = f"; and {n_bad - MAX_BAD_LINES} more" if n_bad > MAX_BAD_LINES else ""
    return (f"{'; '.join(bad)}{more}. {n_bad} line{'s' if n_bad > 1 else ''} of {path} cannot be parsed; each line "
            "must be one JSON object.")


def _advice(exc: JsonProblem, jsonl: bool = True) -> str:
    # the hardened reader says what is wrong; a data file adds how to fix a record
    if exc.malformed:
        return f"{exc}; each line must be one JSON object." if jsonl else f"{exc}."
    if "nested too deeply" in str(exc):
        return f"{exc}; a record needs only strings and one list of messages: flatten or remove the nested data."
    return f"{exc}; fix or remove the record."


def _read_json_array(path: Path, text: str) -> list[tuple[str, dict]]:
    try:
        data = parse_json(text)
    except JsonProblem as exc:
        where = f"{path}:{exc.lineno}" if exc.lineno else str(path)
        raise UserError(f"{where}: {_advice(exc, jsonl=False)}") from None
    if not isinstance(data, list):
        raise UserError(f"{path}: a .json data file must hold an array of records (or use JSONL, one per line).")
    return [(f"{path}[{i}]", rec) for i, rec in enumerate(data)]


def detect_shape(records: list[tuple[str, dict]], requested: str) -> str:
    """The shape named in the config, or the one whose keys the first record has."""
    if requested != "auto":
        return requested
    loc, first = records[0]
    meaning.refuse(first, loc)  # a preference or KTO set is named as such, not as a shape missing a key
    for key, shape in ALIASES.items():
        if key in first:
            return shape
    for shape, keys in SHAPES.items():
        if all(k in first for k in keys):
            return shape
    near = max(SHAPES, key=lambda s: sum(k in first for k in SHAPES[s]))
    if any(k in first for k in SHAPES[near]):  # e.g. a prompt without its completion: name what is missing
        missing = [k for k in SHAPES[near] if k not in first]
        raise UserError(f"{loc}: record is missing {', '.join(repr(k) for k in missing)} (the {near} shape needs "
                        f"{list(SHAPES[near])}; this record has {sorted(first)}); if the data holds it under another "
                        f"name, map it with data.columns, e.g. data.columns: {{{missing[0]}: <its column>}}.")
    known = "; ".join(f"{s}: {{{', '.join(repr(k) for k in keys)}}}" for s, keys in SHAPES.items())
    raise UserError(
        f"{loc}: unknown record shape with keys {sorted(first)}; expected one of {known} (a conversation may also be "
        "ShareGPT's 'conversations' of {'from', 'value'} turns). Map your columns to these keys with data.columns, "
        "e.g. data.columns: {prompt: question, completion: answer} or {messages: dialog}; docs/data.md lists the "
        "shapes."
    )


def validate(records: list[tuple[str, dict]], shape: str) -> None:
    prepare(records, shape)


def prepare(records: list[tuple[object, dict]], shape: str, roles: dict[str, str] | None = None,
            templated: bool = False, drop_tools: bool = False) -> list[dict]:
    """Every record checked and in the form the encoder takes: a conversation normalised (``chat.to_chat``:
    ShareGPT, tool calls, content parts, per-message weights; ``roles``: data.roles; ``drop_tools``: data.tools:
    drop), an instruction record checked, and with ``templated`` turned into a single-turn conversation. Keys that
    change what is learned are refused."""
    out = []
    for loc, rec in records:
        meaning.refuse(rec, loc)
        if shape == "messages":
            out.append(chat.to_chat(rec, loc, roles or {}, drop_tools))
            continue
        _check_strings(loc, rec, shape)
        out.append(instruct.from_instruction(rec, shape) if templated else rec)
    return out


def _check_strings(loc: str, rec: dict, shape: str) -> None:
    for key in SHAPES[shape]:
        if key not in rec:
            raise UserError(f"{loc}: record is missing '{key}' (shape {shape} needs {list(SHAPES[shape])}).")
        if not isinstance(rec[key], str):
            raise UserError(f"{loc}: '{key}' must be a string, got {type(rec[key]).__name__}.")
    if shape == "alpaca" and not isinstance(rec.get("input", ""), str):
        raise UserError(f"{loc}: 'input' must be a string, got {type(rec['input']).__name__}.")
    history = rec.get("history") if shape == "alpaca" else None
    if history is not None and not (isinstance(history, list) and all(
            isinstance(p, list) and len(p) == 2 and all(isinstance(x, str) for x in p) for p in history)):
        raise UserError(f"{loc}: 'history' must be a list of [instruction, response] string pairs.")


def drop_empty_targets(records: list[tuple[str, dict]], shape: str, path: str | Path
                       ) -> tuple[list[tuple[str, dict]], str | None]:
    """Records whose every target (assistant turn, completion, output, text) is empty, removed; with a note saying
    how many and where. Raises when nothing would remain: an error about the data, not about splitting it."""
    empty = [loc for loc, rec in records if _targets_empty(rec, shape)]
    if not empty:
        return records, None
    if len(empty) == len(records):
        raise UserError(all_empty(empty[:3], len(records), shape, path))
    keep = [(loc, rec) for loc, rec in records if not _targets_empty(rec, shape)]
    return keep, empty_note(empty[:3], len(empty), len(records), shape, path)


def all_empty(first: list, n_records: int, shape: str, path: str | Path) -> str:
    """The error when no record of ``path`` has a target; ``first``: where the first (up to 3) records are."""
    what = "no non-empty assistant turn" if shape == "messages" else f"an empty '{TARGETS[shape]}'"
    where = ", ".join(str(w) for w in first[:3]) + (f" and {n_records - 3} more" if n_records > 3 else "")
    whose = "the only record has" if n_records == 1 else f"all {n_records} records have"
    fill = "assistant replies" if shape == "messages" else f"'{TARGETS[shape]}' fields"
    return f"{where}: {whose} {what}, so {path} holds nothing to learn from; fill in the {fill}."


def empty_note(first: list, n_empty: int, n_records: int, shape: str, path: str | Path) -> str:
    """The note for ``n_empty`` records without targets; ``first``: where the first (up to 3) of them are."""
    what = "no non-empty assistant turn" if shape == "messages" else f"an empty '{TARGETS[shape]}'"
    where = ", ".join(str(w) for w in first[:3]) + (f" and {n_empty - 3} more" if n_empty > 3 else "")
    return f"{n_empty} of {n_records} records of {path} have {what} and were dropped ({where})"


def targets_empty(rec: dict, shape: str) -> bool:
    return _targets_empty(rec, shape)


def _targets_empty(rec: dict, shape: str) -> bool:
    if shape == "messages":  # a canonical conversation (records.prepare): tool calls and masked turns count
        skip = set(rec.get("untrained", ()))
        return all(not m["content"].strip() and not m.get("tool_calls")
                   for i, m in enumerate(rec["messages"]) if m["role"] == "assistant" and i not in skip)
    return not rec[TARGETS[shape]].strip()
