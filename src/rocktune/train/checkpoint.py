"""Atomic, verified checkpoints: everything needed to continue a run bit for bit.

A checkpoint is ``checkpoints/step-NNNNNNN/`` holding the adapter (PEFT format), the optimizer, scheduler and
GradScaler states, the RNG states, the data position and a ``manifest.json`` with the sha256 of every file. It is
written under a temporary name, fsynced and renamed; ``checkpoints/latest`` then names it (also written atomically,
for people and tools; loading goes by step number, so a kill before the pointer moves loses nothing). Loading
verifies the manifest, then reads and checks every part (``checkpoint_state``); a checkpoint that fails
either way is damaged: reported, set aside, and the previous one used. Tensors load through safetensors or
``torch.load(weights_only=True)``: never arbitrary pickle.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError

from rocktune.errors import UserError
from rocktune.train import checkpoint_state
from rocktune.train.checkpoint_state import STATE
from rocktune.atomic import kill_point, leftovers, write_atomic
from rocktune.train.rundir import out_of_space
from rocktune.readers.json_file import parse_json

MANIFEST = "manifest.json"
LATEST = "latest"


class CheckpointWriteError(RuntimeError):
    """A checkpoint could not be written; the previous one is untouched. ``repeat``: the same lack of space was
    already reported in this run (the loop then stays quiet; ``SpaceSkips.summary`` counts them)."""

    def __init__(self, message: str, repeat: bool = False, no_space: bool = False):
        super().__init__(message)
        self.repeat, self.no_space = repeat, no_space


class SpaceSkips:
    """Checkpoints skipped for lack of disk space: the first is reported in full, the rest counted."""

    def __init__(self):
        self.count = 0
        self.first = ""

    def add(self, message: str) -> bool:
        """Count one skip; True when it repeats an earlier one."""
        self.count += 1
        self.first = self.first or message
        return self.count > 1

    def summary(self) -> str | None:
        if self.count < 2:
            return None
        return f"{self.count} checkpoints were skipped for lack of disk space (the first: {self.first})"


@dataclass
class Restored:
    step: int
    path: Path
    position: dict
    extra: dict
    skipped: list[str]  # damaged newer checkpoints that were passed over, with the reason


@dataclass
class TrainState:
    """The run's objects a checkpoint saves and restores."""

    model: Any  # the PEFT model: its adapter weights
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: torch.amp.GradScaler  # torch.amp.GradScaler (fp16's loss scale; disabled otherwise)


def save(ckpt_root: Path, step: int, state: TrainState, position: dict, extra: dict, keep: int,
         min_free_bytes: int = 0, before_commit=None, skips: SpaceSkips | None = None) -> Path:
    """Write the checkpoint for ``step``; ``before_commit`` (tests) runs after the files, before the rename."""
    try:
        return _save(ckpt_root, step, state, position, extra, keep, min_free_bytes, before_commit)
    except CheckpointWriteError as exc:
        if skips is not None and out_of_space(exc):
            exc.repeat = skips.add(str(exc))
        raise


def _save(ckpt_root: Path, step: int, state: TrainState, position: dict, extra: dict, keep: int,
          min_free_bytes: int, before_commit) -> Path:
    ckpt_root.mkdir(parents=True, exist_ok=True)
    _check_free_space(ckpt_root, min_free_bytes)
    final = ckpt_root / f"step-{step:07d}"
    tmp = ckpt_root / f".tmp-step-{step:07d}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        state.model.save_pretrained(tmp, safe_serialization=True)
        kill_point("checkpoint.adapter_written")
        torch.save({"optimizer": state.optimizer.state_dict(), "scheduler": state.scheduler.state_dict(),
                    "scaler": state.scaler.state_dict(), "rng": _rng_tensors()}, tmp / STATE)
        kill_point("checkpoint.state_written")
        meta = {"step": step, "position": position, "extra": extra, "py_random": _py_random_state(),
                "np_random": _np_random_state()}
        (tmp / "meta.json").write_text(json.dumps(meta))
        kill_point("checkpoint.before_manifest")
        files = sorted(p.name for p in tmp.iterdir())
        (tmp / MANIFEST).write_text(json.dumps({"step": step, "sha256": {f: _sha256(tmp / f) for f in files}}))
        kill_point("checkpoint.before_fsync")
        fsync_tree(tmp)
        kill_point("checkpoint.after_fsync")
        if before_commit is not None:
            before_commit()
        if final.exists():
            shutil.rmtree(final)
        kill_point("checkpoint.before_rename")
        os.replace(tmp, final)
        _fsync_dir(ckpt_root)
        kill_point("checkpoint.renamed")
        for stale in leftovers(ckpt_root / LATEST):  # a temporary `latest` of a write that was killed
            stale.unlink(missing_ok=True)
        write_atomic(ckpt_root / LATEST, final.name + "\n")
    except (OSError, RuntimeError, SafetensorError) as exc:  # a full disk surfaces as any of these
        shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointWriteError(f"could not write checkpoint {final.name}: {exc}") from exc
    _prune(ckpt_root, keep)
    return final


def restore(ckpt_root: Path, state: TrainState, check=None) -> Restored | None:
    """Load the newest checkpoint that verifies; None when there is none. ``check(found)`` (the resume's checks: the
    number of processes, the RNG states, the data) runs on the checkpoint read but not yet applied: a refusal leaves
    the model, the optimizer and the checkpoints as they were."""
    skipped: list[tuple[Path, str]] = []
    for path in _candidates(ckpt_root):
        problem = verify(path)
        if problem is None:
            try:  # read and checked whole before anything is applied: a refused one leaves the model as it was
                saved = checkpoint_state.read(path, state.model, state.optimizer)
            except checkpoint_state.Damaged as exc:
                problem = str(exc)
        if problem:
            skipped.append((path, problem))
            continue
        found = Restored(saved.meta["step"], path, saved.meta["position"], saved.meta["extra"], [])
        if check is not None:
            check(found)
        checkpoint_state.apply(saved, state.model, state.optimizer, state.scheduler, state.scaler)
        found.skipped = [f"{p.name}: {why} (kept as {_set_aside(p)})" for p, why in skipped]
        return found
    if skipped:  # nothing is renamed here: a second --resume must meet the same refusal, not an empty directory
        raise UserError(f"--resume: no checkpoint in {ckpt_root} can be used "
                        f"({'; '.join(f'{p.name}: {why}' for p, why in skipped)}), so there is nothing trustworthy "
                        "to continue from. They are left as they are for inspection and nothing was written. Start "
                        "the run again with --overwrite (this deletes them), or restore them from a backup.")
    return None


def last_good(ckpt_root: Path) -> int | None:
    """The step of the newest checkpoint whose files match their manifest (what a --resume would start from)."""
    for path in _candidates(ckpt_root):
        if verify(path) is None:
            try:
                return int(parse_json((path / "meta.json").read_bytes())["step"])
            except (OSError, ValueError, KeyError):
                continue
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
        manifest = parse_json((path / MANIFEST).read_bytes())
        hashes = dict(manifest["sha256"])
    except (OSError, ValueError, KeyError, TypeError):
        return "manifest missing or unreadable (partial write?)"
    for name, digest in hashes.items():
        if not (path / name).is_file():
            return f"{name} is missing"
        if _sha256(path / name) != digest:
            return f"{name} does not match its sha256 (corrupted)"
    return None


def _candidates(ckpt_root: Path) -> list[Path]:
    """Newest step first. ``latest`` is not consulted: a kill between a checkpoint's rename and the pointer's update
    leaves it naming the previous one, although the newer one is complete (and verification decides that)."""
    if not ckpt_root.is_dir():
        return []
    found = [p for p in ckpt_root.glob("step-*") if p.is_dir() and p.name[5:].isdigit()]
    return sorted(found, key=lambda p: int(p.name[5:]), reverse=True)


def _prune(ckpt_root: Path, keep: int) -> None:
    for old in sorted(ckpt_root.glob("step-*"))[:-keep]:
        # The manifest goes first: a deletion cut short leaves a directory that can never verify, so it is never
        # taken for a checkpoint (the next prune finishes it).
        (old / MANIFEST).unlink(missing_ok=True)
        kill_point("checkpoint.pruning")
        shutil.rmtree(old, ignore_errors=True)


def _check_free_space(root: Path, needed: int) -> None:
    free = shutil.disk_usage(root).free
    if free < needed:
        raise CheckpointWriteError(f"only {free / 2**20:.0f} MiB free on {root}, a checkpoint needs about "
                                   f"{needed / 2**20:.0f} MiB (adapter, optimizer state and "
                                   "reliability.min_free_disk_mb); free disk space", no_space=True)


def _rng_tensors() -> dict:
    out: dict[str, Any] = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = torch.cuda.get_rng_state_all()
    return out


def _py_random_state() -> list:
    version, internal, gauss = random.getstate()
    return [version, list(internal), gauss]


def _np_random_state() -> list:
    state: Any = np.random.get_state()  # the legacy tuple (legacy=True, the default)
    name, keys, pos, has_gauss, cached = state
    return [name, keys.tolist(), int(pos), int(has_gauss), float(cached)]


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def fsync_tree(root: Path) -> None:
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


def save_or_warn(save, step: int, log) -> bool:
    """A failed checkpoint write leaves the previous checkpoint intact; the run goes on and says so."""
    try:
        save(step)
        return True
    except CheckpointWriteError as exc:
        if not exc.repeat:  # a disk that stays full is said once, then counted (checkpoint.SpaceSkips)
            log(f"[red]warning: {exc}; the previous checkpoint is intact and training continues[/]")
        return False
