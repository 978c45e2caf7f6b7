"""One process trains a run directory at a time (train/runlock.py), and no reader shows a step twice (issue 47).

Two processes on one run directory — a resume started while a killed supervisor's orphaned worker still trained, or
by hand while the supervisor restarted the run — each appended every line from the checkpoint on: the log ended with
a step range twice. The lock makes the second wait; the report, the summary, the resume's cut and TensorBoard drop or
hide what an earlier attempt (or an older version's log) holds twice.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rocktune.config import config_from_dict
from rocktune.errors import UserError
from rocktune.train import resume, sinks, summary
from rocktune.train.request import RunOptions, RunRequest
from rocktune.train.runlock import LOCK_NAME, RunLock
from tests import lm_runs
from tests.test_kill_phases import assert_same_log


def _worker(cfg: dict, resume: bool, stderr, faults: dict | None = None) -> subprocess.Popen:
    request = RunRequest(cfg, RunOptions(resume=resume, overwrite=not resume))
    env = dict(os.environ, ROCKTUNE_FAULTS=json.dumps(faults or {}))
    return subprocess.Popen([sys.executable, "-m", "rocktune.process.worker", request.to_json()], env=env,
                            stdout=subprocess.DEVNULL, stderr=stderr)


def _state(run: Path) -> tuple:
    return (run / "metrics.jsonl").read_text(), sorted(p.name for p in (run / "checkpoints").iterdir())


@pytest.mark.long
def test_a_resume_waits_while_another_process_trains_the_run(reference, tiny_model_dir, data, tmp_path):
    """The run killed after a line its newest checkpoint does not count; while another process holds the run (here:
    this one, as an orphaned worker would), a resume says it waits and touches nothing; once free, it resumes and
    the whole log equals the uninterrupted one. Without the lock it truncated and trained beside the holder."""
    run = tmp_path / "run"
    cfg = lm_runs.config(tiny_model_dir, data, run)
    assert lm_runs.run_worker(cfg, {"kill_at": "metrics.appended:5"}) == -signal.SIGKILL
    before = _state(run)
    holder = RunLock(run)
    holder.take()
    log = tmp_path / "resume.log"
    with open(log, "wb") as err:
        proc = _worker(cfg, True, err)
    try:
        deadline = time.monotonic() + 600
        while "waiting for it to finish" not in log.read_text(errors="replace"):
            assert proc.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, "the resume never said it waits"
            time.sleep(0.2)
        time.sleep(1.0)
        assert _state(run) == before, "the waiting resume touched the run directory"
        assert f"pid {os.getpid()}" in log.read_text()
    finally:
        holder.release()
    assert proc.wait(timeout=900) == 0, log.read_text()[-3000:]
    assert_same_log(run, reference)
    assert lm_runs.adapter_bytes(run) == lm_runs.adapter_bytes(reference)


def test_the_lock_is_exclusive_named_and_bounded(tmp_path):
    """A second holder (another open of the file: flock is per open file, so even this process) waits, names the
    holder's pid, and gives up after its bound with one paragraph; a released lock is taken at once."""
    first = RunLock(tmp_path)
    first.take()
    said: list[str] = []
    second = RunLock(tmp_path, wait_s=0.3, say=said.append)
    with pytest.raises(UserError, match=rf"still being trained by another process \(pid {os.getpid()}\)"):
        second.take()
    assert len(said) == 1 and "waiting" in said[0]
    first.release()
    said.clear()
    second.take()
    assert not said and (tmp_path / LOCK_NAME).read_text() == f"{os.getpid()}\n"
    second.release()


def test_a_killed_holder_leaves_no_stale_lock(tmp_path):
    code = ("import os, signal, sys\nfrom rocktune.train.runlock import RunLock\n"
            "RunLock(sys.argv[1]).take()\nos.kill(os.getpid(), signal.SIGKILL)\n")
    assert subprocess.run([sys.executable, "-c", code, str(tmp_path)]).returncode == -signal.SIGKILL
    said: list[str] = []
    with RunLock(tmp_path, wait_s=0, say=said.append):
        assert not said


def test_a_directory_holding_only_the_lock_is_a_new_run(tmp_path):
    from rocktune.train.rundir import check_output_dir

    (tmp_path / LOCK_NAME).write_text("123\n")
    check_output_dir(tmp_path, {"a": 1}, overwrite=False)  # not "exists and is not a rocktune run directory"


def _doubled_log(path: Path) -> list[dict]:
    """The issue's log: one process to the end, a second one from step 80 beside it (log_every 10, 120 steps)."""
    first = [{"step": 0, "eval_loss": 6.0}]
    first += [{"step": s, "loss": 100.0 / s, "step_s": 0.1} for s in range(10, 130, 10)]
    final = {"step": 120, "eval_loss": 1.5, "peak_rss_bytes": 1}
    rows = first + [final] + [r for r in first if r["step"] >= 80] + [final]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return rows


def test_report_and_summary_count_a_doubled_step_once_and_say_so(tmp_path):
    from rocktune.report.run_report import skipped_lines
    from rocktune.report.rundata import load_run

    _doubled_log(tmp_path / "metrics.jsonl")
    data = load_run(tmp_path)
    assert data.series("loss")[0] == list(range(10, 130, 10))
    assert [r["step"] for r in data.evals] == [0, 120]
    [note] = skipped_lines([data])
    for line, copy in ((9, 15), (10, 16), (11, 17), (12, 18), (13, 19), (14, 20)):
        assert f"{line} (step {(line - 1) * 10 if line < 14 else 120} logged again at line {copy}" in note, note
    fig = summary.read_figures(tmp_path / "metrics.jsonl")
    assert (fig.steps, fig.logged, fig.eval_after) == (120, 12, 1.5)
    assert fig.step_seconds == pytest.approx(1.2)


def test_resume_cut_drops_repeats_a_torn_line_and_a_killed_cut(tmp_path):
    path = tmp_path / "metrics.jsonl"
    rows = _doubled_log(path)
    (tmp_path / ".metrics.jsonl.x1y2").write_text("a cut killed before its rename")
    path.write_text(path.read_text() + '{"step": 1')  # a last line cut short
    notes = resume.truncate_metrics(path, len(rows) + 1)
    assert [json.loads(x) for x in path.read_text().splitlines()] == rows[:8] + rows[14:]
    assert notes == ["metrics.jsonl: dropped its last line, cut short",
                     "metrics.jsonl: dropped repeated lines of steps 80, 90, 100, 110, 120 (6 lines) (logged twice "
                     "by an earlier version; the later copy kept)"]
    assert not list(tmp_path.glob(".metrics.jsonl.*"))
    assert resume.truncate_metrics(path, 3) == [] and len(path.read_text().splitlines()) == 3
    [note] = resume.truncate_metrics(path, 5)  # a checkpoint counting lines the file lost (a power cut)
    assert "holds 3 lines, fewer than the 5 its checkpoint counts" in note and len(path.read_text().splitlines()) == 3


@pytest.mark.parametrize("kill_at", [
    "finish.logged:1",  # after the final eval and samples: the resume redoes only the final phase, at step 8
    pytest.param("metrics.appended:2", marks=pytest.mark.long),  # before the first checkpoint: it starts over
])
def test_tensorboard_shows_each_step_once_after_a_resume(kill_at, tiny_model_dir, data, tmp_path):
    pytest.importorskip("tensorboard", reason="the tensorboard extra is not installed")
    # what TensorBoard's server reads with (the legacy accumulator never purges text)
    from tensorboard.backend.event_processing.plugin_event_accumulator import EventAccumulator
    from tensorboard.util.tensor_util import make_ndarray

    from rocktune.tasks import train

    run = tmp_path / "run"
    cfg = lm_runs.config(tiny_model_dir, data, run, sample_count=1, sample_max_new_tokens=2)
    cfg["output"]["tensorboard"] = True
    assert lm_runs.run_worker(cfg, {"kill_at": kill_at}) == -signal.SIGKILL
    train(config_from_dict(cfg), RunOptions(resume=True), quiet=True)
    acc = EventAccumulator(str(run / "tensorboard"), size_guidance={"tensors": 0})
    acc.Reload()
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [e.step for e in acc.Tensors("train/loss")] == list(range(1, 9))
    assert [float(make_ndarray(e.tensor_proto)) for e in acc.Tensors("train/loss")] == pytest.approx(
        [r["loss"] for r in lines if "loss" in r])
    assert [e.step for e in acc.Tensors("eval/loss")] == [0, 8]
    assert [e.step for e in acc.Tensors("samples/text_summary")] == [0, 8]
    assert [json.loads(x)["step"] for x in (run / "samples.jsonl").read_text().splitlines()] == [0, 8]


def _event_steps(log_dir: Path, tag: str) -> list[int]:
    from tensorboard.backend.event_processing.plugin_event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"tensors": 0})
    acc.Reload()
    return [e.step for e in acc.Tensors(tag)]


def _earlier_attempt(log_dir: Path, name: str) -> None:
    """An attempt that logged steps 1-3, its event file renamed to ``name``."""
    from torch.utils.tensorboard import SummaryWriter

    w = SummaryWriter(str(log_dir), purge_step=0)
    for step in (1, 2, 3):
        w.add_scalar("train/loss", 9.0, step)
    w.close()
    [made] = log_dir.iterdir()
    made.rename(log_dir / name)


def test_a_restart_in_the_second_its_killed_attempt_started_still_hides_that_attempt(tmp_path):
    """CI's failure (stop 48): the killed worker and the resume made their event files in the same second; the
    resume's smaller pid sorted its file first, so the killed attempt's file purged the resume's steps instead."""
    pytest.importorskip("tensorboard", reason="the tensorboard extra is not installed")
    log_dir = tmp_path / "tensorboard"
    log_dir.mkdir()
    # the same second as now, a host name that sorts after any: the order the failure had
    _earlier_attempt(log_dir, f"events.out.tfevents.{int(time.time()):010d}.~~~~.99999999.0")
    tb = sinks._TensorBoard(log_dir, redo=0)
    for step in range(1, 9):
        tb.scalars({"train/loss": float(step)}, step)
    tb.close()
    assert _event_steps(log_dir, "train/loss") == list(range(1, 9))


def test_an_event_file_that_cannot_sort_last_is_said(tmp_path, monkeypatch, capsys):
    pytest.importorskip("tensorboard", reason="the tensorboard extra is not installed")
    log_dir = tmp_path / "tensorboard"
    log_dir.mkdir()
    _earlier_attempt(log_dir, f"events.out.tfevents.{int(time.time()) + 3600:010d}.host.1.0")  # an hour ahead
    monkeypatch.setattr(sinks.time, "sleep", lambda s: None)
    sinks._TensorBoard(log_dir, redo=0).close()
    assert "sorts before an earlier attempt's (the clock went back?)" in capsys.readouterr().err
    assert len(list(log_dir.iterdir())) == 2  # the retries left no files behind but the last


def test_wandb_and_mlflow_get_each_step_once_on_a_final_phase_resume(tmp_path, monkeypatch):
    """A resume from the last step's checkpoint (8 of 8) sends that step's kept training line again, once, even from
    an older version's log that holds it twice; the final eval follows. Earlier steps are not sent again."""
    import types

    from rocktune.train import sinks
    from tests.test_live_metrics import _Recorder

    mlflow, run = _Recorder(), _Recorder()
    monkeypatch.setitem(sys.modules, "mlflow", types.SimpleNamespace(**{n: getattr(mlflow, n) for n in (
        "set_experiment", "start_run", "log_metrics", "log_text", "end_run")}))
    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=lambda **k: run, Html=lambda s: s))
    rows = [{"step": 0, "eval_loss": 3.0}] + [{"step": s, "loss": 1.0 / s} for s in range(1, 9)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows + rows[-1:]))
    log = sinks.open_log(_Recorder(), tmp_path, sinks.redo_from(8, 8), tensorboard=False, wandb=True, mlflow=True)
    log.write({"step": 8, "eval_loss": 2.0})
    log.close()
    assert [(a[0], k["step"]) for name, a, k in mlflow.calls if name == "log_metrics"] == [
        ({"train_loss": 0.125}, 8), ({"eval_loss": 2.0}, 8)]
    assert [(a[0], k["step"]) for name, a, k in run.calls if name == "log"] == [
        ({"train/loss": 0.125}, 8), ({"eval/loss": 2.0}, 8)]
    assert sinks.redo_from(0, 8) == 0 and sinks.redo_from(4, 8) == 5
