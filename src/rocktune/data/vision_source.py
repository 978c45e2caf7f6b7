"""The rows of a vision-language source: JSON/JSONL by rocktune's own reader (file:line in errors; a row's content
may be text here and parts there), parquet, Arrow, ``save_to_disk`` folders and hub ids through ``datasets`` as the
LM's sources are opened (data/sources.py). Image columns (``datasets.Image``, alone or in a list, as TRL's vision
sets store them) are read undecoded: ``{"bytes", "path"}`` values that data/images.py opens and checks itself."""

from __future__ import annotations

from pathlib import Path

from rocktune.data.dataset import source_settings
from rocktune.data.records import read_records
from rocktune.data.sources import RowLoc, open_source


def read_rows(spec: str, d, cache_dir: Path, key: str) -> tuple[list[tuple[object, dict]], Path]:
    """(``(where, row)`` of every row, the folder that relative image paths start from)."""
    path = Path(spec)
    if path.is_file() and path.suffix.lower() in (".json", ".jsonl"):
        return read_records(spec), path.parent
    src = open_source(spec, source_settings(d, cache_dir), key)
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
