"""The run directory: refuse to clobber another run, write small files atomically.

Layout: ``config.yaml`` (the resolved config), ``metrics.jsonl``, ``adapter/`` (PEFT format), ``checkpoints/``.
"""

from __future__ import annotations

import errno
import shutil
from pathlib import Path

import yaml

from rocktune.atomic import leftovers, write_atomic
from rocktune.errors import UserError
from rocktune.readers.yaml_file import read_yaml
from rocktune.train.runlock import LOCK_NAME

CONFIG_NAME = "config.yaml"
DAMAGED_CONFIG = "the run directory's config.yaml is damaged: restore it, or pass --overwrite to start again."
# Written by the supervisor on Ctrl-C when several ranks train (torchrun does not pass SIGINT on): rank 0 sees it,
# and every rank checkpoints and stops after the same step.
STOP_FILE = ".stop"
# torch and safetensors report a full disk only in their message text, wrapping the OSError away.
NO_SPACE_TEXT = ("no space left on device", "disk quota exceeded", "os error 28", "file write failed")


def check_output_dir(run_dir: Path, config: dict, overwrite: bool, resume: bool = False) -> None:
    """Raise unless writing a run with ``config`` into ``run_dir`` would lose nothing the user did not ask to lose."""
    # incidents.jsonl alone is what a supervised run leaves when it crashed before writing anything else; a
    # temporary copy of config.yaml, what a kill during that first write leaves; .lock, the run lock (runlock.py).
    if overwrite or not run_dir.exists() or \
            {p.name for p in run_dir.iterdir()} - {p.name for p in leftovers(run_dir / CONFIG_NAME)} \
            <= {"incidents.jsonl", LOCK_NAME}:
        return
    saved = run_dir / CONFIG_NAME
    if not saved.is_file():
        raise UserError(f"output.dir {run_dir} exists and is not a rocktune run directory; choose another "
                        "output.dir, or pass --overwrite to replace its contents.")
    if resume:
        return
    old = read_yaml(saved, DAMAGED_CONFIG)[0] or {}  # a shared run directory's file may be hostile
    changed = diff_keys(old, config)
    if changed:
        raise UserError(f"output.dir {run_dir} already holds a different run (differs in {', '.join(changed[:6])}); "
                        "choose another output.dir, or pass --overwrite to replace it.")
    if (run_dir / "adapter" / "adapter_config.json").is_file():  # finished: --resume would have nothing to do
        raise UserError(f"output.dir {run_dir} already holds this run, finished (its adapter is in "
                        f"{run_dir / 'adapter'}); use it as it is, pass --overwrite to train it again from scratch, "
                        "or raise training.max_steps and pass --resume-force to train it further.")
    raise UserError(f"output.dir {run_dir} already holds this run; pass --resume to continue it from its last "
                    "checkpoint, or --overwrite to start it again from scratch.")


def start(run_dir: Path, config: dict, wipe: bool) -> None:
    if wipe and run_dir.exists():
        for entry in run_dir.iterdir():
            if entry.name in ("incidents.jsonl", LOCK_NAME):
                continue  # the supervisor's record of crashes on the way here (timestamped, so old lines tell); the
                # lock this process holds (deleting it would let another process lock a new file)
            shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
    run_dir.mkdir(parents=True, exist_ok=True)
    write_config(run_dir, config)


def write_config(run_dir: Path, config: dict) -> None:
    for stale in leftovers(run_dir / CONFIG_NAME):
        stale.unlink(missing_ok=True)
    write_atomic(run_dir / CONFIG_NAME, yaml.safe_dump(config, sort_keys=False))


def diff_keys(old, new, prefix: str = "") -> list[str]:
    """The dotted leaf keys whose values differ; a section one side lacks is compared key by key with nothing."""
    if isinstance(old, dict) and new is None or old is None and isinstance(new, dict):
        old, new = old or {}, new or {}
    if isinstance(old, dict) and isinstance(new, dict):
        keys = sorted(set(old) | set(new))
        return [d for k in keys for d in diff_keys(old.get(k), new.get(k), f"{prefix}{k}.")]
    return [] if old == new else [prefix.rstrip(".")]


def out_of_space(exc: BaseException) -> bool:
    """Whether ``exc``, or an exception it came from, is a full disk (or an exhausted quota)."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if getattr(exc, "no_space", False):
            return True
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)):
            return True
        if any(t in str(exc).lower() for t in NO_SPACE_TEXT):
            return True
        exc = exc.__cause__ or exc.__context__  # type: ignore[assignment]  # None ends the loop
    return False
