"""Was a child that died of SIGKILL ended by the kernel's out-of-memory killer? The signal itself does not say, so
the supervisor looks where the kernel counts: the cgroup's ``oom_kill`` counter (cgroup v2 ``memory.events``, v1
``memory.oom_control``), and failing that the child's peak RSS against the memory limit. The machine-wide counter
(``/proc/vmstat``) is not used: in a container it counts other tenants' kills, and a kill -9 taken for an OOM would
be restarted smaller, which is not the exact resume it should be. A snapshot is taken before each attempt and
compared after it; Linux only (elsewhere: never a verdict).
"""

from __future__ import annotations

import resource
import signal
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC = Path("/proc")
AT_LIMIT = 0.9  # a peak RSS this close to the limit, then SIGKILL: the OOM killer, most likely


def cgroup_dir(root: Path = CGROUP_ROOT, proc: Path = PROC) -> Path | None:
    """This process's memory cgroup directory: v2 (``0::/path``) or v1 (``N:memory:/path``)."""
    try:
        lines = (proc / "self" / "cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        v2 = controllers == "" and (root / path.lstrip("/") / "memory.events").is_file()
        if v2:
            return root / path.lstrip("/")
        if "memory" in controllers.split(","):
            return root / "memory" / path.lstrip("/")
    return None


def _counter(file: Path, key: str) -> int | None:
    try:
        for line in file.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    except (OSError, ValueError):
        pass
    return None


def oom_kills(cgroup: Path | None) -> int | None:
    """The cgroup's count of processes the OOM killer ended (the child's cgroup: it is started in ours)."""
    if cgroup is None:
        return None
    found = _counter(cgroup / "memory.events", "oom_kill")
    return found if found is not None else _counter(cgroup / "memory.oom_control", "oom_kill")


def memory_limit(cgroup: Path | None, proc: Path = PROC) -> int | None:
    """The cgroup's memory limit in bytes, else the machine's memory."""
    for name in ("memory.max", "memory.limit_in_bytes"):
        try:
            text = (cgroup / name).read_text().strip() if cgroup is not None else ""
        except OSError:
            continue
        if text.isdigit() and int(text) < 2**60:  # v1 writes "unlimited" as a huge number, v2 as "max"
            return int(text)
    try:
        for line in (proc / "meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024  # the kernel writes kB
    except (OSError, ValueError, IndexError):
        pass
    return None


def children_peak_rss() -> int:
    """The largest peak RSS of any child process waited for (Linux reports kilobytes)."""
    return resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024


class OomWatch:
    """Take one before an attempt; ``verdict(exit code)`` after it."""

    def __init__(self, root: Path = CGROUP_ROOT, proc: Path = PROC):
        self.cgroup = cgroup_dir(root, proc)
        self.proc = proc
        self.before = oom_kills(self.cgroup)

    def verdict(self, code: int, peak_rss: int | None = None) -> str | None:
        """A one-line cause when the child was SIGKILLed for memory, else None."""
        if code != -signal.SIGKILL:
            return None
        after = oom_kills(self.cgroup)
        limit = memory_limit(self.cgroup, self.proc)
        if self.before is not None and after is not None and after > self.before:
            said = f", memory limit {limit / 2**30:.2f} GiB" if limit else ""
            return (f"killed by the kernel's out-of-memory killer (cgroup {self.cgroup.name} oom_kill "
                    f"{self.before} -> {after}{said})")
        peak = children_peak_rss() if peak_rss is None else peak_rss
        if limit and peak >= AT_LIMIT * limit:
            return (f"killed (SIGKILL) with its memory at the limit (peak RSS {peak / 2**30:.2f} GiB of "
                    f"{limit / 2**30:.2f} GiB): the kernel's out-of-memory killer, most likely")
        return None
