"""Issue 28, the second hour: what a new user still trips on after the demo works (each test fails without its fix)."""

from __future__ import annotations

import os
import sys

import pytest


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
    assert summary.next_commands(tmp_path / "run")[1].startswith(f"  .venv/bin/rocktune generate {tmp_path / 'run'} --chat")
    # Activated: the bare name.
    monkeypatch.setenv("PATH", str(bin_dir) + os.pathsep + "/usr/bin")
    assert summary.rocktune_command() == "rocktune"
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    monkeypatch.setenv("PATH", "/nonexistent")
    assert summary.rocktune_command() == str(script)
