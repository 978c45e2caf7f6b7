"""The writes at the end of a run, guarded like checkpoints: free space checked first, temporary name + rename,
and a full disk reported as one paragraph (``DiskFullError``, ``exits.DISK_FULL``) that the supervisor never
retries — a restart would re-train to the last step and meet the same full disk.
"""

from __future__ import annotations

import contextlib
import shutil
from pathlib import Path

from safetensors import SafetensorError

from rocktune.atomic import kill_point
from rocktune.train import checkpoint
from rocktune.train.rundir import CONFIG_NAME, out_of_space
from rocktune.errors import first_line

SLACK_BYTES = 1 << 20  # adapter_config.json, the copied config, filesystem blocks


class DiskFullError(RuntimeError):
    """A write failed for lack of disk space; the message is the paragraph for the user, ``cause`` one line."""

    no_space = True

    def __init__(self, message: str, cause: str):
        super().__init__(message)
        self.cause = cause


def adapter_bytes(params) -> int:
    """What the adapter takes on disk: its fp32 weights plus a little for the small files beside them."""
    return sum(p.numel() * 4 for p in params) + SLACK_BYTES


@contextlib.contextmanager
def guarded(run_dir: Path, what: str, need_bytes: int, fault=None):
    """Run the body, which writes ``what`` into ``run_dir``; a full disk, seen before or during it, becomes a
    ``DiskFullError``. ``fault`` (tests) is called first and may raise as a full disk would."""
    try:
        free = shutil.disk_usage(run_dir).free
        if free < need_bytes:
            raise DiskFullError(explain(run_dir, what, need_bytes, free), f"{what}: only {_mib(free)} free")
        if fault is not None:
            fault()
        yield
    except DiskFullError:
        raise
    except (OSError, RuntimeError, SafetensorError) as exc:
        if not out_of_space(exc):
            raise
        free = shutil.disk_usage(run_dir).free
        raise DiskFullError(explain(run_dir, what, need_bytes, free, exc), f"{what}: {first_line(exc)}") from None


def explain(run_dir: Path, what: str, need_bytes: int | None, free: int, exc: BaseException | None = None) -> str:
    """One paragraph: what failed, the space it needs, what is safe, and the command that finishes the run."""
    step = checkpoint.last_good(run_dir / "checkpoints")
    safe = (f"The last checkpoint (step {step}) is intact and verifies." if step is not None else
            "No checkpoint could be kept, so the run will start over.")
    need = f"; it needs about {_mib(need_bytes)}" if need_bytes else ""
    why = f" ({first_line(exc)})" if exc is not None else ""
    return (f"could not write {what}: no space left on the disk holding {run_dir}{why}{need}, and {_mib(free)} "
            f"is free. {safe} Free some space (or move the run to a bigger disk) and finish the run with: "
            f"rocktune train -c {run_dir / CONFIG_NAME} --resume")


def save_adapter(model, out: Path, config_file: Path) -> None:
    """PEFT format (adapter_config.json + adapter_model.safetensors), written beside, then swapped in; a failed
    write leaves no half-written directory."""
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        kill_point("adapter.weights_written")
        (tmp / "rocktune_config.yaml").write_text(config_file.read_text())
        from rocktune.train.model_card import describe_adapter

        describe_adapter(tmp, config_file.parent)  # a real README.md and an absolute local base path
        checkpoint.fsync_tree(tmp)  # as a checkpoint: the rename below must not land before the data
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old = out.with_name(out.name + ".old")
    shutil.rmtree(old, ignore_errors=True)  # left by a crash between the two renames below
    kill_point("adapter.staged")
    if out.exists():
        out.rename(old)
        kill_point("adapter.old_moved")
    tmp.rename(out)
    kill_point("adapter.swapped")
    shutil.rmtree(old, ignore_errors=True)


def _mib(n: int) -> str:
    return f"{n / 2**20:.0f} MiB" if n >= 2**20 else f"{n / 2**10:.0f} KiB"

