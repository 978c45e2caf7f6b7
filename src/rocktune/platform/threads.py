"""How many intra-op threads torch should use: the cores this process may actually run on, not the machine's.

torch's default is the machine's core count. On a shared machine that oversubscribes: a process limited by its
affinity mask (``taskset``, a batch scheduler) or by a container's CPU quota (cgroup ``cpu.max``) still starts one
thread per core, and the threads wait on each other at every parallel region (20 steps of the tiny model: 18.2 s with
torch's default, 3.8 s with one thread, on a loaded 2-core machine). ``--nproc`` ranks on one machine share those
cores too. On a CPU run the count is then measured (``thread_probe``): a machine busy with other work runs fewer
threads faster (demo training 181.5 s with 2 threads, 17.6 s with one, on a loaded 2-core machine). The user's
``OMP_NUM_THREADS`` always wins.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

CGROUP = Path("/sys/fs/cgroup")
OURS = "ROCKTUNE_OMP_NUM_THREADS"  # set beside OMP_NUM_THREADS by the --nproc launcher: our choice, not the user's


@dataclass(frozen=True)
class ThreadChoice:
    threads: int | None  # None: the user's OMP_NUM_THREADS is in force; leave torch alone
    note: str  # one line for the run's notes and doctor


def affinity_cpus() -> int:
    """CPUs in this process's affinity mask (the machine's count where the OS has no masks)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def cgroup_cpus(root: Path = CGROUP) -> float | None:
    """The container's CPU quota in CPUs (cgroup v2 ``cpu.max``, else v1 ``cpu.cfs_quota_us``); None: no limit."""
    try:
        quota, period = (root / "cpu.max").read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        quota = int((root / "cpu" / "cpu.cfs_quota_us").read_text())
        period = int((root / "cpu" / "cpu.cfs_period_us").read_text())
        return quota / period if quota > 0 and period > 0 else None
    except (OSError, ValueError):
        return None


def choose_threads(environ: Mapping[str, str] | None = None, ranks: int | None = None, cpus: int | None = None,
                   cgroup: Path = CGROUP, probe: bool = False) -> ThreadChoice:
    """``ranks``: processes sharing this machine's cores (default: torchrun's ``LOCAL_WORLD_SIZE``, else 1).
    ``probe``: a CPU run; the count is then measured among those the cores allow (``thread_probe``)."""
    environ = os.environ if environ is None else environ
    user = environ.get("OMP_NUM_THREADS")
    if user and user != environ.get(OURS):
        return ThreadChoice(None, f"torch threads: your OMP_NUM_THREADS={user} (kept)")
    ranks = ranks or int(environ.get("LOCAL_WORLD_SIZE") or 1)
    cpus = cpus or affinity_cpus()
    why = [f"{cpus} CPU{'s' if cpus != 1 else ''} in this process's affinity mask"]
    quota = cgroup_cpus(cgroup)
    usable = cpus
    if quota is not None:
        why.append(f"a cgroup CPU quota of {quota:g}")
        usable = min(cpus, max(1, math.ceil(quota)))
    if ranks > 1:
        why.append(f"shared by {ranks} ranks")
    threads = max(1, usable // ranks)
    if probe and threads > 1:
        threads = _measured(threads, why)
    return ThreadChoice(threads, f"torch threads: {threads} ({', '.join(why)}; OMP_NUM_THREADS overrides)")


def _measured(most: int, why: list[str]) -> int:
    """The fastest count up to ``most`` by the probe; ``why`` gets the load seen and the times."""
    from rocktune.platform import thread_probe

    load = thread_probe.load_seen()
    times = thread_probe.time_threads(thread_probe.candidates(most, load))
    chosen = thread_probe.fastest(times)
    if load is not None:
        why.append(f"{load.describe()} when the run started")
    why.append(f"measured: {thread_probe.describe(times)}")
    return chosen


def oversubscribed(load_busy: float, cpus: int) -> bool:
    """Other processes already keep every usable CPU busy: one more thread per core only waits."""
    return load_busy >= cpus - 0.25


def apply_threads(choice: ThreadChoice) -> None:
    if choice.threads is not None:
        import torch

        torch.set_num_threads(choice.threads)


def rank_environment(ranks: int, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """``OMP_NUM_THREADS`` for ``ranks`` torchrun workers (which also keeps torchrun from printing its warning);
    empty when the user set it."""
    choice = choose_threads(environ, ranks=ranks)
    if choice.threads is None:
        return {}
    return {"OMP_NUM_THREADS": str(choice.threads), OURS: str(choice.threads)}
