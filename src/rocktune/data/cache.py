"""Tokenise once: examples stored as flat int32 tensors in a safetensors file, keyed by a fingerprint.

The fingerprint covers the data bytes, the tokenizer (vocabulary, specials, chat template), the record shape,
max length and masking, so any change that would alter the tokens gives a new cache entry.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

FORMAT_VERSION = 1


def tokenizer_fingerprint(tokenizer) -> str:
    h = hashlib.sha256()
    backend = getattr(tokenizer, "backend_tokenizer", None)
    h.update(backend.to_str().encode() if backend is not None else repr(sorted(tokenizer.get_vocab().items())).encode())
    h.update(str(getattr(tokenizer, "chat_template", None)).encode())
    h.update(repr((tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id)).encode())
    return h.hexdigest()


def fingerprint(data_path: str | Path, tokenizer_fp: str, **settings) -> str:
    h = hashlib.sha256()
    with open(data_path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    h.update(tokenizer_fp.encode())
    h.update(json.dumps({"v": FORMAT_VERSION, **settings}, sort_keys=True).encode())
    return h.hexdigest()[:24]


def load(cache_dir: Path, key: str) -> tuple[list[list[int]], list[list[int]], dict] | None:
    entry = cache_dir / key
    if not (entry / "meta.json").is_file():
        return None
    tensors = load_file(entry / "examples.safetensors")
    meta = json.loads((entry / "meta.json").read_text())
    offsets = tensors["offsets"].tolist()
    ids, labels = tensors["input_ids"].tolist(), tensors["labels"].tolist()
    spans = list(zip(offsets[:-1], offsets[1:]))
    return [ids[a:b] for a, b in spans], [labels[a:b] for a, b in spans], meta


def store(cache_dir: Path, key: str, ids: list[list[int]], labels: list[list[int]], meta: dict) -> None:
    """Write under a temporary name and rename, so a crash never leaves a half-written entry behind."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    offsets = [0]
    for seq in ids:
        offsets.append(offsets[-1] + len(seq))
    tmp = Path(tempfile.mkdtemp(dir=cache_dir, prefix=f".{key}."))
    try:
        save_file(
            {
                "input_ids": torch.tensor([t for s in ids for t in s], dtype=torch.int32),
                "labels": torch.tensor([t for s in labels for t in s], dtype=torch.int32),
                "offsets": torch.tensor(offsets, dtype=torch.int64),
            },
            tmp / "examples.safetensors",
        )
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
        os.replace(tmp, cache_dir / key)
    except (OSError, RuntimeError, SafetensorError):  # a full disk surfaces as any of these
        shutil.rmtree(tmp, ignore_errors=True)
        if not (cache_dir / key / "meta.json").is_file():  # another process may have won the rename race
            raise
