"""benchmarks/gpu_check.sh fits a session's 15 minutes of device time: the first command within 9 minutes, the
second within 4.5, each dry-runnable on the CPU (run here), and a test collection that survives missing packages."""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
SCRIPT = ROOT / "benchmarks" / "gpu_check.sh"
LIMIT_S = {"1": 9 * 60, "2": 4.5 * 60, "extra": 10 * 60}  # 1 + 2 + start-up (1-2 min) within 15 minutes
INSTALL_S = 30
# Absent on the GPU test machine (../shared/gpu/README.md lists what it has), or optional extras anywhere.
OPTIONAL = {"av", "liger_kernel", "flash_attn", "bitsandbytes", "gguf", "llama_cpp", "diffusers"}


def _body(part: str) -> str:
    return re.search(rf"^  {part}\)\n(.*?)^    ;;", SCRIPT.read_text(), re.S | re.M).group(1)


def _stage_timeouts(part: str) -> list[int]:
    body = _body(part)
    return [int(s) for s in re.findall(r"^\s*(?:stage|bench) [\w.-]+ (\d+) ", body, re.M)]


@pytest.mark.parametrize("part", ["1", "2", "extra"])
def test_each_command_of_the_gpu_check_ends_in_time(part):
    timeouts = _stage_timeouts(part)
    assert timeouts and INSTALL_S + sum(timeouts) <= LIMIT_S[part], (part, timeouts)
    assert f"timeout {INSTALL_S} python3 -m pip install" in SCRIPT.read_text()
    assert LIMIT_S["1"] + LIMIT_S["2"] + 90 <= 15 * 60  # and a start-up of 1.5 minutes


def test_the_speed_commands_measure_rather_than_re_check():
    """The first run settled the doctor and pytest -m gpu: the speed commands do not spend device time on them; the
    first command runs what the issue asks, rocktune first, hf-best (the longest) last."""
    one, two = _body("1"), _body("2")
    assert "doctor" not in one + two and "pytest" not in one + two
    configs = re.findall(r"^\s*bench [\w.-]+ \d+ \"\$SMALL\" ([\w-]+)", one, re.M)
    assert configs == ["rocktune", "rt-no-compile", "rt-liger", "hf-best"]
    assert re.findall(r"^\s*bench [\w.-]+ \d+ \"\$LARGE\" ([\w-]+)", two, re.M) == ["rocktune"]


def test_no_test_module_imports_an_optional_package_at_module_level():
    """pytest -m gpu collects every module: a module-level import of a package the machine lacks fails the run."""
    bad = []
    for path in sorted((ROOT / "tests").glob("*.py")):
        for node in ast.parse(path.read_text()).body:
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            bad += [f"{path.name}: {n}" for n in names if n.split(".")[0] in OPTIONAL]
    assert bad == []


def _dry_run(part: str, out: Path, configs: str = "rocktune") -> str:
    env = dict(os.environ, OUT=str(out), PY=sys.executable, GPU_CHECK_CONFIGS=configs)
    proc = subprocess.run(["bash", str(SCRIPT), part, "--dry-run"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr
    return (out / "stages.txt").read_text()


@pytest.mark.slow
@pytest.mark.parametrize("part, shape", [("1", "0.5b"), ("2", "1.5b")])
def test_commands_1_and_2_dry_run_the_bench_writing_as_they_go(part, shape, tmp_path):
    stages = _dry_run(part, tmp_path)
    assert "timed out" not in stages and f"rocktune-{shape} ends: exit status 0" in stages, stages
    if part == "1":
        assert stages.count("skipped (GPU_CHECK_CONFIGS)") == 3  # the others, cut for the CPU
    suite = json.loads((tmp_path / f"rocktune-{shape}.json").read_text())
    rows = next(iter(suite["reports"].values()))["configs"]
    assert [r["name"] for r in rows] == ["rocktune"] and rows[0]["status"] == "ok"
    assert rows[0]["forwards_per_step"] and rows[0]["measured_steps"] == 1  # the dry suite's single step
    assert [p.name for p in (tmp_path / "results").glob("*.json")] == ["rocktune-0.json"]


@pytest.mark.long  # the extra command is outside the 15-minute plan; its dry run compiles a layer
def test_extra_dry_runs_the_doctor_pytest_gpu_and_the_loss(tmp_path):
    stages = _dry_run("extra", tmp_path)
    assert len(re.findall(r"ends: exit status 0", stages)) == 4, stages
    doctor = json.loads((tmp_path / "doctor.json").read_text())
    varlen = [c for c in doctor["checks"] if c["name"].startswith("varlen[")]
    assert varlen and varlen[0]["status"] == "skip"  # CUDA-only: skipped with its reason on a CPU
    assert "skipped" in (tmp_path / "pytest-gpu.txt").read_text()  # collected everything, ran none here
    loss = json.loads((tmp_path / "profile-loss.json").read_text())
    assert loss["compiled"]["aten_calls_per_chunk"] < loss["eager"]["aten_calls_per_chunk"]
    layers = json.loads((tmp_path / "compiled-layer.json").read_text())["layers"]
    assert [x["graph_breaks"] for x in layers] == [0, 0] and all(x["forward"]["generated"] > 0 for x in layers)


def test_the_first_command_covers_the_whole_gpu_suite():
    """Command 1 runs every configuration of the GPU suite on the 0.5B shape; command 2 the 1.5B shape's rocktune."""
    from rocktune.bench.suites import SUITES

    configs = re.findall(r"^\s*bench [\w.-]+ \d+ \"\$SMALL\" ([\w-]+)", _body("1"), re.M)
    assert set(configs) == set(SUITES["gpu"].configs.split(","))


def test_a_suite_shape_runs_alone_at_the_suites_workload_and_configs_can_be_cut(tmp_path):
    """Part b runs the 0.5B shape, part c the 1.5B shape with two configurations: each at the GPU suite's workload."""
    from rocktune.bench.suites import SUITES, run_suite

    asked = []

    def fake_bench(req, log):
        asked.append(req)
        return {"configs": []}

    run_suite("gpu", "qwen2.5-1.5b-shape", "cuda", str(tmp_path), 60.0, fake_bench, lambda m: None,
              "hf-best,rocktune")
    run_suite("gpu", "tiny", "cpu", str(tmp_path), 60.0, fake_bench, lambda m: None)
    full, dry = asked
    assert (full.model, full.configs, full.steps, full.warmup) == ("qwen2.5-1.5b-shape", "hf-best,rocktune", 8, 2)
    assert full.common["max_length"] == 2048 and full.token_range == (50, 2000)
    assert dry.common["max_length"] == 256 and dry.configs == SUITES["gpu"].configs
    assert (tmp_path / "report-qwen2.5-1.5b-shape.json").is_file()
