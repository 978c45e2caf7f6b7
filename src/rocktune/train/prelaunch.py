"""Refusals the launching process decides before a worker, torchrun or a file exists: they depend on the config,
the number of processes and the run directory's checkpoint records alone. Torch-free on purpose: the supervisor
that runs them lives for the whole run and never imports torch. The workers decide the same again."""

from __future__ import annotations

import hashlib
from pathlib import Path

from rocktune.errors import UserError
from rocktune.readers.json_file import JsonProblem, parse_json

MANIFEST = "manifest.json"  # checkpoint.MANIFEST; that module imports torch, which this one must not


def refuse_layout(processes: int, parallel: str, quantization: str) -> None:
    """``training.parallel`` against ``model.quantization`` for ``processes`` ranks (distributed.strategy too)."""
    if processes > 1 and parallel == "fsdp" and quantization != "none":
        raise UserError("training.parallel=fsdp with model.quantization: FSDP does not shard bitsandbytes' packed "
                        "weights. A quantised base is small: use training.parallel=ddp.")


def saved_world(ckpt_root: Path) -> tuple[str, int] | None:
    """(checkpoint name, number of processes that wrote it) of the newest checkpoint whose meta.json matches the
    sha256 its manifest records. Only meta.json is hashed here, the one file this check relies on; restore verifies
    every file before it uses a checkpoint (a torn adapter makes it fall back to an older one, which a run records
    with the same number of processes unless --resume-force changed it)."""
    if not ckpt_root.is_dir():
        return None
    found = sorted((p for p in ckpt_root.glob("step-*") if p.is_dir() and p.name[5:].isdigit()),
                   key=lambda p: int(p.name[5:]), reverse=True)
    for path in found:
        meta = _verified_meta(path)
        if meta is None:
            continue  # partial, pruned half-way or tampered: restore will pass it over too
        extra = meta.get("extra")
        world = extra.get("world_size", 1) if isinstance(extra, dict) else 1
        return path.name, world
    return None


def _verified_meta(path: Path) -> dict | None:
    try:
        digest = parse_json((path / MANIFEST).read_bytes())["sha256"]["meta.json"]
        raw = (path / "meta.json").read_bytes()
        meta = parse_json(raw) if hashlib.sha256(raw).hexdigest() == digest else None
    except (OSError, JsonProblem, KeyError, TypeError):
        return None
    return meta if isinstance(meta, dict) else None
