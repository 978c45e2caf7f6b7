"""Issue 28, the second hour: what a new user still trips on after the demo works (each test fails without its fix)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.conftest import tiny_run_config

SRC = Path(__file__).parent.parent / "src"


@pytest.mark.skipif(sys.platform == "win32", reason="a POSIX venv layout")
def test_next_commands_work_as_printed_without_an_activated_venv(tmp_path, monkeypatch):
    from rocktune.train import summary

    bin_dir = tmp_path / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "python").touch()
    monkeypatch.setattr(sys, "executable", str(bin_dir / "python"))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(summary, "_installed", lambda m: True)
    monkeypatch.setenv("PATH", "/nonexistent")
    # Not installed (a source tree on PYTHONPATH): only the module form works.
    assert summary.rocktune_command() == f"{bin_dir / 'python'} -m rocktune"
    script = bin_dir / "rocktune"
    script.write_text("#!/bin/sh\n")
    script.chmod(0o755)
    # Installed, venv not activated: the script's path, relative to where the user stands.
    assert summary.rocktune_command() == ".venv/bin/rocktune"
    first = summary.next_commands(tmp_path / "run")[1]
    assert first.startswith(f"  .venv/bin/rocktune generate {tmp_path / 'run'} --chat")
    # Activated: the bare name.
    monkeypatch.setenv("PATH", str(bin_dir) + os.pathsep + "/usr/bin")
    assert summary.rocktune_command() == "rocktune"
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    monkeypatch.setenv("PATH", "/nonexistent")
    assert summary.rocktune_command() == str(script)


def _train_into_closed_pipe(cfg_file, *extra) -> int:
    """``rocktune train ... 2>&1 | head -1``: the reader takes one line and closes the pipe."""
    env = dict(os.environ, PYTHONPATH=str(SRC) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen([sys.executable, "-m", "rocktune", "train", "-c", str(cfg_file), *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
    proc.stdout.readline()
    proc.stdout.close()
    return proc.wait(timeout=600)


def test_a_closed_pipe_is_not_a_crash(tiny_model_dir, data, tmp_path):
    run = tmp_path / "run"
    cfg = tiny_run_config(tiny_model_dir, data[0], data[1], run, max_steps=3, micro_batch_size=4, grad_accum=1)
    cfg_file = tmp_path / "run.yaml"
    cfg_file.write_text(yaml.safe_dump(cfg))
    assert _train_into_closed_pipe(cfg_file) == 0
    assert (run / "adapter" / "adapter_model.safetensors").is_file()  # training went on to the end
    assert not (run / "incidents.jsonl").exists()
    assert _train_into_closed_pipe(cfg_file, "--resume") == 0  # a finished run's summary into a closed pipe
    assert not (run / "incidents.jsonl").exists()
