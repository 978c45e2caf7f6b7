"""The rows of a vision-language source: JSON/JSONL by rocktune's own reader (file:line in errors; a row's content
may be text here and parts there), parquet, Arrow, ``save_to_disk`` folders and hub ids through ``datasets`` as the
LM's sources are opened (data/sources.py). Image columns (``datasets.Image``, alone or in a list, as TRL's vision
sets store them) are read undecoded: ``{"bytes", "path"}`` values that tasks/vlm/data/images.py opens and checks
itself."""

from __future__ import annotations

from pathlib import Path

from rocktune.data.dataset import source_settings
from rocktune.errors import UserError
from rocktune.data.records import read_records
from rocktune.data.sources import RowLoc, open_source

VISION_KEYS = ("messages", "conversations", "images", "image")


def read_rows(spec: str, d, cache_dir: Path, key: str) -> tuple[list[tuple[object, dict]], Path]:
    """(``(where, row)`` of every row, the folder that relative image paths start from). ``data.columns`` renames
    a row's keys (``{messages: dialog, images: pictures}``); a hub id or ``DatasetDict`` folder gives ``data.split``
    for the training side and ``data.eval_split`` for ``data.eval_file``, at ``data.subset`` / ``data.revision``."""
    unknown = sorted(set(d.columns) - set(VISION_KEYS))
    if unknown:
        raise UserError(f"data.columns has {unknown}, which a vision-language row does not use; its keys are "
                        f"{', '.join(VISION_KEYS)} and its values the source's names for them.")
    path = Path(spec)
    if path.is_file() and path.suffix.lower() in (".json", ".jsonl"):
        return [(loc, renamed(row, d.columns, loc)) for loc, row in read_records(spec)], path.parent
    src = open_source(spec, source_settings(d, cache_dir, eval_side=key == "data.eval_file"), key)
    rows = undecoded(src.dataset)
    base = path.parent if path.is_file() else path if path.is_dir() else Path.cwd()
    return [(RowLoc(src.name, src.kind, i), row) for i, row in enumerate(rows)], base


def undecoded(ds):
    """``ds`` with its Image columns (and lists of images) cast to undecoded values: bytes and path, no Pillow
    image decoded by datasets before rocktune has checked it."""
    from datasets import Image

    features = ds.features.copy()
    changed = False
    for name, feature in features.items():
        if isinstance(feature, Image):
            features[name], changed = Image(decode=False), True
        elif isinstance(getattr(feature, "feature", None), Image):  # a list of images
            feature.feature, changed = Image(decode=False), True
    return ds.cast(features) if changed else ds


def renamed(row: dict, columns: dict[str, str], loc) -> dict:
    """A JSON row's keys per ``data.columns`` (record key -> the row's key), as datasets' sources are renamed."""
    if not columns:
        return row
    missing = [src for src in columns.values() if src not in row]
    if missing:
        raise UserError(f"{loc}: data.columns maps to {missing}, which this row does not have (its keys: "
                        f"{', '.join(sorted(row))}); fix data.columns or the row.")
    out = {k: v for k, v in row.items() if k not in columns}  # a record key the mapping replaces is dropped
    out.update({key: row[src] for key, src in columns.items()})
    return out
