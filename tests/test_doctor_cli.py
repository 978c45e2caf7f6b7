"""The doctor end to end: child-process isolation, injected faults through the child, CLI output and exit codes."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from rocktune.cli import main
from rocktune.doctor.registry import INJECT_ENV
from rocktune.doctor.runner import run_checks

PLATFORMS = Path(__file__).parent / "data" / "platforms"
NUMERIC = ["transfer[pageable]", "convert[float32->bfloat16]", "convert[bfloat16->float16]", "matmul[float32]",
           "matmul[bfloat16]", "sdpa[MATH,float32]"]


def _env(**extra) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != INJECT_ENV}
    env.update(extra)
    return env


def test_child_honours_injected_faults_and_each_check_fails():
    inject = "transfer=perturb;convert=ftz;matmul=off"
    results = {r.name: r for r in run_checks("cpu", NUMERIC, _env(**{INJECT_ENV: inject}), timeout=120)}
    assert [results[n].status for n in NUMERIC] == ["fail"] * 5 + ["pass"]
    assert "flushed to zero" in results["convert[float32->bfloat16]"].detail


def test_a_crashing_check_fails_alone_and_the_rest_still_run():
    names = ["matmul[float32]", "convert[float32->bfloat16]", "sdpa[MATH,float32]"]
    results = run_checks("cpu", names, _env(**{INJECT_ENV: "crash=convert[float32->bfloat16]"}), timeout=120)
    assert [r.status for r in results] == ["pass", "fail", "pass"]
    assert "SIGABRT" in results[1].detail


def test_a_child_that_cannot_start_fails_every_check(monkeypatch):
    env = _env(PYTHONPATH="/nonexistent", PYTHONNOUSERSITE="1")
    monkeypatch.setattr("rocktune.doctor.runner.sys.executable", "/bin/false")
    results = run_checks("cpu", ["matmul[float32]", "sdpa[MATH,float32]"], env, timeout=30)
    assert [r.status for r in results] == ["fail", "fail"] and "status 1" in results[0].detail


def test_doctor_json_on_this_cpu_machine_passes(capsys):
    assert main(["doctor", "--json", "--no-perf"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert set(report) >= {"platform", "advice", "checks"}
    assert report["platform"]["backend"] in ("cpu", "rocm", "cuda") and report["device"] == "cpu"
    statuses = {c["name"]: c["status"] for c in report["checks"]}
    assert statuses["lora[float32]"] == "pass" and statuses["transfer[pinned]"] == "skip"
    assert "fail" not in statuses.values()
    assert report["advice"]["defaults"]["precision"] == "fp32"


def test_doctor_exit_status_is_1_when_a_check_fails(monkeypatch, capsys):
    from rocktune.doctor.checks import CheckResult

    monkeypatch.setenv("COLUMNS", "200")
    failing = [CheckResult("matmul[float32]", "fail", "max error 1.00e+00", 1.0, 1e-4),
               CheckResult("allocator", "skip", "the CPU has no caching allocator")]
    monkeypatch.setattr("rocktune.doctor.main._checks", lambda *a: failing)
    assert main(["doctor", "--no-device", "--no-perf"]) == 1
    out = capsys.readouterr().out
    assert "FAIL" in out and "checks failed: 0 passed, 1 failed, 1 skipped" in out and "matmul[float32]" in out


def test_simulate_gives_the_advice_without_running_checks(capsys):
    assert main(["doctor", "--simulate", str(PLATFORMS / "mi50_gfx906_torch251_rocm62.json"), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["checks"] == [] and report["platform"]["devices"][0]["arch"] == "gfx906"
    assert "gfx906-torch25-faults" in {f["id"] for f in report["advice"]["findings"]}


def test_simulate_accepts_a_whole_report_and_prints_a_table(tmp_path, capsys, monkeypatch):
    import functools

    from rich.console import Console

    from rocktune.doctor import render

    # a wide table, whatever width earlier tests in this process left rich to detect: the content is under test
    monkeypatch.setattr(render, "Console", functools.partial(Console, width=200))
    report = {"platform": json.loads((PLATFORMS / "rx6700xt_gfx1031.json").read_text()), "advice": {}, "checks": []}
    path = tmp_path / "report.json"
    path.write_text(json.dumps(report))
    assert main(["doctor", "--simulate", str(path)]) == 0
    out = capsys.readouterr().out
    assert "HSA_OVERRIDE_GFX_VERSION" in out and "10.3.0" in out and "gfx1031" in out


def test_bad_input_is_exit_2(tmp_path, capsys):
    assert main(["doctor", "--simulate", str(tmp_path / "missing.json")]) == 2
    bad = tmp_path / "bad.json"
    bad.write_text("{\"os\": \"linux\"}")
    assert main(["doctor", "--simulate", str(bad)]) == 2
    assert main(["env", "--arch", "rtx4090"]) == 2
    assert "error" in capsys.readouterr().err


@pytest.mark.parametrize(("name", "shell", "expected", "absent"), [
    ("rx6700xt_gfx1031", "bash", "export HSA_OVERRIDE_GFX_VERSION='10.3.0'", "# export"),
    ("strix_halo_gfx1151_windows", None, '# $env:HIP_DISABLE_IPC = "1"', "export "),
    ("rx7900xt_x2_gfx1100_linux", "bash", "# export NCCL_P2P_DISABLE='1'", "export HSA_OVERRIDE"),
])
def test_env_prints_export_lines(name, shell, expected, absent, capsys):
    args = ["env", "--simulate", str(PLATFORMS / f"{name}.json")] + (["--shell", shell] if shell else [])
    assert main(args) == 0
    out = capsys.readouterr().out
    assert expected in out.splitlines()
    assert not any(line.startswith(absent) for line in out.splitlines())
