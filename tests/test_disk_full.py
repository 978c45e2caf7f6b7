"""A full disk (issue 18): checkpoints skipped with one warning and a summary; at the final write, one paragraph,
exit 5, no restart, the last checkpoint intact, and ``--resume`` after freeing space writes the reference adapter."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys

import pytest
import yaml

from rocktune.config import config_from_dict
from rocktune.train import checkpoint, finish
from rocktune.tasks import train
from rocktune.train.request import RunOptions
from rocktune.exits import DISK_FULL
from tests.lm_runs import adapter_bytes, config, logged


def test_full_disk_at_final_write_stops_once_and_resume_finishes(tiny_model_dir, data, reference, tmp_path):
    cfg = config(tiny_model_dir, data, tmp_path / "run")
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    env = dict(os.environ, ROCKTUNE_FAULTS=json.dumps({"fail_final_write": True}))  # every attempt would fail
    proc = subprocess.run([sys.executable, "-m", "rocktune", "train", "-c", str(tmp_path / "c.yaml")], env=env,
                          capture_output=True, text=True)
    assert proc.returncode == DISK_FULL, proc.stderr
    assert "Traceback" not in proc.stderr and "restart" not in proc.stderr
    err = " ".join(proc.stderr.split())
    assert err.count("error:") == 1
    run = tmp_path / "run"
    for part in ("could not write the adapter", "No space left on device", "MiB", "checkpoint (step 8) is intact",
                 f"rocktune train -c {run / 'config.yaml'} --resume"):
        assert part in err, part
    incidents = [json.loads(x) for x in (run / "incidents.jsonl").read_text().splitlines()]
    assert len(incidents) == 1 and incidents[0]["restart"] is None and "disk full" in incidents[0]["cause"]
    assert checkpoint.verify(run / "checkpoints" / "step-0000008") is None
    assert not (run / "adapter").exists() and not (run / "adapter.tmp").exists()
    # Space freed: the resume writes what the uninterrupted run wrote.
    train(config_from_dict(cfg), RunOptions(resume=True), quiet=True)
    assert logged(run) == logged(reference)
    assert adapter_bytes(run) == adapter_bytes(reference)


def test_low_space_warning_said_once_then_summarised(tiny_model_dir, data, reference, tmp_path, capsys):
    cfg = config(tiny_model_dir, data, tmp_path / "run")
    cfg["reliability"]["min_free_disk_mb"] = 1 << 40  # more than any disk has: every checkpoint is refused up front
    result = train(config_from_dict(cfg), quiet=True)
    err = " ".join(capsys.readouterr().err.split())
    assert err.count("MiB free") == 2  # the warning, and the summary quoting it
    assert "4 checkpoints were skipped for lack of disk space" in err
    assert result.eval_loss_after is not None  # the adapter fits: it is still written
    assert adapter_bytes(tmp_path / "run") == adapter_bytes(reference)
    assert not list((tmp_path / "run" / "checkpoints").glob("*step-*"))


@pytest.mark.parametrize("exc", [OSError(errno.ENOSPC, "No space left on device"),
                                 RuntimeError("PytorchStreamWriter failed writing file data/0: file write failed")])
def test_guarded_write_turns_a_full_disk_into_one_paragraph(tmp_path, exc):
    with pytest.raises(finish.DiskFullError, match="could not write the thing.*rocktune train -c .* --resume"):
        with finish.guarded(tmp_path, "the thing", 1):
            raise exc


def test_guarded_write_checks_free_space_first_and_passes_other_errors(tmp_path):
    wrote = []
    with pytest.raises(finish.DiskFullError, match="needs about"):
        with finish.guarded(tmp_path, "the thing", 1 << 60):
            wrote.append(1)
    assert not wrote
    with pytest.raises(PermissionError), finish.guarded(tmp_path, "the thing", 1):
        raise PermissionError(errno.EACCES, "Permission denied")
