"""benchmarks/gpu_check.sh fits the GPU test machine: five parts, each within 8 minutes of its 10-minute limit per
command, each dry-runnable on the CPU (run here), and a test collection that survives its missing packages."""

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
PART_LIMIT_S = 8 * 60
INSTALL_S = 30
# Absent on the GPU test machine (../shared/gpu/README.md lists what it has), or optional extras anywhere.
OPTIONAL = {"av", "liger_kernel", "flash_attn", "bitsandbytes", "gguf", "llama_cpp", "diffusers"}


def _stage_timeouts(part: str) -> list[int]:
    text = SCRIPT.read_text()
    body = re.search(rf"^  {part}\)\n(.*?)^    ;;", text, re.S | re.M).group(1)
    return [int(s) for s in re.findall(r"^\s*stage [\w.-]+ (\d+) ", body, re.M)]


@pytest.mark.parametrize("part", ["a", "b", "c", "d", "e"])
def test_each_part_of_the_gpu_check_ends_within_8_minutes(part):
    timeouts = _stage_timeouts(part)
    assert timeouts and sum(timeouts) <= 450 and INSTALL_S + sum(timeouts) <= PART_LIMIT_S, (part, timeouts)
    assert f"timeout {INSTALL_S} python3 -m pip install" in SCRIPT.read_text()


def test_no_test_module_imports_an_optional_package_at_module_level():
    """pytest -m gpu collects every module: a module-level import of a package the machine lacks fails the run."""
    bad = []
    for path in sorted((ROOT / "tests").glob("*.py")):
        for node in ast.parse(path.read_text()).body:
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            bad += [f"{path.name}: {n}" for n in names if n.split(".")[0] in OPTIONAL]
    assert bad == []


def _dry_run(part: str, out: Path) -> str:
    env = dict(os.environ, OUT=str(out), PY=sys.executable, GPU_CHECK_CONFIGS="rocktune", GPU_CHECK_POINTS="1")
    proc = subprocess.run(["bash", str(SCRIPT), part, "--dry-run"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr
    return (out / "stages.txt").read_text()


@pytest.mark.slow
def test_part_a_dry_runs_doctor_pytest_gpu_and_a_profiled_step(tmp_path):
    stages = _dry_run("a", tmp_path)
    assert len(re.findall(r"ends: exit status 0", stages)) == 4, stages
    doctor = json.loads((tmp_path / "doctor.json").read_text())
    varlen = [c for c in doctor["checks"] if c["name"].startswith("varlen[")]
    assert varlen and varlen[0]["status"] == "skip"  # CUDA-only: skipped with its reason on a CPU
    assert "skipped" in (tmp_path / "pytest-gpu.txt").read_text()  # collected everything, ran none here
    profile = json.loads((tmp_path / "profile" / "profile.json").read_text())
    assert profile["attention"] == "sdpa" and profile["aten_op_calls"] > 0 and profile["measured_on"] == "cpu"


SUITE_FILES = {"b": "0.5b", "c": "1.5b", "d": "0.5b-rest"}


@pytest.mark.slow
@pytest.mark.parametrize("part", ["b", "c", "d"])
def test_parts_b_c_d_dry_run_the_bench_and_the_peak_check(part, tmp_path):
    stages = _dry_run(part, tmp_path)
    assert "timed out" not in stages and "exit status 0" in stages, stages
    suite = json.loads((tmp_path / f"suite-{SUITE_FILES[part]}.json").read_text())
    rows = next(iter(suite["reports"].values()))["configs"]
    assert [r["name"] for r in rows] == ["rocktune"] and rows[0]["status"] == "ok"
    results = list((tmp_path / f"results-{SUITE_FILES[part]}").glob("*.json"))
    assert [p.name for p in results] == ["rocktune-0.json"]  # written as each configuration finished
    if part == "d":
        point = json.loads((tmp_path / "auto_peak.jsonl").read_text().splitlines()[0])
        assert point["predicted"] > 0 and "error_message" not in point


@pytest.mark.slow
def test_part_e_dry_runs_the_compiled_step_and_the_loss(tmp_path):
    stages = _dry_run("e", tmp_path)
    assert len(re.findall(r"ends: exit status 0", stages)) == 2, stages
    step = json.loads((tmp_path / "profile-compiled" / "profile.json").read_text())
    assert step["compiled"] and step["step_s"] > 0 and 0 < step["host_share"] <= 1.0 + 1e-6
    assert step["compiler"]["frames_compiled"] >= 1 and step["compiler"]["graph_breaks"] == 0
    loss = json.loads((tmp_path / "profile-loss.json").read_text())
    assert loss["compiled"]["aten_calls_per_chunk"] < loss["eager"]["aten_calls_per_chunk"]


def test_the_parts_cover_the_whole_gpu_suite():
    """Parts b, c and d between them run every configuration of the GPU suite on the shape it is run on."""
    from rocktune.bench.suites import SUITES

    text = SCRIPT.read_text()
    small = set(re.search(r"GPU_CHECK_CONFIGS:-(hf-best,rocktune)}", text).group(1).split(","))
    small |= set(re.search(r"GPU_CHECK_CONFIGS:-(hf-seed[\w,-]*)}", text).group(1).split(","))
    assert small == set(SUITES["gpu"].configs.split(","))


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
    assert (full.model, full.configs, full.steps, full.warmup) == ("qwen2.5-1.5b-shape", "hf-best,rocktune", 3, 2)
    assert full.common["max_length"] == 2048 and full.token_range == (50, 2000)
    assert dry.common["max_length"] == 256 and dry.configs == SUITES["gpu"].configs
    assert (tmp_path / "report-qwen2.5-1.5b-shape.json").is_file()
