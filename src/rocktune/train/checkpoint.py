"""Atomic, verified checkpoints: everything needed to continue a run bit for bit.

A checkpoint is ``checkpoints/step-NNNNNNN/`` holding the adapter (PEFT format), the optimizer, scheduler and
GradScaler states, the RNG states, the data position and a ``manifest.json`` with the sha256 of every file. It is
written under a temporary name, fsynced and renamed; ``checkpoints/latest`` then names it (also written atomically).
Loading verifies the manifest and falls back to the previous checkpoint when the newest one is damaged. Tensors
load through safetensors or ``torch.load(weights_only=True)``: never arbitrary pickle.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError

from rocktune.errors import UserError
from rocktune.train.rundir import write_atomic

MANIFEST = "manifest.json"
STATE = "trainer_state.pt"
LATEST = "latest"


class CheckpointWriteError(RuntimeError):
    """A checkpoint could not be written; the previous one is untouched."""


@dataclass
class Restored:
    step: int
    path: Path
    position: dict
    extra: dict
    skipped: list[str]  # damaged newer checkpoints that were passed over, with the reason


def save(ckpt_root: Path, step: int, model, optimizer, scheduler, scaler, position: dict, extra: dict,
         keep: int, min_free_bytes: int = 0, before_commit=None) -> Path:
    """Write the checkpoint for ``step``; ``before_commit`` (tests) runs after the files, before the rename."""
    ckpt_root.mkdir(parents=True, exist_ok=True)
    _check_free_space(ckpt_root, min_free_bytes)
    final = ckpt_root / f"step-{step:07d}"
    tmp = ckpt_root / f".tmp-step-{step:07d}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        torch.save({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                    "scaler": scaler.state_dict(), "rng": _rng_tensors()}, tmp / STATE)
        meta = {"step": step, "position": position, "extra": extra, "py_random": _py_random_state(),
                "np_random": _np_random_state()}
        (tmp / "meta.json").write_text(json.dumps(meta))
        files = sorted(p.name for p in tmp.iterdir())
        (tmp / MANIFEST).write_text(json.dumps({"step": step, "sha256": {f: _sha256(tmp / f) for f in files}}))
        _fsync_tree(tmp)
        if before_commit is not None:
            before_commit()
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync_dir(ckpt_root)
        write_atomic(ckpt_root / LATEST, final.name + "\n")
    except (OSError, RuntimeError, SafetensorError) as exc:  # a full disk surfaces as any of these
        shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointWriteError(f"could not write checkpoint {final.name}: {exc}") from exc
    _prune(ckpt_root, keep)
    return final


def restore(ckpt_root: Path, model, optimizer, scheduler, scaler) -> Restored | None:
    """Load the newest checkpoint that verifies; None when there is none."""
    skipped: list[tuple[Path, str]] = []
    for path in _candidates(ckpt_root):
        problem = verify(path)
        if problem:
            skipped.append((path, problem))
            continue
        _load_into(path, model, optimizer, scheduler, scaler)
        notes = [f"{p.name}: {why} (kept as {_set_aside(p)})" for p, why in skipped]
        meta = json.loads((path / "meta.json").read_text())
        random.setstate(_tuple_state(meta["py_random"]))
        np.random.set_state(_np_state(meta["np_random"]))
        return Restored(meta["step"], path, meta["position"], meta["extra"], notes)
    if skipped:  # nothing is renamed here: a second --resume must meet the same refusal, not an empty directory
        raise UserError(f"--resume: no checkpoint in {ckpt_root} verifies "
                        f"({'; '.join(f'{p.name}: {why}' for p, why in skipped)}); nothing trustworthy to continue "
                        "from. Start the run again with --overwrite.")
    return None


def _set_aside(path: Path) -> str:
    """Rename a damaged checkpoint out of the way: kept as evidence, never again taken for (or pruned instead of)
    a good one."""
    n = 0
    while (target := path.with_name(f"damaged-{path.name}" + (f".{n}" if n else ""))).exists():
        n += 1
    path.rename(target)
    return target.name


def verify(path: Path) -> str | None:
    """Why ``path`` is not a usable checkpoint, or None when every file matches its recorded hash."""
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except (OSError, ValueError):
        return "manifest missing or unreadable (partial write?)"
    for name, digest in manifest["sha256"].items():
        if not (path / name).is_file():
            return f"{name} is missing"
        if _sha256(path / name) != digest:
            return f"{name} does not match its sha256 (corrupted)"
    return None


def _load_into(path: Path, model, optimizer, scheduler, scaler) -> None:
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    device = next(p.device for p in model.parameters())
    set_peft_model_state_dict(model, load_file(path / "adapter_model.safetensors", device=str(device)))
    state = torch.load(path / STATE, weights_only=True, map_location="cpu")
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    scaler.load_state_dict(state["scaler"])
    torch.set_rng_state(state["rng"]["cpu"])
    if "cuda" in state["rng"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["rng"]["cuda"])


def _candidates(ckpt_root: Path) -> list[Path]:
    """Newest first, with the one ``latest`` names at the front."""
    if not ckpt_root.is_dir():
        return []
    found = sorted((p for p in ckpt_root.glob("step-*") if p.is_dir()), reverse=True)
    latest = ckpt_root / LATEST
    if latest.is_file():
        named = ckpt_root / latest.read_text().strip()
        if named in found:
            found.remove(named)
            found.insert(0, named)
    return found


def _prune(ckpt_root: Path, keep: int) -> None:
    for old in sorted(ckpt_root.glob("step-*"))[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def _check_free_space(root: Path, needed: int) -> None:
    free = shutil.disk_usage(root).free
    if free < needed:
        raise CheckpointWriteError(f"only {free / 2**20:.0f} MiB free on {root}, a checkpoint needs about "
                                   f"{needed / 2**20:.0f} MiB (adapter, optimizer state and reliability.min_free_disk_mb); free disk space")


def _rng_tensors() -> dict:
    out = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = torch.cuda.get_rng_state_all()
    return out


def _py_random_state() -> list:
    version, internal, gauss = random.getstate()
    return [version, list(internal), gauss]


def _tuple_state(state: list) -> tuple:
    return state[0], tuple(state[1]), state[2]


def _np_random_state() -> list:
    name, keys, pos, has_gauss, cached = np.random.get_state()
    return [name, keys.tolist(), int(pos), int(has_gauss), float(cached)]


def _np_state(state: list) -> tuple:
    return state[0], np.array(state[1], dtype=np.uint32), state[2], state[3], state[4]


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _fsync_tree(root: Path) -> None:
    for p in root.rglob("*"):
        if p.is_file():
            # Opened for writing: on Windows fsync (FlushFileBuffers) needs write access.
            fd = os.open(p, os.O_RDWR | getattr(os, "O_BINARY", 0))
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    _fsync_dir(root)


def _fsync_dir(path: Path) -> None:
    if os.name == "nt":  # directories cannot be opened for fsync on Windows; rename is durable enough there
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
