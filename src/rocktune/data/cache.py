"""Tokenise once: examples stored as flat int32 arrays (numpy ``.npy``, memory-mapped on load), keyed by a
fingerprint.

The fingerprint covers the data (the file's bytes, or the dataset's own fingerprint for a folder or hub id), the
tokenizer (vocabulary, specials, chat template), the record shape, column mapping, max length and masking, so any
change that would alter the tokens gives a new cache entry. An entry is written under a temporary name and renamed
into place only once every check passed (``Entry.commit``); ranks and later runs map its files read-only.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np

from rocktune.errors import UserError

FORMAT_VERSION = 2
ARRAYS = ("input_ids", "labels", "offsets")


def tokenizer_fingerprint(tokenizer) -> str:
    h = hashlib.sha256()
    backend = getattr(tokenizer, "backend_tokenizer", None)
    h.update(backend.to_str().encode() if backend is not None else repr(sorted(tokenizer.get_vocab().items())).encode())
    h.update(str(getattr(tokenizer, "chat_template", None)).encode())
    h.update(repr((tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id)).encode())
    # the tokens a reply ends on come from the model's stops too (generation_config.json: GLM-4.5's <|user|>), not
    # only from the template: an edited stop list must not reuse tokens labelled for the old one
    h.update(repr(_reply_end(tokenizer)).encode())
    return h.hexdigest()


def _reply_end(tokenizer):
    from rocktune.data.turnend import reply_end

    try:
        return reply_end(tokenizer)
    except UserError:  # a template the probe cannot render: chat data says so when it is encoded, others never ask
        return None


def fingerprint(data: str | Path, tokenizer_fp: str, **settings) -> str:
    """``data``: a file (its bytes are hashed) or any other identity string (a dataset's fingerprint)."""
    h = hashlib.sha256()
    if Path(data).is_file():
        with open(data, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
    else:
        h.update(str(data).encode())
    h.update(tokenizer_fp.encode())
    h.update(json.dumps({"v": FORMAT_VERSION, **settings}, sort_keys=True).encode())
    return h.hexdigest()[:24]


def load(cache_dir: Path, key: str) -> tuple[dict[str, np.ndarray], dict] | None:
    """The entry's arrays, memory-mapped read-only, and its meta; None when there is no complete entry."""
    entry = cache_dir / key
    if not (entry / "meta.json").is_file():
        return None
    arrays = {name: np.load(entry / f"{name}.npy", mmap_mode="r") for name in ARRAYS}
    return arrays, json.loads((entry / "meta.json").read_text())


def size_bytes(cache_dir: Path, key: str) -> int:
    entry = cache_dir / key
    return sum(f.stat().st_size for f in entry.iterdir()) if entry.is_dir() else 0


class Entry:
    """A cache entry being written: a temporary folder under ``cache_dir`` that ``commit`` renames into place."""

    def __init__(self, cache_dir: Path, key: str):
        self.cache_dir, self.key = cache_dir, key
        cache_dir.mkdir(parents=True, exist_ok=True)
        self.tmp = Path(tempfile.mkdtemp(dir=cache_dir, prefix=f".{key}."))

    def write(self, name: str, n: int, dtype, chunks) -> None:
        """A ``.npy`` file of ``n`` items written from ``chunks`` in order, with ordinary writes: pages written
        through a memory map would count in this process's RSS, pages written to a file do not."""
        header = {"descr": np.lib.format.dtype_to_descr(np.dtype(dtype)), "fortran_order": False, "shape": (n,)}
        written = 0
        with open(self.tmp / f"{name}.npy", "wb") as f:
            np.lib.format.write_array_header_1_0(f, header)
            for chunk in chunks:
                f.write(np.ascontiguousarray(chunk, dtype=dtype).tobytes())
                written += len(chunk)
        if written != n:
            raise AssertionError(f"{name}: {written} items written, {n} announced")

    def mapped(self) -> dict[str, np.ndarray]:
        return {name: np.load(self.tmp / f"{name}.npy", mmap_mode="r") for name in ARRAYS}

    def commit(self, meta: dict) -> None:
        """Rename into place; a crash never leaves a half-written entry. Maps of the files stay valid (same inode)."""
        try:
            (self.tmp / "meta.json").write_text(json.dumps(meta, indent=1))
            os.replace(self.tmp, self.cache_dir / self.key)
        except OSError:  # a full disk, or another process won the rename race
            self.discard()
            if not (self.cache_dir / self.key / "meta.json").is_file():
                raise

    def discard(self) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)


def store(cache_dir: Path, key: str, ids: list[list[int]], labels: list[list[int]], meta: dict) -> None:
    """Write lists at once (small sets, tests)."""
    from rocktune.data.tokens import from_lists

    flat_ids, offsets = from_lists(ids)
    flat_labels, _ = from_lists(labels)
    entry = Entry(cache_dir, key)
    for name, arr in (("input_ids", flat_ids), ("labels", flat_labels), ("offsets", offsets)):
        entry.write(name, len(arr), arr.dtype, [arr])
    entry.commit(meta)
