"""Outputs appear whole or not at all: written under a temporary name beside the target, renamed at the end.

An existing output is refused unless ``overwrite``; a full disk (or any write error) removes the temporary and
becomes one clear ``UserError``.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
from pathlib import Path

from rocktune.errors import UserError

MARKERS = ("config.json", "Modelfile")  # what a merged model or an Ollama bundle directory always holds


def check_target(path: Path, overwrite: bool, is_dir: bool | None = None) -> None:
    if not path.exists():
        return
    if not overwrite:
        raise UserError(f"{path} already exists; pass --overwrite to replace it, or --out to write elsewhere.")
    if is_dir is False and path.is_dir():
        raise UserError(f"{path} is a directory; --out names the .gguf file to write.")
    # --overwrite replaces an earlier export, never an unrelated directory someone pointed --out at
    if is_dir and (not path.is_dir() or (any(path.iterdir()) and not any((path / m).is_file() for m in MARKERS))):
        raise UserError(f"{path} exists and is not an earlier export (no {' or '.join(MARKERS)}); --overwrite only "
                        "replaces those. Choose another --out.")


@contextlib.contextmanager
def staged(path: Path, overwrite: bool, is_dir: bool):
    """Yield a temporary path beside ``path``; on success it replaces ``path``, on any failure it is removed."""
    check_target(path, overwrite, is_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.partial")
    _remove(tmp)
    if is_dir:
        tmp.mkdir()
    try:
        yield tmp
        _fsync(tmp)
        _swap(tmp, path)
    except BaseException as exc:
        _remove(tmp)
        # safetensors and torch report a full disk as their own error types, with the OS message inside
        if isinstance(exc, OSError) or "No space left" in str(exc):
            raise UserError(_describe(exc, path)) from None
        raise


def _swap(tmp: Path, path: Path) -> None:
    if not path.is_dir():
        os.replace(tmp, path)
        return
    # A directory cannot be replaced by rename; move the old one aside first so a crash keeps one of the two.
    old = path.with_name(f".{path.name}.old")
    _remove(old)
    os.replace(path, old)
    os.replace(tmp, path)
    _remove(old)


def _fsync(path: Path) -> None:
    files = [p for p in path.rglob("*") if p.is_file()] if path.is_dir() else [path]
    for f in files:
        with open(f, "r+b") as fh:  # opened for writing: on Windows fsync (FlushFileBuffers) needs write access
            os.fsync(fh.fileno())


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    elif path.exists() or path.is_symlink():
        path.unlink()


def _describe(exc: BaseException, path: Path) -> str:
    if getattr(exc, "errno", None) == errno.ENOSPC or "No space left" in str(exc):
        return (f"the disk holding {path.parent} is full; nothing was written (the partial output was removed). "
                "Free space or pass --out on another disk; a smaller --quant (e.g. q8_0) also needs less.")
    return f"could not write {path}: {getattr(exc, 'strerror', None) or exc} (the partial output was removed)."


def size_of(path: Path) -> int:
    if path.is_dir():
        return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
    return path.stat().st_size
