"""Threads by measurement (issue 46, item 5): a CPU run times its candidate thread counts under the load it sees and
keeps the fastest, saying why; doctor flags a machine whose CPUs other work already fills."""

from __future__ import annotations

import pytest
import torch
from rich.console import Console

from rocktune.doctor import main as doctor_main
from rocktune.doctor.render import load_warning, render
from rocktune.platform import thread_probe
from rocktune.platform.thread_probe import Load, candidates, fastest
from rocktune.platform.threads import choose_threads, oversubscribed


def test_the_fastest_count_wins_and_fewer_threads_win_a_near_tie():
    assert fastest({1: 0.0176, 2: 0.1815}) == 1  # the loaded 2-core machine of the issue
    assert fastest({1: 0.010, 2: 0.0055}) == 2  # a quiet one
    assert fastest({1: 0.010, 2: 0.0095, 4: 0.0094}) == 1  # within 10%: the cores stay free for the rest


def test_candidates_include_what_the_load_leaves():
    assert candidates(2, None) == [1, 2]
    assert candidates(8, Load(5.0, "load average")) == [1, 3, 8]
    assert candidates(8, Load(20.0, "load average")) == [1, 8]


def test_a_cpu_run_measures_and_says_why(monkeypatch):
    monkeypatch.setattr(thread_probe, "load_seen", lambda sample_s=0.1: Load(2.0, "CPUs busy"))
    monkeypatch.setattr(thread_probe, "time_threads", lambda counts: {1: 0.0176, 2: 0.1815})
    choice = choose_threads({}, cpus=2, probe=True)
    assert choice.threads == 1
    assert "CPUs busy 2.0 when the run started" in choice.note
    assert "measured: 1 thread 17.6 ms, 2 threads 181.5 ms" in choice.note
    # no probe where the cores allow one thread, where the user set it, or off the CPU
    assert choose_threads({}, cpus=1, probe=True).note.startswith("torch threads: 1 (1 CPU in")
    assert choose_threads({"OMP_NUM_THREADS": "2"}, cpus=2, probe=True).threads is None
    assert "measured" not in choose_threads({}, cpus=2).note


def test_the_probe_times_every_candidate_and_restores_torch():
    before = torch.get_num_threads()
    times = thread_probe.time_threads([1, 2], rounds=2)
    assert set(times) == {1, 2} and all(t > 0 for t in times.values())
    assert torch.get_num_threads() == before


def test_oversubscription_is_flagged_by_doctor(monkeypatch):
    assert oversubscribed(2.0, 2) and oversubscribed(1.8, 2) and not oversubscribed(0.9, 2)
    monkeypatch.setattr(thread_probe, "load_seen", lambda sample_s=0.1: Load(9.3, "load average"))
    monkeypatch.setattr("rocktune.platform.threads.affinity_cpus", lambda: 2)
    load = doctor_main.machine_load()
    assert load == {"busy": 9.3, "source": "load average", "cpus": 2, "oversubscribed": True}
    assert "other processes keep 9.3 of the 2 usable CPUs busy" in load_warning(load)
    assert load_warning({**load, "busy": 0.2, "oversubscribed": False}) is None


@pytest.mark.parametrize("busy,flagged", [(2.0, True), (0.1, False)])
def test_doctor_verdict_names_the_load(busy, flagged):
    report = {"platform": {"os": "Linux", "python": "3.11", "backend": "cpu", "devices": [], "torch": "2.13",
                           "libraries": {}, "env": {}},
              "advice": {"arch": "cpu", "env": [], "findings": [], "defaults": {}, "reasons": {}},
              "checks": [{"name": "x", "status": "pass", "detail": "", "seconds": 0.1}], "device": "cpu",
              "load": {"busy": busy, "source": "CPUs busy", "cpus": 2, "oversubscribed": flagged}}
    console = Console(record=True, width=300)
    render(report, console)
    out = console.export_text()
    assert ("all checks passed: 1 passed, 0 failed, 0 skipped (the machine is oversubscribed: see the warning above)"
            in out) == flagged
    assert ("warning oversubscribed: other processes keep 2.0 of the 2 usable CPUs busy" in out) == flagged
