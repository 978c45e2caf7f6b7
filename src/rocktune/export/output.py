"""Outputs appear whole or not at all: written under a temporary name beside the target, renamed at the end.

An existing output is refused unless ``overwrite``; a full disk (or any write error) removes the temporary and
becomes one clear ``UserError``. Working files (the tokenizer a GGUF is built from) are staged beside the target too,
never in the system's temporary folder: a killed export leaves only dot-named leftovers next to its own output, which
the next export to that target clears.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
from pathlib import Path

from rocktune.atomic import kill_point
from rocktune.errors import UserError

MARKERS = ("config.json", "Modelfile")  # what a merged model or an Ollama bundle directory always holds
# numpy's tofile (gguf-py writes every tensor with it) reports a full disk as a short write, without an errno
SHORT_WRITE = re.compile(r"\d+ requested and \d+ written")
NO_SPACE_ERRNOS = (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC))


def check_target(path: Path, overwrite: bool, is_dir: bool | None = None) -> None:
    """The one destination check, before anything is loaded: the output can be created, or replaced."""
    _put_back(path)
    if not path.exists():
        _check_creatable(path)
        return
    if not overwrite:
        raise UserError(f"{path} already exists; pass --overwrite to replace it, or --out to write elsewhere.")
    if is_dir is False and path.is_dir():
        raise UserError(f"{path} is a directory; --out names the .gguf file to write.")
    # --overwrite replaces an earlier export, never an unrelated directory someone pointed --out at
    if is_dir and (not path.is_dir() or (any(path.iterdir()) and not any((path / m).is_file() for m in MARKERS))):
        raise UserError(f"{path} exists and is not an earlier export (no {' or '.join(MARKERS)}); --overwrite only "
                        "replaces those. Choose another --out.")


def _check_creatable(path: Path) -> None:
    """Its nearest existing ancestor must be a folder this process may write into: otherwise the export would fail
    at the very end, after minutes of merging."""
    parent = path.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise UserError(f"{path} cannot be created: {parent} is a file, not a folder; choose another --out (or move "
                        "that file away).")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UserError(f"{path} cannot be created: the folder {parent} is not writable by this user; choose "
                        "another --out, or change that folder's permissions.")


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
        kill_point("export.written")
        _fsync(tmp)
        kill_point("export.fsynced")
        _swap(tmp, path)
    except BaseException as exc:
        full = _no_space(exc)
        free = _free(path.parent) if full else None  # measured before the partial output frees its share
        _remove(tmp)
        if full:
            raise UserError(_full_disk(path, free)) from None
        if isinstance(exc, OSError):
            why = exc.strerror or exc
            raise UserError(f"could not write {path}: {why} (the partial output was removed).") from None
        raise


@contextlib.contextmanager
def scratch(path: Path):
    """Yield an empty working directory ``.NAME.scratch`` beside ``path``, removed on the way out (and, left by a
    killed export, on the next export to ``path``)."""
    work = path.with_name(f".{path.name}.scratch")
    _remove(work)
    work.mkdir(parents=True)
    try:
        yield work
    finally:
        _remove(work)


def _put_back(path: Path) -> None:
    """An export killed between ``_swap``'s two renames left the previous output as ``.NAME.old`` and none at
    ``path``: it is put back, so the next export meets the old output (refused without --overwrite), never a gap."""
    old = path.with_name(f".{path.name}.old")
    if old.is_dir() and not path.exists() and not path.is_symlink():
        os.replace(old, path)


def _swap(tmp: Path, path: Path) -> None:
    if not path.is_dir():
        os.replace(tmp, path)
        kill_point("export.swapped")
        return
    # A directory cannot be replaced by rename; move the old one aside first so a crash keeps one of the two.
    old = path.with_name(f".{path.name}.old")
    _remove(old)
    os.replace(path, old)
    kill_point("export.old_moved")
    os.replace(tmp, path)
    kill_point("export.swapped")
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


def _no_space(exc: BaseException) -> bool:
    """A full disk or quota, however it is reported: an errno, the OS message inside safetensors' or torch's own
    error types, or numpy's short write."""
    text = str(exc)
    return getattr(exc, "errno", None) in NO_SPACE_ERRNOS or "No space left" in text or bool(SHORT_WRITE.search(text))


def _free(directory: Path) -> int | None:
    try:
        return shutil.disk_usage(directory).free
    except OSError:
        return None


def _full_disk(path: Path, free: int | None) -> str:
    left = f" ({free / 2**20:.1f} MiB free when the write failed)" if free is not None else ""
    return (f"the disk holding {path.parent} is full{left}; nothing was written (the partial output was removed). "
            "Free space or pass --out on another disk; a smaller --quant (e.g. q8_0) also needs less.")


def size_of(path: Path) -> int:
    if path.is_dir():
        return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
    return path.stat().st_size
