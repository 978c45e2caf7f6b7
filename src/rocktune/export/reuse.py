"""One merged model per run directory: an export that would write what an earlier one already wrote reuses it.

Merging a base in fp32 and writing its GGUF takes minutes and the disk space of the model. ``export --to gguf`` and
``--to ollama`` write the same GGUF (the Ollama bundle is that file and a Modelfile), so each GGUF carries a digest of
what it was made from (``KEY`` in its metadata): the adapter's files, the base's (its small files' bytes, its
weights' names, sizes and modification times), the run's config and chat template, the export's settings and
rocktune's version. An export whose digest an existing GGUF carries links that file instead of merging again (a hard
link: one copy on the disk; a copy where the disk cannot link); a changed adapter, base or setting changes the digest,
and the export merges again. The GGUF is never written in place, so a link to an old one keeps the old bytes.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

from rocktune import __version__
from rocktune.export.source import Source, load_config

KEY = "rocktune.source_digest"
RECORD = "rocktune_source.json"  # a merged model directory's digest, inside it (staged and renamed with it)
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".model")  # named by size and time, not read
SMALL = 8 * 2**20  # bigger files are named by size and time too: hashing a base's weights would take minutes


def digest(src: Source, settings: dict) -> str:
    """What a GGUF export of ``src`` with ``settings`` is made from, as one hex digest."""
    h = hashlib.sha256()

    def add(label: str, data: bytes) -> None:
        h.update(label.encode() + b"\0" + len(data).to_bytes(8, "little") + data)

    add("rocktune", __version__.encode())
    add("settings", json.dumps(settings, sort_keys=True).encode())
    add("run_config", json.dumps(src.run_config, sort_keys=True, default=str).encode())
    template = (src.run_config.get("data") or {}).get("chat_template")
    if isinstance(template, str) and Path(template).is_file():  # a .jinja file: its text, not its name
        add("chat_template", Path(template).read_bytes())
    if src.adapter is not None:
        for f in _files(src.adapter):
            add(f"adapter/{f.relative_to(src.adapter)}", f.read_bytes())
    base = Path(src.base).expanduser()
    if not base.is_dir():
        add("base", src.base.encode())  # a hub id: its name (the cache's snapshot is not pinned here)
        return h.hexdigest()
    for f in _files(base):
        st = f.stat()
        named = f.suffix in WEIGHT_SUFFIXES or st.st_size > SMALL
        add(f"base/{f.relative_to(base)}", f"{st.st_size}:{st.st_mtime_ns}".encode() if named else f.read_bytes())
    return h.hexdigest()


def _files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file() and not p.name.startswith("."))


def recorded(path: Path) -> str | None:
    """The digest a GGUF file carries, or None (no such file, another writer's, or unreadable)."""
    if not path.is_file():
        return None
    try:
        import gguf

        field = gguf.GGUFReader(str(path), "r").fields.get(KEY)
        return str(field.contents()) if field is not None else None
    except Exception:  # noqa: BLE001 -- a damaged or foreign file is simply not reused
        return None


def recorded_dir(path: Path) -> str | None:
    """The digest a merged model directory records, or None."""
    try:
        value = json.loads((path / RECORD).read_text(encoding="utf-8")).get("digest")
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, str) else None


def record_dir(path: Path, source: str) -> None:
    (path / RECORD).write_text(json.dumps({"digest": source}) + "\n", encoding="utf-8")


def merged_settings(dtype: str) -> dict:
    return {"merged": dtype}


def find(source: str, candidates: list[Path]) -> Path | None:
    """The first of ``candidates`` that carries ``source``."""
    return next((p for p in candidates if recorded(p) == source), None)


def link(found: Path, target: Path) -> str:
    """``target`` made the same file as ``found``; says how."""
    try:
        os.link(found, target)
        return "hard-linked: one copy on the disk"
    except OSError:  # another disk, or a file system without links
        shutil.copyfile(found, target)
        return "copied (this disk cannot hard-link it)"


def generation_config(src: Source):
    """The base's generation settings, as the merged model would carry them (the Modelfile's stops and sampling)."""
    from transformers import GenerationConfig

    try:
        return GenerationConfig.from_pretrained(src.base)
    except (OSError, ValueError):  # no generation_config.json: transformers derives it from the model's config
        return GenerationConfig.from_model_config(load_config(src.base, src.trust_remote_code))
