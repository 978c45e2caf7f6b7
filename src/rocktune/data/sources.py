"""Open a data source as an Arrow-backed, memory-mapped ``datasets.Dataset``: the records are never all in memory.

A source is a local file (JSON/JSONL, parquet, CSV, Arrow), a ``save_to_disk`` folder, or a hub dataset id (with
``data.split`` / ``data.subset`` / ``data.revision``). ``data.columns`` renames the source's columns to the names of
a record shape (``{prompt: question}``: the ``question`` column is the prompt). A hub id without network loads from
the local cache, decided by one short probe as for models (``rocktune.models.hub``), never after a minute of retries.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from rocktune.errors import UserError, first_line

# File kinds by suffix: the ``datasets`` packaged builder that reads each.
BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv", ".arrow": "arrow", ".txt": "text",
            ".md": "text"}
TEXT_SUFFIXES = (".txt", ".md")
# datasets' text builder splits by sample_by: a file, a blank-line block or a line is one record
SAMPLE_BY = {"document": "document", "paragraph": "paragraph", "line": "line"}
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


@dataclass
class Source:
    """What a data file setting names, opened: the rows and how to name one of them in an error."""

    dataset: object  # datasets.Dataset (memory-mapped), or an IterableDataset when streamed
    name: str  # the path or hub id, as configured
    kind: str  # json, parquet, csv, arrow, disk, hub
    columns: dict[str, str] = field(default_factory=dict)  # shape key -> source column
    fingerprint: str = ""  # datasets' fingerprint of the rows (content-derived for every kind)
    streamed: bool = False

    def head(self, n: int) -> list[dict]:
        """The first ``n`` rows (fewer when the source is shorter)."""
        if self.streamed:
            return list(self.dataset.take(n))
        return [self.dataset[i] for i in range(min(n, len(self.dataset)))]

    def where(self, row: int) -> str:
        """``file:line`` for JSONL (a line number is what an editor opens), ``file[i]`` for a JSON array, else
        ``name[row N]``."""
        return str(RowLoc(self.name, self.kind, row))

    def describe(self) -> str:
        mapped = ", ".join(f"{k}<-{v}" for k, v in self.columns.items())
        rows = "streamed" if self.streamed else f"{len(self.dataset)} rows"
        return f"{self.name} ({self.kind}, {rows}{'; columns ' + mapped if mapped else ''})"


class RowLoc:
    """Where a row is, for an error: formatted only when a message needs it (a JSONL line number costs a read)."""

    __slots__ = ("name", "kind", "row")

    def __init__(self, name: str, kind: str, row: int):
        self.name, self.kind, self.row = name, kind, row

    def __str__(self) -> str:
        if self.kind == "json" and self.name.endswith(".jsonl"):
            return f"{self.name}:{_jsonl_line(self.name, self.row)}"
        if self.kind == "json":
            return f"{self.name}[{self.row}]"
        return f"{self.name}[row {self.row}]"

    __format__ = lambda self, spec: format(str(self), spec)  # noqa: E731 - f-strings format, not str()


@dataclass
class SourceSettings:
    """The part of the ``data:`` config that says how to open a source (see ``config.DataConfig``)."""

    columns: dict[str, str] = field(default_factory=dict)
    split: str = "train"
    subset: str | None = None
    revision: str | None = None
    cache_dir: Path | None = None  # where datasets keeps the Arrow copy of a local file
    streaming: bool = False  # read as an IterableDataset: no Arrow copy of the source
    text_split: str = "auto"  # plain text files: document, paragraph or line per record (auto: see text_files)


def is_hub_id(spec: str) -> bool:
    return not Path(spec).exists() and Path(spec).suffix.lower() not in BUILDERS and bool(HUB_ID.match(spec))


def check_spec(spec: str, key: str) -> None:
    """Cheap and early (preflight): a path that exists, or something shaped like a hub id."""
    if Path(spec).exists() or is_hub_id(spec):
        return
    where = "" if Path(spec).is_absolute() else f" (relative to the working directory {Path.cwd()})"
    raise UserError(f"{key}: {spec} does not exist{where}; set it to a data file (JSON/JSONL, parquet, CSV, "
                    "Arrow), a save_to_disk folder or a hub dataset id.")


def open_source(spec: str, settings: SourceSettings, key: str = "data.train_file") -> Source:
    """The source ``spec`` names, its columns renamed per ``settings.columns``."""
    path = Path(spec)
    identity = None
    if path.is_dir() and text_files(path):
        ds, kind = _from_text(text_files(path), settings, settings.text_split if settings.text_split != "auto"
                              else "document"), "text"
    elif path.is_dir():
        ds, kind = _from_disk(path, settings.split, key), "disk"
        identity = ds._fingerprint  # taken before streaming: a stream has none
        ds = ds.to_iterable_dataset() if settings.streaming else ds
    elif path.is_file():
        kind = BUILDERS.get(path.suffix.lower())
        if kind is None:
            raise UserError(f"{key}: {spec} has the suffix {path.suffix or '(none)'}, which is not a data format "
                            f"rocktune reads; use {', '.join(sorted(BUILDERS))}, a save_to_disk folder or a hub id.")
        ds = _from_file(path, kind, settings) if kind != "text" else _from_text(
            [path], settings, settings.text_split if settings.text_split != "auto" else "paragraph")
    elif is_hub_id(spec):
        ds, kind = _from_hub(spec, settings, key), "hub"
    else:
        check_spec(spec, key)
        raise AssertionError("unreachable: check_spec raised")
    if not settings.streaming and len(ds) == 0:
        raise UserError(f"data file {spec} holds no records.")
    if identity is None:  # a streamed hub set has no fingerprint: what names it must do
        identity = getattr(ds, "_fingerprint", "") or f"{spec}@{settings.revision}:{settings.subset}:{settings.split}"
    ds = _rename(ds, settings.columns, spec)
    return Source(ds, spec, kind, dict(settings.columns), identity, settings.streaming)


def _from_file(path: Path, builder: str, settings: SourceSettings):
    import datasets

    if path.stat().st_size == 0:
        raise UserError(f"data file {path} is empty; it needs at least one record.")
    cache = str(settings.cache_dir / "sources") if settings.cache_dir else None
    # CSV cells are text: " 03" stays a string (not the number 3) and an empty cell an empty string (not NaN).
    extra = {"features": _csv_text(path), "keep_default_na": False} if builder == "csv" else {}
    try:
        with quiet():
            return datasets.load_dataset(builder, data_files=str(path), split="train", cache_dir=cache,
                                         streaming=settings.streaming, **extra)
    except Exception as exc:  # noqa: BLE001 - pyarrow/datasets raise many types for one malformed file
        if builder == "json":
            _explain_json(path)  # our reader names the line and what is wrong with it
        raise UserError(f"{path}: cannot be read as {builder} ({type(exc).__name__}: {first_line(exc)}); check "
                        "that the file is what its suffix says.") from None


def text_files(folder: Path) -> list[Path]:
    """The .txt/.md files under a folder that is not a save_to_disk folder (which holds Arrow files and JSON)."""
    if any((folder / marker).is_file() for marker in ("dataset_dict.json", "state.json", "dataset_info.json")):
        return []
    return sorted(p for p in folder.rglob("*") if p.is_file() and p.suffix.lower() in TEXT_SUFFIXES
                  and not any(part.startswith(".") for part in p.relative_to(folder).parts))


def _from_text(paths: list[Path], settings: SourceSettings, split_by: str):
    """Plain text for continued pretraining, through datasets' text builder: the ``text`` shape, one record per
    file, blank-line block or line; a block or line without its surrounding newlines, and blank ones skipped."""
    import datasets

    if all(p.stat().st_size == 0 for p in paths):
        raise UserError(f"data file {paths[0] if len(paths) == 1 else paths[0].parent} is empty; it needs text.")
    cache = str(settings.cache_dir / "sources") if settings.cache_dir else None
    try:
        with quiet():
            ds = datasets.load_dataset("text", data_files=[str(p) for p in paths], split="train", cache_dir=cache,
                                       streaming=settings.streaming, sample_by=SAMPLE_BY[split_by],
                                       keep_linebreaks=False)
            if split_by != "document":
                ds = ds.map(lambda r: {"text": r["text"].strip("\n")})
            return ds.filter(lambda r: bool(r["text"].strip()))  # a blank block is no example
    except Exception as exc:  # noqa: BLE001 - a file that is not UTF-8 text, and the like
        raise UserError(f"{paths[0]}: cannot be read as UTF-8 text ({type(exc).__name__}: {first_line(exc)}); save "
                        "it as UTF-8.") from None


def _csv_text(path: Path):
    """Every column of the CSV file as a string column (the header names them)."""
    import csv

    import datasets

    with open(path, encoding="utf-8", newline="") as f:
        header = next(csv.reader(f), [])
    return datasets.Features({name: datasets.Value("string") for name in header})


def _explain_json(path: Path) -> None:
    """Raise the precise record-level error when ``datasets``' JSON reader failed; our reader finds it."""
    from rocktune.data import records

    recs = records.read_records(path)
    records.validate(recs, records.detect_shape(recs, "auto"))
    # Valid records of mixed types that Arrow cannot put in one column (a number in one row, a string in another).


def _from_disk(path: Path, split: str, key: str):
    import datasets

    try:
        ds = datasets.load_from_disk(str(path))
    except FileNotFoundError as exc:
        raise UserError(f"{key}: {path} is a folder but not one written by datasets' save_to_disk "
                        f"({first_line(exc)}); give a data file or a save_to_disk folder.") from None
    if isinstance(ds, datasets.DatasetDict):
        if split not in ds:
            raise UserError(f"{key}: {path} holds the splits {sorted(ds)}, not data.split={split}; set data.split.")
        ds = ds[split]
    return ds


def _from_hub(repo_id: str, settings: SourceSettings, key: str):
    """Reachable hub: as usual; unreachable or HF_HUB_OFFLINE: the local cache only, or one paragraph saying why."""
    import datasets
    from huggingface_hub import constants

    from rocktune.models import hub

    offline = datasets.config.HF_HUB_OFFLINE
    problem = None if offline else hub.probe(constants.ENDPOINT)
    if problem is not None:  # datasets reads this per call: the cache answers at once instead of retrying
        datasets.config.HF_HUB_OFFLINE = True
        os.environ["HF_DATASETS_OFFLINE"] = "1"
    try:
        with quiet():
            return datasets.load_dataset(repo_id, settings.subset, split=settings.split, revision=settings.revision,
                                         streaming=settings.streaming)
    except Exception as exc:  # noqa: BLE001 - connection, missing split/config and cache errors differ by version
        why = "HF_HUB_OFFLINE is set" if offline else (f"the hub cannot be reached ({problem})" if problem else "")
        raise UserError(
            f"{key}={repo_id} is a hub dataset id{', ' + why if why else ''} and it cannot be loaded "
            f"(subset {settings.subset}, split {settings.split}; {type(exc).__name__}: {first_line(exc)}; cache "
            f"{datasets.config.HF_DATASETS_CACHE}). Save it on a machine with network (load_dataset(...)"
            ".save_to_disk(DIR)) and point the setting at DIR, or at a parquet/JSONL file; or load it once online "
            "so the cache holds it.") from None


KEYS = ("text", "prompt", "completion", "instruction", "input", "output", "messages", "conversations", "system",
        "tools", "history")
KEYS += ("chosen", "rejected")  # preference pairs (tasks/preference/pairs.py)
KEYS += ("images", "image")  # a vision-language row's images (tasks/vlm/data/vision.py)


def _rename(ds, columns: dict[str, str], spec: str):
    if not columns:
        return ds
    names = ds.column_names
    if names is None:  # a stream whose columns are known only from its first row
        names = list(next(iter(ds.take(1)), {}))
    if any("." in src and src not in names for src in columns.values()) and hasattr(ds, "flatten"):
        # a nested field (input.messages): datasets' flatten names a struct's fields with dots
        ds = ds.flatten()
        names = ds.column_names
    unknown = sorted(set(columns) - set(KEYS))
    if unknown:
        raise UserError(f"data.columns has {unknown}, which no record shape uses; its keys are record keys "
                        f"({', '.join(KEYS)}) and its values the columns of {spec} that hold them.")
    missing = [src for src in columns.values() if src not in names]
    if missing:
        raise UserError(f"data.columns maps to {missing}, which {spec} does not have (its columns: "
                        f"{names}; a nested field is named with dots, e.g. input.messages, except in a streamed "
                        "source); fix data.columns.")
    # A column already named like a shape key that is being replaced by a mapped one would collide: drop it.
    clash = [k for k, v in columns.items() if k in names and k != v and k not in columns.values()]
    ds = ds.remove_columns(clash) if clash else ds
    return ds.rename_columns({v: k for k, v in columns.items() if k != v})


def _jsonl_line(path: str, row: int) -> int:
    """The line of the ``row``-th record (blank lines are not records); read only on the error path."""
    seen = -1
    with open(path, encoding="utf-8", errors="replace") as f:
        for lineno, line in enumerate(f, start=1):
            seen += bool(line.strip())
            if seen == row:
                return lineno
    return row + 1


class quiet:
    """datasets' progress bars and log lines, off while it reads a source: rocktune shows its own progress, and a
    reader's failure becomes one UserError (datasets would also log it as an ERROR line)."""

    def __enter__(self):
        import datasets

        self._was = datasets.is_progress_bar_enabled()
        datasets.disable_progress_bars()
        self._level = datasets.logging.get_verbosity()
        datasets.logging.set_verbosity(datasets.logging.CRITICAL)

    def __exit__(self, *exc):
        import datasets

        if self._was:
            datasets.enable_progress_bars()
        datasets.logging.set_verbosity(self._level)
