"""``rocktune doctor --model PATH``: the model's own training path on the device against PEFT's reference, in the
doctor's child process; the two bugs that once reached users, put back by hand, each fail with its cause."""

from __future__ import annotations

import json
import os

import pytest

from rocktune.cli import main
from rocktune.doctor.checks import CheckResult
from rocktune.doctor.runner import run_checks
from rocktune.tasks.causal import pathcheck

CHILD = "rocktune.tasks.causal.pathcheck"


def _env(**extra) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != pathcheck.INJECT_ENV}
    env.update(extra)
    return env


def test_the_cases_follow_what_train_would_run():
    assert pathcheck.names("cpu", "fp32") == ["train-path[fp32,eager]"]
    assert pathcheck.names("cuda", "bf16") == ["train-path[bf16,eager]", "train-path[bf16,compiled]"]


@pytest.mark.parametrize("inject,cause", [("", None), ("stale", "stale"), ("nograd", "no-gradient")])
def test_the_model_s_path_against_the_reference(tiny_model_dir, inject, cause):
    env = _env(**({pathcheck.INJECT_ENV: f"train-path={inject}"} if inject else {}))
    (result,) = run_checks("cpu", ["train-path[fp32,eager]"], env, 300, (CHILD, str(tiny_model_dir)))
    if cause is None:
        assert result.status == "pass", result.detail
        got, ref = result.metrics["losses"], result.metrics["reference_losses"]
        assert got == pytest.approx(ref, rel=1e-5) and got[-1] < got[0] - 0.1  # it learns, as the reference does
    else:
        assert result.status == "fail" and result.detail.startswith(f"{cause}:"), result.detail


@pytest.mark.long
def test_doctor_model_on_the_cli(tiny_model_dir, monkeypatch, capsys):
    """The device's own checks stubbed (test_doctor_cli runs them); --model adds the path's, and a fail is exit 1."""
    monkeypatch.setattr("rocktune.doctor.main._checks", lambda *a: [CheckResult("matmul[float32]", "pass")])
    assert main(["doctor", "--json", "--no-perf", "--model", str(tiny_model_dir)]) == 0
    checks = {c["name"]: c for c in json.loads(capsys.readouterr().out)["checks"]}
    assert checks["train-path[fp32,eager]"]["status"] == "pass"
    monkeypatch.setenv(pathcheck.INJECT_ENV, "train-path=stale")
    assert main(["doctor", "--no-perf", "--model", str(tiny_model_dir)]) == 1
    assert main(["doctor", "--model", str(tiny_model_dir / "missing")]) == 2
