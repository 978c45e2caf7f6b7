"""Progress you can trust on any device (issue 55, point 3): a heartbeat line while one phase lasts, the time left
once steps were timed, the memory figure with what lowers it. Fake clocks and short intervals; one tiny run."""

from __future__ import annotations

import time

import pytest

from rocktune.train.estimate import Estimate, MemoryFacts, duration, memory_note
from rocktune.train.heartbeat import Heartbeat, phase


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_heartbeat_speaks_once_per_interval_of_one_phase():
    clock, lines = Clock(), []
    beat = Heartbeat(lines.append, enabled=False, clock=clock, every_s=30)
    beat.phase("step 1/24")
    clock.now += 29
    beat.beat()
    assert lines == []
    clock.now += 1
    beat.beat()
    beat.beat()  # said just now: nothing more until another interval
    assert lines == ["[dim]… step 1/24: 30 s so far[/]"]
    clock.now += 150
    beat.beat()
    assert lines[-1] == "[dim]… step 1/24: 3 min 00 s so far[/]"


def test_heartbeat_waits_after_a_line_and_a_new_phase():
    clock, lines = Clock(), []
    beat = Heartbeat(lines.append, enabled=False, clock=clock, every_s=30)
    beat.phase("the eval before step 1")
    clock.now += 40
    beat.said()  # e.g. a plain progress line went out
    clock.now += 20
    beat.beat()
    assert lines == []
    beat.phase("step 2/24")  # a new phase: its own 30 s first
    clock.now += 29
    beat.beat()
    assert lines == []
    clock.now += 1
    beat.beat()
    assert lines == ["[dim]… step 2/24: 30 s so far[/]"]


def test_heartbeat_carries_the_estimate_and_the_task_names_its_phase():
    clock, lines = Clock(), []
    est = Estimate(total=24, eval_every=0, done=0)
    est.stepped(1, 120.0, compiling=False)
    with Heartbeat(lines.append, enabled=False, clock=clock, every_s=30) as beat:
        beat.estimate = est
        phase("tokenising the data")  # what a task calls, without holding the heartbeat
        clock.now += 30
        beat.beat()
        beat.phase("step 2/24", counted=True)  # a step the estimate counts: its time so far comes off
        clock.now += 30
        beat.beat()
    phase("after the run")  # no heartbeat active: nothing happens
    # 23 steps at 120 s, no eval timed yet
    assert lines == ["[dim]… tokenising the data: 30 s so far; about 46 min 00 s left[/]",
                     "[dim]… step 2/24: 30 s so far; about 45 min 30 s left[/]"]


def test_heartbeat_thread_prints_during_a_long_phase():
    lines: list[str] = []
    with Heartbeat(lines.append, every_s=0.05) as beat:
        beat.phase("loading the model")
        time.sleep(0.4)
    n = len(lines)
    time.sleep(0.1)
    assert len(lines) == n  # the thread ended with the block
    assert 2 <= n <= 8 and all("loading the model" in x for x in lines)


def test_estimate_counts_steps_and_evals_left():
    est = Estimate(total=10, eval_every=4, done=0)
    assert est.left_s() is None and est.left_text() == ""
    est.evaluated(20.0)  # the eval before step 1
    est.stepped(1, 300.0, compiling=True)  # compiling: no pace
    assert est.left_s() is None
    est.stepped(2, 10.0, compiling=False)
    est.stepped(3, 14.0, compiling=False)
    # 7 steps at 12 s, and the evals at step 4 and 8 and the final one at 20 s
    assert est.evals_left() == 3
    assert est.left_s() == pytest.approx(7 * 12 + 3 * 20)
    assert est.first_line() == "estimate: 12 s a step; about 2 min 24 s left for 7 steps and 3 evals"
    assert est.left_text(running=30) == "; about 1 min 54 s left" and est.left_text(running=999) == "; about 0 s left"
    est.stepped(10, 12.0, compiling=False)
    assert est.evals_left() == 0 and est.left_s() == 0


def test_duration():
    assert [duration(s) for s in (4.4, 59.6, 61, 3599, 3600, 7260)] == \
        ["4 s", "1 min 00 s", "1 min 01 s", "59 min 59 s", "1 h 00 min", "2 h 01 min"]


FACTS = MemoryFacts(peak=int(8.9 * 2**30), machine=16 * 2**30, gpu=False, model="/m/SmolLM2-135M-Instruct",
                    checkpointing=False, micro_batch=4, max_length=1200, precision="fp32")


def test_memory_note_high_names_what_lowers_it():
    note = memory_note(FACTS)
    assert note.startswith("memory: peak RSS 8.90 GiB, 56% of this machine's 16.0 GiB; to lower it: "
                           "model.gradient_checkpointing=true")
    assert "training.micro_batch_size (now 4" in note and "data.max_length (now 1200)" in note
    assert note.endswith("`rocktune plan /m/SmolLM2-135M-Instruct --max-length 1200 --batch 4 --precision fp32 "
                         "--vram 16GiB` breaks the peak down and lists settings that fit; `rocktune train --auto` "
                         "applies the planner's choice")


def test_memory_note_low_or_unknown_is_the_figure_alone():
    from dataclasses import replace

    assert memory_note(replace(FACTS, peak=2**30)) == "memory: peak RSS 1.00 GiB, 6% of this machine's 16.0 GiB"
    assert memory_note(replace(FACTS, machine=None)) == "memory: peak RSS 8.90 GiB"
    gpu = memory_note(replace(FACTS, gpu=True, checkpointing=True, micro_batch=1, peak=60 * 2**30,
                              machine=80 * 2**30))
    assert gpu.startswith("memory: device peak 60.00 GiB, 75% of this device's 80.0 GiB; to lower it: a shorter "
                          "data.max_length")
    assert "gradient_checkpointing" not in gpu and "--vram" not in gpu


def test_a_run_with_slow_steps_keeps_talking(tiny_model_dir, data, tmp_path, monkeypatch, capsys):
    """Steps of 0.6 s with a heartbeat of 0.15 s: every step is heard from while it runs; the estimate and the
    memory figure come after the first step."""
    from rocktune.config import config_from_dict
    from rocktune.tasks import train
    from rocktune.train.faults import Faults
    from rocktune.train.request import RunOptions
    from tests.conftest import tiny_run_config

    monkeypatch.setattr(Heartbeat, "EVERY_S", 0.15)
    cfg = tiny_run_config(tiny_model_dir, data[0], data[1], tmp_path / "run", max_steps=3, compile=False)
    train(config_from_dict(cfg), RunOptions(overwrite=True), faults=Faults({"slow_steps": 0.6}))
    err = capsys.readouterr().err
    for step in (1, 2, 3):
        assert f"… step {step}/3: " in err
    assert "estimate: " in err and "left for 2 steps and 1 eval" in err
    assert "memory: peak RSS " in err
    assert "s left[/]" not in err  # markup is rendered, never printed raw


def test_a_quiet_rank_never_speaks():
    """Ranks other than 0 (and --json runs) get a heartbeat without its thread: phases are set, nothing is said."""
    lines: list[str] = []
    with Heartbeat(lines.append, enabled=False, every_s=0.01) as beat:
        beat.phase("step 1/2")
        time.sleep(0.1)
    assert lines == [] and beat._thread is None
