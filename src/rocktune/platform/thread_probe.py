"""Measure, do not assume: how fast torch's intra-op threads run here, now, under whatever else the machine runs.

A core count says how many threads could run, not how many will: on a busy machine a parallel region waits at its
barrier for a thread the OS has not scheduled, at every op of every step. On a loaded 2-core machine the demo's
training took 181.5 s with 2 threads and 17.6 s with one (issue 46). So on a CPU the run times a short mix of the
ops a training step is made of (a small matmul, an elementwise pass large enough for ATen to split it) at each
candidate thread count, interleaved so a change of load hits every count alike, and keeps the fastest; fewer
threads win a near tie (within ``TIE``), as they leave cores to the rest of the machine. It takes 0.1-1 s.

The load the machine already carries (``load_seen``: psutil's instantaneous busy share where psutil is installed,
else the 1-minute load average) picks a middle candidate and is reported; the timing decides.
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass

ROUNDS = 5  # interleaved timing rounds per candidate
TIE = 1.10  # more threads must be this much faster to be chosen
CLEAR = 2.0  # a count this much slower than the best is out


@dataclass(frozen=True)
class Load:
    busy: float  # CPUs' worth of work other processes were running
    source: str  # how it was seen, for the note

    def describe(self) -> str:
        return f"{self.source} {self.busy:.1f}"


def load_seen(sample_s: float = 0.1) -> Load | None:
    """What else runs: psutil's busy share over ``sample_s`` (times the CPUs), else the 1-minute load average;
    None where neither exists."""
    try:
        import psutil
    except ImportError:
        psutil = None
    if psutil is not None:
        share = psutil.cpu_percent(interval=sample_s) / 100
        return Load(share * (psutil.cpu_count() or 1), "CPUs busy")
    if hasattr(os, "getloadavg"):
        return Load(os.getloadavg()[0], "load average")
    return None


def candidates(usable: int, load: Load | None) -> list[int]:
    """1, what the load leaves free, and every usable CPU: the counts worth timing."""
    counts = {1, usable}
    if load is not None:
        counts.add(max(1, min(usable, int(usable - load.busy + 0.5))))
    return sorted(counts)


def time_threads(counts: list[int], rounds: int = ROUNDS) -> dict[int, float]:
    """Median seconds of one probe pass at each thread count; torch's own count is restored after. A count more
    than ``CLEAR`` times slower than the best after a round is timed no further: on a loaded machine its passes are
    the slow ones (0.1-0.8 s each on the 2-core machine here), and the answer is already clear."""
    import torch

    before = torch.get_num_threads()
    a, b = torch.randn(128, 256), torch.randn(256, 256)
    x = torch.randn(1 << 17)
    times: dict[int, list[float]] = {n: [] for n in counts}
    live = list(counts)
    try:
        for n in counts:  # warm each count's pool once, untimed
            torch.set_num_threads(n)
            _pass(a, b, x)
        for _ in range(rounds):
            for n in live:
                torch.set_num_threads(n)
                start = time.perf_counter()
                _pass(a, b, x)
                times[n].append(time.perf_counter() - start)
            best = min(statistics.median(times[n]) for n in live)
            live = [n for n in live if statistics.median(times[n]) <= best * CLEAR]
            if len(live) == 1:
                break
    finally:
        torch.set_num_threads(before)
    return {n: statistics.median(t) for n, t in times.items()}


def _pass(a, b, x) -> None:
    import torch

    for _ in range(4):  # many short parallel regions, as a small model's step has
        y = torch.nn.functional.gelu(a @ b)
        x = x * 0.5 + 1.0
        y.sum()


def fastest(times: dict[int, float]) -> int:
    """The fewest threads within ``TIE`` of the fastest time."""
    best = min(times.values())
    return min(n for n, t in times.items() if t <= best * TIE)


def describe(times: dict[int, float]) -> str:
    return ", ".join(f"{n} thread{'s' if n != 1 else ''} {t * 1e3:.1f} ms" for n, t in sorted(times.items()))
