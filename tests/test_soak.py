"""benchmarks/soak.py: its analysis on given samples (growth, drift, leaks are computed as documented and can fail),
and a few real steps through the supervised ``rocktune train`` to show the script runs end to end. The soak's own
figures are measured by running the script (docs/reliability.md), never by a timed test."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
_spec = importlib.util.spec_from_file_location("soak", ROOT / "benchmarks" / "soak.py")
soak = importlib.util.module_from_spec(_spec)
sys.modules["soak"] = soak  # dataclasses look their module up while the class is made
_spec.loader.exec_module(soak)

MIB = 2**20


def _samples(rss, fds=None, threads=None, procs=None):
    n = len(rss)
    fds, threads, procs = fds or [10] * n, threads or [12] * n, procs or [2] * n
    return [soak.Sample(float(i), i + 1, r, f, t, p) for i, (r, f, t, p) in enumerate(zip(rss, fds, threads, procs))]


def _steps(times, mem=None):
    """A metrics row per look (step i + 1), and one step more: the run's last, when it winds down (left out)."""
    times = [*times, times[-1]]
    mem = [*mem, mem[-1]] if mem else None
    return [{"step": i + 1, "step_s": t, "batch_tokens": 100 + (i % 3) * 8,
             **({"rss_bytes": mem[i]} if mem else {})} for i, t in enumerate(times)]


def test_flat_run_passes_every_bar():
    rss = [500 * MIB] * 10 + [600 * MIB + (i % 3) * MIB for i in range(90)]  # warm-up, then flat with jitter
    out = soak.analyse(_samples(rss), _steps([0.1] * 100, rss), warmup_steps=10)
    assert out["samples_measured"] == 90 and out["distinct_shapes"] == 3 and out["shape_changes"] == 100
    assert out["memory"]["tree_rss"]["growth"] == pytest.approx(0.0, abs=1e-9)
    assert out["flat"] == {"memory": True, "step_time": True, "fds": True, "threads": True}


def test_growth_drift_and_leaks_are_caught():
    rss = [600 * MIB * (1 + 0.001 * i) for i in range(100)]  # +0.1% a step: ~9% from first to last window
    fds = [10 + i // 20 for i in range(100)]  # one descriptor more every 20 steps
    threads = [12] * 50 + [13] * 50
    times = [0.1 + 0.001 * i for i in range(100)]
    out = soak.analyse(_samples(rss, fds, threads), _steps(times, rss), 0)
    first, last = statistics_median(rss[:10]), statistics_median(rss[-10:])
    assert out["memory"]["tree_rss"]["growth"] == pytest.approx(last / first - 1)
    logged = [*rss, rss[-1]]  # the metrics' own series runs to the last step
    assert out["memory"]["rss_bytes"]["growth"] == pytest.approx(
        statistics_median(logged[-10:]) / statistics_median(logged[:10]) - 1)
    assert out["step_s"]["drift"] == pytest.approx(statistics_median([*times, times[-1]][-10:]) / 0.1045 - 1)
    assert (out["fds"]["leaked"], out["threads"]["leaked"]) == (4, 1)
    assert out["flat"] == {"memory": False, "step_time": False, "fds": False, "threads": False}


def test_samples_during_a_restart_or_the_end_are_left_out():
    procs = [2] * 50 + [1] * 5 + [2] * 45  # the worker gone for five looks: the supervisor alone is far smaller
    rss = [600 * MIB if p == 2 else 50 * MIB for p in procs]
    fds = [10] * 95 + [4] * 5  # the run winding down at its last step closes files: no leak, and no "fewer" either
    samples = _samples(rss, fds, procs=procs)
    samples[-5:] = [soak.Sample(s.t, 101, s.rss, s.fds, s.threads, s.procs) for s in samples[-5:]]
    out = soak.analyse(samples, _steps([0.1] * 100), 0)
    assert out["samples_measured"] == 90 and out["memory"]["tree_rss"]["peak_growth"] == 0
    assert out["fds"] == {"first": 10, "last": 10, "leaked": 0}


def statistics_median(values):
    import statistics

    return statistics.median(values)


@pytest.mark.slow  # one supervised run of a few steps (~30 s on 2 busy cores)
def test_soak_smoke_runs_the_real_train_and_prints_json(tmp_path):
    out = tmp_path / "soak.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "soak.py"), "--steps", "20", "--every", "0.2",
                           "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = json.loads(out.read_text())
    assert got == json.loads(proc.stdout) and got["exit_status"] == 0 and got["steps"] == 20
    assert got["samples_measured"] > 0 and got["memory"]["tree_rss"]["first"] > 100 * MIB
    assert got["memory"]["rss_bytes"]["first"] > 100 * MIB  # the worker's own RSS, from metrics.jsonl
    assert got["fds"]["first"] > 0 and got["threads"]["first"] > 0 and got["distinct_shapes"] > 2


def test_the_gpu_check_runs_the_soak_in_its_second_command_only():
    text = (ROOT / "benchmarks" / "gpu_check.sh").read_text()
    first, second = (text.split(f"\n  {part})\n", 1)[1].split("\n    ;;", 1)[0] for part in ("1", "2"))
    assert "soak.py" in second and "soak.py" not in first


def test_too_few_steps_is_refused():
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "soak.py"), "--steps", "5"],
                          capture_output=True, text=True)
    assert proc.returncode == 2 and "--steps 5 is too short" in proc.stderr
