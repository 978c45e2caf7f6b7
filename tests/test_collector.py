"""train/collector.py: the objects alive after a run's first step are frozen out of the collector's scans during the
steps, and the run leaves the process's collector as it found it, however it ends."""

from __future__ import annotations

import gc

import pytest

from rocktune.config import config_from_dict
from rocktune.train import collector
from tests.conftest import tiny_run_config


def test_frozen_during_the_steps_and_thawed_after(tiny_model_dir, task_files, tmp_path, monkeypatch):
    from rocktune.tasks import train
    from rocktune.train import loop

    seen = []
    real = loop.finish_step

    def spy(*args, **kwargs):
        seen.append(gc.get_freeze_count())
        return real(*args, **kwargs)

    monkeypatch.setattr(loop, "finish_step", spy)
    train_file, eval_file = task_files
    assert gc.get_freeze_count() == 0
    train(config_from_dict(tiny_run_config(tiny_model_dir, train_file, eval_file, tmp_path / "run", max_steps=3)),
          quiet=True)
    assert seen[0] == 0 and all(n > 10_000 for n in seen[1:]), seen  # the first step's objects and all before it
    assert gc.get_freeze_count() == 0


def test_a_run_that_fails_thaws_too_and_a_frozen_process_is_left_alone():
    c = collector.Collector()
    with pytest.raises(RuntimeError):
        try:
            c.settle()
            assert gc.get_freeze_count() > 0
            raise RuntimeError("a step failed")
        finally:
            c.close()
    assert gc.get_freeze_count() == 0
    gc.freeze()  # someone else's freeze: not ours to undo
    try:
        # the calls, not the frozen count: an object of the permanent generation that another thread frees (a
        # daemon thread of an earlier test ending) leaves it, so the count can fall while nobody thaws anything
        calls = []
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(gc, "freeze", lambda: calls.append("freeze"))
            mp.setattr(gc, "unfreeze", lambda: calls.append("unfreeze"))
            mine = collector.Collector()
            mine.settle()
            mine.close()
        assert calls == [] and gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
