"""One atomic write for every file rocktune replaces in place (configs, run_info.json, report pages, adapters'
small files): written beside under a temporary name, flushed to the disk, then renamed over the target, so a
reader — or a resume after a crash — sees the old file or the new one, never half of one.

Every multi-step write (this one, a checkpoint, the final adapter, an export) also passes named kill points
(``PHASES``): a test sets ``ROCKTUNE_FAULTS='{"kill_at": "PHASE[:N]"}'`` and the process SIGKILLs itself the N-th
time (default 1) it reaches that phase, so a kill lands exactly between two steps of a write instead of wherever a
random timer fires. The variable is read once; unset, a kill point is one comparison.
"""

from __future__ import annotations

import json
import os
import signal
import tempfile
from pathlib import Path

# Phase -> what is on disk when a kill lands there. The order is the order of the writes.
PHASES = {
    "atomic.written": "write_atomic: the temporary file written, not yet fsynced",
    "atomic.fsynced": "write_atomic: the temporary file fsynced, not yet renamed over the target",
    "checkpoint.adapter_written": "checkpoint: the adapter's files in .tmp-step-N, nothing else",
    "checkpoint.state_written": "checkpoint: adapter + optimizer/scheduler/scaler/RNG state, no meta.json",
    "checkpoint.before_manifest": "checkpoint: every file but manifest.json",
    "checkpoint.before_fsync": "checkpoint: every file and the manifest, not yet fsynced",
    "checkpoint.after_fsync": "checkpoint: .tmp-step-N complete and fsynced",
    "checkpoint.before_rename": "checkpoint: .tmp-step-N complete, a same-named step-N (a re-save) removed",
    "checkpoint.renamed": "checkpoint: step-N in place, `latest` still names the previous one",
    "checkpoint.pruning": "checkpoint: an old step-M being deleted (its manifest gone, its files still there)",
    "adapter.weights_written": "final adapter: adapter.tmp holds the weights, not yet its config copy and README",
    "adapter.staged": "final adapter: adapter.tmp complete and fsynced, not yet renamed to adapter/",
    "adapter.old_moved": "final adapter: a previous adapter/ moved to adapter.old, the new one not yet renamed",
    "adapter.swapped": "final adapter: adapter/ in place, a previous one (adapter.old) not yet removed",
    "lora_file.written": "Wan LoRA file: the temporary file written, not yet renamed over the target",
    "metrics.appending": "metrics.jsonl: a line about to be appended (the file holds the lines before it)",
    "metrics.appended": "metrics.jsonl: a line appended and flushed, nothing after it done (e.g. no checkpoint yet)",
    "metrics.truncating": "an attempt's start: metrics.jsonl not yet cut back (a resume: to its checkpoint's count)",
    "metrics.truncated": "an attempt's start: metrics.jsonl cut back (a resume: to its checkpoint's count)",
    "finish.evaluated": "final phase: the final eval done, its line not yet written",
    "finish.logged": "final phase: the final eval's line (and samples) written, no final file or adapter yet",
    "export.written": "export: .NAME.partial written, not yet fsynced",
    "export.fsynced": "export: .NAME.partial fsynced, not yet renamed",
    "export.old_moved": "export (a directory, --overwrite): the old output moved to .NAME.old, the new not renamed",
    "export.swapped": "export: the new output in place, .NAME.old not yet removed",
}
_UNREAD = object()
_armed: object = _UNREAD  # (phase, n) or None once the environment was read
_reached: dict[str, int] = {}


def kill_point(phase: str) -> None:
    """SIGKILL this process here when a test armed ``phase`` (see the module's docstring); otherwise nothing."""
    global _armed
    if _armed is _UNREAD:
        _armed = _read_kill_at()
    if _armed is None or _armed[0] != phase:
        return
    _reached[phase] = _reached.get(phase, 0) + 1
    if _reached[phase] == _armed[1]:
        os.kill(os.getpid(), getattr(signal, "SIGKILL", signal.SIGTERM))  # Windows: SIGTERM is TerminateProcess


def _read_kill_at() -> tuple[str, int] | None:
    faults = json.loads(os.environ.get("ROCKTUNE_FAULTS") or "{}")
    spec = faults.get("kill_at")
    if spec is None or str(faults.get("rank", os.environ.get("RANK", "0"))) != os.environ.get("RANK", "0"):
        return None  # unset, or several processes and the fault belongs to another rank (as train/faults.py)
    phase, _, n = str(spec).partition(":")
    if phase not in PHASES or (n and not n.isdigit()):
        raise ValueError(f"ROCKTUNE_FAULTS kill_at={spec!r}: expected PHASE[:N] with PHASE one of "
                         f"{', '.join(PHASES)}")
    return phase, int(n or 1)


def leftovers(path: Path) -> list[Path]:
    """Temporary files of writes to ``path`` that a kill cut short (never read: the target is renamed over)."""
    path = Path(path)
    return sorted(path.parent.glob(f".{path.name}.*")) if path.parent.is_dir() else []


def write_atomic(path: Path, data: str | bytes) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode("utf-8") if isinstance(data, str) else data)
            f.flush()
            kill_point("atomic.written")
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # mkstemp's 0600 would hide a report page from a web server or another user
        kill_point("atomic.fsynced")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
