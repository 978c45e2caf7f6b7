"""benchmarks/gpu_check.sh fits a session's 15 minutes of device time and brings back a valid answer: its first
command proves on the device that every path trains before it measures speed, its bench stages come back as one
report whose ratios are computed, a stage cut by its timeout still reports its steps, a speed whose loss did not
fall is no figure, and at most 8 files come back. Dry-runnable on the CPU (run here, long), with a test collection
that survives missing packages."""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
SCRIPT = ROOT / "benchmarks" / "gpu_check.sh"
# The device's 15 minutes: a start-up of up to 1.5 minutes, command 1 and command 2 (at most 10 minutes each);
# the extra and tests commands are outside the plan, one command each.
DEVICE_S, START_UP_S, COMMAND_MAX_S = 15 * 60, 90, 600
LIMIT_S = {"1": 9 * 60, "2": 4.5 * 60, "extra": COMMAND_MAX_S, "tasks": COMMAND_MAX_S, "tests": COMMAND_MAX_S,
           "moe": 9 * 60, "recurrent": 9 * 60}
INSTALL_S = 30
PER_STAGE_S = 2  # a stage's line (python -m rocktune.bench.check) and the archive rebuilt after it
MAX_FILES = 8  # what the device machine brings back from $OUT (16 MiB each)
# Absent on the GPU test machine (../shared/gpu/README.md lists what it has), or optional extras anywhere.
OPTIONAL = {"av", "liger_kernel", "flash_attn", "bitsandbytes", "gguf", "llama_cpp", "diffusers"}
STAGE = re.compile(r"^\s*(?:(?:plain|tests|bench) ([\w.-]+)|(correctness)) (\d+)\b", re.M)


def _body(part: str) -> str:
    return re.search(rf"^  {part}\)\n(.*?)^    ;;", SCRIPT.read_text(), re.S | re.M).group(1)


def _stages(part: str) -> list[tuple[str, int]]:
    return [(a or b, int(s)) for a, b, s in STAGE.findall(_body(part))]


@pytest.mark.parametrize("part", ["1", "2", "extra", "tasks", "tests", "moe", "recurrent"])
def test_each_command_of_the_gpu_check_ends_in_time(part):
    stages = _stages(part)
    spent = INSTALL_S + sum(s for _, s in stages) + PER_STAGE_S * len(stages)
    assert stages and spent <= LIMIT_S[part] <= COMMAND_MAX_S, (part, stages, spent)
    assert f"timeout {INSTALL_S} python3 -m pip install" in SCRIPT.read_text()
    assert START_UP_S + LIMIT_S["1"] + LIMIT_S["2"] <= DEVICE_S


def test_the_first_command_proves_training_before_it_measures_speed():
    """Budget honesty: if only the first command runs, it answers "does every path train correctly on this device"
    first (the correctness matrix and the LoRA side paths under pytest -x, then every gpu-marked test but the
    planner's, then the grouped-query varlen self-test), and only then spends time on speed; a failed correctness
    stage skips the speed stages (a speed of paths not proven to train is no figure)."""
    names = [n for n, _ in _stages("1")]
    assert names == ["correctness", "machine", "gpu-tests", "varlen-gqa", "rocktune-0.5b", "hf-best-0.5b"]
    text = SCRIPT.read_text()
    files = re.search(r'local files=\(([^)]*)\)', text).group(1).split()
    assert files == ['"$MATRIX"', "tests/test_lora_fused.py", "tests/test_lean_lora.py",
                     "tests/test_varlen_attention.py"]
    assert "MATRIX=${GPU_CHECK_MATRIX:-tests/test_training_matrix.py}" in text
    assert '$PY -m pytest -x -q -p no:cacheprovider $COLLECT "${files[@]}"' in text
    assert re.search(r"tests gpu-tests \d+ \$PY -m pytest -q -p no:cacheprovider \$COLLECT -m gpu tests \\\n"
                     r"\s+--deselect tests/test_gpu_train.py --deselect tests/test_planner_validation.py\n", text)
    # what command 1 leaves out of the gpu-marked tests (about 150 s for the real loop's three compiled runs on the
    # first H200 run) is the tests command's
    assert "-m gpu tests/test_gpu_train.py \\\n      tests/test_planner_validation.py" in _body("tests")
    bench = text.split("\nbench() {", 1)[1].split("\n}", 1)[0]
    assert 'gated "$name" || return' in bench  # the speed stages wait on the correctness stages' verdict
    # the rocktune row has the longest speed timeout: compiling took 48 s of its 80 s on the first H200 run
    times = dict(_stages("1"))
    assert times["rocktune-0.5b"] == max(t for n, t in times.items() if n.endswith("0.5b")) >= 150


def test_the_commands_cover_the_whole_gpu_suite():
    """Command 1 has the ratio's two rows (rocktune, hf-best); what explains the gap (rt-no-compile, rt-liger) is in
    extra; command 2 has the 1.5B shape's rocktune."""
    from rocktune.bench.suites import SUITES

    def configs(part, shape):
        return re.findall(rf"^\s*bench [\w.-]+ \d+ \"\${shape}\" ([\w-]+)", _body(part), re.M)

    assert configs("1", "SMALL") == ["rocktune", "hf-best"]
    assert configs("2", "LARGE") == ["rocktune"]
    assert set(configs("1", "SMALL") + configs("extra", "SMALL")) == set(SUITES["gpu"].configs.split(","))


def test_no_test_module_imports_an_optional_package_at_module_level():
    """pytest -m gpu collects every module: a module-level import of a package the machine lacks fails the run."""
    bad = []
    for path in sorted((ROOT / "tests").glob("*.py")):
        for node in ast.parse(path.read_text()).body:
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            bad += [f"{path.name}: {n}" for n in names if n.split(".")[0] in OPTIONAL]
    assert bad == []


# ---- the stages' lines and the one report (src/rocktune/bench/check.py), on results fed in ---------------------

SHAPE = {"matmul_params": 494_000_000, "layers": 24, "attn_dim": 896, "head_params": 136_000_000,
         "dtype": "bfloat16"}


def _result(name, tok_s, peak, losses=(12.0, 11.9, 11.8, 11.7), attention=None):
    steps = [{"step": i + 1, "loss": loss, "tokens": tok_s, "step_s": 1.0, "real_tokens": 2 * tok_s,
              "batch_tokens": 2 * tok_s, "forwards": 1} for i, loss in enumerate(losses)]
    return {"name": name, "kind": "hf" if name.startswith("hf") else "rocktune", "status": "ok", "steps": steps[2:],
            "first_round_losses": list(losses), "first_round_steps": steps, "shape": SHAPE,
            "memory": {"device_peak_allocated_bytes": peak, "rss_growth_bytes": 1},
            "environment": {"gpu": "NVIDIA H200", "device": "cuda"}, "compiler": {"recompiles": 1},
            "resolved": {"attention": attention, "fusion": "inductor"} if attention else {}}


def _stage_report(tmp_path, stage, result):
    """What one bench stage writes: a suite report with that configuration's row alone (no ratio in it)."""
    from rocktune.bench import runner

    rep = runner.summarise([result], 0, [500, 1500], "cuda", {**runner.COMMON, "micro_batch_size": 8})
    rep["workload"] = {"model": "qwen2.5-0.5b-shape", "micro_batch_size": 8, "grad_accum": 8}
    path = tmp_path / f"{stage}.json"
    path.write_text(json.dumps({"reports": {"qwen2.5-0.5b-shape": rep}}))
    return path


def test_one_report_holds_every_stages_rows_and_computes_the_ratios(tmp_path):
    from rocktune.bench import check

    note = ("varlen_attn over the collate's document bounds (self-test: varlen_attn bfloat16 on cuda: worst "
            "relative error 6.21e-03 (dq) ...; grouped K/V un-repeated (the kernel takes no enable_gqa))")
    rt = _stage_report(tmp_path, "rocktune-0.5b", _result("rocktune", 36_000, 40e9, attention=note))
    hf = _stage_report(tmp_path, "hf-best-0.5b", _result("hf-best", 20_000, 50e9))
    assert json.loads(rt.read_text())["reports"]["qwen2.5-0.5b-shape"]["configs"][0]["ratios"] == {}  # alone
    merged = check.merge([rt, hf], "cuda")
    rep = merged["reports"]["qwen2.5-0.5b-shape"]
    assert rep["best_hf"] == "hf-best" and [r["name"] for r in rep["configs"]] == ["rocktune", "hf-best"]
    best = rep["configs"][0]["ratios"]["best-hf"]
    assert best["tokens_per_s"] == pytest.approx(1.8) and best["memory"] == pytest.approx(0.8)
    assert rep["targets"]["tokens_per_s_vs_best-hf"]["met"] is True and rep["targets"]["memory_vs_best-hf"]["met"]
    assert check.ratio_lines(merged) == [
        "ratios qwen2.5-0.5b-shape: rocktune / hf-best: tokens/s 1.80x (target >= 1.5x), memory 0.80x (target <= "
        f"1.0x), MFU {rep['configs'][0]['mfu']:.1%} (target 30%)"]
    line = check.bench_line(check.Stage("rocktune-0.5b", 0, 97, rt), rep["configs"][0])
    assert line.startswith("rocktune-0.5b: ok, loss 12.0000 -> 11.7000 (4 steps), MFU ")
    assert ", tokens/s 36,000, peak 37.3 GiB, attention varlen_attn (K/V un-repeated), fusion inductor, " \
           "recompiles 1, 97 s" in line


def test_a_speed_whose_loss_did_not_fall_is_marked_invalid_in_its_line_and_its_ratio(tmp_path):
    from rocktune.bench import check

    rt = _stage_report(tmp_path, "rocktune-0.5b", _result("rocktune", 90_000, 40e9, losses=(12.0, 12.0, 12.0, 12.0)))
    hf = _stage_report(tmp_path, "hf-best-0.5b", _result("hf-best", 20_000, 50e9))
    rep = check.merge([rt, hf], "cuda")["reports"]["qwen2.5-0.5b-shape"]
    row = rep["configs"][0]
    assert row["ratios"]["best-hf"]["tokens_per_s"] is None and rep["targets"]["tokens_per_s_vs_best-hf"]["met"] \
        is None
    line = check.bench_line(check.Stage("rocktune-0.5b", 0, 97, rt), row)
    assert line.startswith("rocktune-0.5b: INVALID, loss 12.0000 -> 12.0000 (4 steps), tokens/s INVALID (loss did "
                           "not fall), peak 37.3 GiB") and "90,000" not in line and "loss did not fall" in line


def test_a_bench_stage_killed_by_its_timeout_reports_what_its_metrics_held(tmp_path):
    """The stage's own timeout killed the bench before it wrote a report: the line and the merged report come from
    the run's metrics.jsonl (rocktune's loop writes it step by step), warm-up steps out of the figures."""
    from rocktune.bench import check
    from rocktune.bench.suites import SUITES

    run_dir = tmp_path / "runs" / "rocktune"
    run_dir.mkdir(parents=True)
    rows = [{"step": i, "loss": 12.0 - i / 10, "tokens": 60_000, "real_tokens": 64_000, "batch_tokens": 65_536,
             "step_s": 50.0 if i == 1 else 2.0, "compiling": i == 1, "forwards": 1, "peak_mem_bytes": 40 * 2**30}
            for i in range(1, 6)]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    stage = check.Stage("rocktune-0.5b", 124, 160, tmp_path / "rocktune-0.5b.json")
    stage.file.write_text("")  # the bench's stdout, cut off
    row = check.bench_row(stage, "qwen2.5-0.5b-shape", "rocktune", run_dir, "cuda")
    warmup = SUITES["gpu"].warmup
    assert row["status"] == "timeout" and row["measured_steps"] == 5 - warmup and row["useful_tokens_per_s"] == 30_000
    assert row["losses"] == pytest.approx([11.9, 11.8, 11.7, 11.6, 11.5]) and row["peak_memory_bytes"] == 40 * 2**30
    line = check.bench_line(stage, row)
    assert line.startswith("rocktune-0.5b: TIMEOUT (partial), loss 11.9000 -> 11.5000 (5 steps), MFU -, "
                           "tokens/s 30,000, peak 40.0 GiB")
    assert "exit status 124 after 160 s, timed out" in line and f"(5 steps done, {5 - warmup} measured)" in line
    hf = _stage_report(tmp_path, "hf-best-0.5b", _result("hf-best", 20_000, 50e9))
    rep = check.merge([stage.file, hf], "cuda")["reports"]["qwen2.5-0.5b-shape"]  # the partial row is merged too
    assert rep["configs"][0]["ratios"]["best-hf"]["tokens_per_s"] == pytest.approx(1.5)


def test_the_test_stages_line_is_pytests_verdict(tmp_path):
    from rocktune.bench import check

    out = tmp_path / "correctness.txt"
    out.write_text("....F\nFAILED tests/test_lora_fused.py::test_x - assert 0.0\n1 failed, 4 passed in 31.20s\n")
    assert check.tests_line(check.Stage("correctness", 1, 33, out)) == \
        "correctness: FAIL, 1 failed, 4 passed in 31.20s, 33 s"
    out.write_text("........\n")
    assert check.tests_line(check.Stage("gpu-tests", 124, 65, out)) == "gpu-tests: TIMEOUT, ........, 65 s"
    out.write_text("=== 7 passed, 2 skipped in 40.00s ===\n")
    assert check.tests_line(check.Stage("gpu-tests", 0, 41, out)) == \
        "gpu-tests: ok, === 7 passed, 2 skipped in 40.00s ===, 41 s"


def test_the_varlen_line_says_whether_grouped_kv_went_un_repeated(tmp_path):
    from rocktune.bench import check

    found = {"torch": "2.11.0+cu130", "heads": [14, 2], "kernels": {"varlen_attn": {
        "bfloat16": {"un-repeated": {"ok": True, "error": 6e-3}, "glue": {"ok": True, "grouped_kv_un_repeated": True}},
        "float16": {"un-repeated": {"ok": False, "error": None},
                    "glue": {"ok": True, "grouped_kv_un_repeated": False}}}}}
    path = tmp_path / "varlen-gqa.json"
    path.write_text(json.dumps(found))
    assert check.varlen_line(check.Stage("varlen-gqa", 0, 12, path)) == (
        "varlen-gqa: ok, torch 2.11.0+cu130, heads 14/2: varlen_attn bfloat16 ok (K/V un-repeated; un-repeated call "
        "error 6.0e-03); varlen_attn float16 ok (K/V repeated; un-repeated call raised), 12 s")


# ---- the recurrent part: its wheels, its stages, its lines ------------------------------------------------------

RECURRENT_WHEELS = "prepare.sh fla-core==0.6.0 einops==0.8.2"


def test_the_recurrent_part_tests_before_it_measures_and_fits_its_bench_in_its_stage():
    """The doctor's self-tests, then the tests (pytest -x: the recurrent kernel tests and the matrix's Qwen3.5 /
    Granite 4 rows, their GPU rows included), which gate the bench; the bench's two configurations, each under the
    bench's own timeout, leave the stage time to start, build the shape and write its report (so a configuration
    cut short still reports)."""
    body = _body("recurrent")
    assert [n for n, _ in _stages("recurrent")] == ["recurrent-doctor", "recurrent-tests", "recurrent-bench"]
    assert re.search(r'tests recurrent-tests \d+ \$PY -m pytest -x -q -p no:cacheprovider \$COLLECT '
                     r'tests/test_recurrent_kernels.py \\\n\s+"\$MATRIX" -k "recurrent or mamba"\n', body)
    assert "if gated recurrent-bench; then" in body
    assert "--configs rocktune,hf-tuned" in body and "--timeout $((BENCH_EACH * SLACK))" in body
    each = int(re.search(r"BENCH_EACH=(\d+)", body).group(1))
    assert 2 * each + 30 <= dict(_stages("recurrent"))["recurrent-bench"]
    text = SCRIPT.read_text()
    assert 'RECURRENT="--model qwen3.5-0.6b-scaled-shape ' in text and 'RECURRENT="--model qwen3.5-tiny-shape ' in text
    # what the machine must be given, said where the session that runs it reads
    assert RECURRENT_WHEELS in text and RECURRENT_WHEELS in (ROOT / "docs" / "benchmarks.md").read_text()


def test_the_recurrent_gpu_shape_is_qwen35s_stack_at_its_08b_widths():
    """qwen3.5-0.6b-scaled-shape, built on the meta device: the hybrid stack (three Gated DeltaNet layers, then full
    attention) with Qwen3.5-0.8B's published hidden size, MLP width, depth, heads and vocabulary, as its comment
    says; and not the release (the name says so): tiny_config's head layout."""
    import torch
    from transformers import AutoModelForCausalLM

    from rocktune.bench.workload import SHAPES
    from rocktune.demo.tiny import tiny_config

    release = json.loads((ROOT / "src" / "rocktune" / "planner" / "presets.json").read_text())["Qwen3.5-0.8B"]
    cfg = tiny_config(max_positions=1024, **SHAPES["qwen3.5-0.6b-scaled-shape"])
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "vocab_size", "tie_word_embeddings"):
        assert getattr(cfg, key) == release[key], key
    assert cfg.layer_types == ["full_attention" if i % 4 == 3 else "linear_attention" for i in range(24)]
    # the release: 256, 16, 16
    assert (cfg.head_dim, cfg.linear_num_key_heads, cfg.linear_num_value_heads) == (128, 2, 4)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    assert round(sum(p.numel() for p in model.parameters()) / 1e9, 2) == 0.58


def _doctor_output(tmp_path, lines):
    path = tmp_path / "recurrent-doctor.txt"
    path.write_text("".join(x + "\n" for x in lines))
    return path


def test_the_recurrent_doctor_line_says_what_imports_and_each_verdict(tmp_path):
    from rocktune.bench import check

    def result(name, status, detail, error=None, tol=None):
        return "@@result " + json.dumps({"name": f"recurrent[{name}]", "status": status, "detail": detail,
                                         "error": error, "tolerance": tol, "metrics": {}, "seconds": 1.0})

    absent = "{} is not installed: training runs transformers' torch reference path (pip install {} for the fast one)"
    lines = ['@@package {"name": "fla", "version": "0.6.0"}', '@@package {"name": "causal_conv1d", "absent": true}',
             '@@package {"name": "mamba_ssm", "error": "ModuleNotFoundError: No module named \'selective_scan_cuda\'"}']
    for fam, dist, dt in [("gated_deltanet", None, "bfloat16"), ("causal_conv1d", "causal-conv1d", "bfloat16"),
                          ("mamba2", "mamba-ssm", "bfloat16"), ("gated_deltanet", None, "float16"),
                          ("causal_conv1d", "causal-conv1d", "float16"), ("mamba2", "mamba-ssm", "float16")]:
        lines.append(f"@@start recurrent[{fam},{dt}]")
        if dist:
            lines.append(result(f"{fam},{dt}", "skip", absent.format(dist, dist)))
        elif dt == "bfloat16":
            lines.append(result(f"{fam},{dt}", "pass", "training uses chunk_gated_delta_rule, ...", 3.1e-3, 2e-2))
    out = _doctor_output(tmp_path, lines)
    assert check.doctor_line(check.Stage("recurrent-doctor", 124, 100, out)) == (
        "recurrent-doctor: TIMEOUT, fla 0.6.0, causal_conv1d absent, mamba_ssm: ModuleNotFoundError: No module named "
        "'selective_scan_cuda'; gated_deltanet,bfloat16 pass (error 3.1e-03, tolerance 2e-02); gated_deltanet,float16 "
        "no verdict (its process died or the stage's timeout hit inside it); skip (causal-conv1d is not installed): "
        "causal_conv1d,bfloat16, causal_conv1d,float16; skip (mamba-ssm is not installed): mamba2,bfloat16, "
        "mamba2,float16, 100 s")
    failed = "training runs transformers' torch reference path for chunk_gated_delta_rule (self-test failed: x)"
    out = _doctor_output(tmp_path, lines[:4] + [result("gated_deltanet,bfloat16", "fail", failed, 0.5, 2e-2)])
    line = check.doctor_line(check.Stage("recurrent-doctor", 0, 40, out))
    assert line.startswith("recurrent-doctor: FAIL, fla 0.6.0, ") and f"gated_deltanet,bfloat16 FAIL ({failed})" in line
    out.write_text("Traceback (most recent call last):\nImportError: cannot import name 'child'\n")
    assert check.doctor_line(check.Stage("recurrent-doctor", 1, 3, out)) == \
        "recurrent-doctor: FAIL, ImportError: cannot import name 'child', 3 s"


def test_the_recurrent_bench_line_gives_each_row_and_rocktunes_ratio(tmp_path):
    from rocktune.bench import check, runner

    rt = _result("rocktune", 30_000, 20e9)
    hf = _result("hf-tuned", 20_000, 25e9)
    rep = runner.summarise([rt, hf], 0, [], "cuda", runner.COMMON)
    rep["workload"] = {"model": "qwen3.5-0.6b-scaled-shape"}
    rep["environment"] = {"device": "cuda"}
    path = tmp_path / "recurrent-bench.json"
    path.write_text(json.dumps(rep))
    line = check.pair_line(check.Stage("recurrent-bench", 0, 200, path))
    assert line.startswith("recurrent-bench: ok, qwen3.5-0.6b-scaled-shape on cuda: rocktune ok, loss 12.0000 -> "
                           "11.7000 (4 steps), tokens/s 30,000, MFU "), line
    assert "; hf-tuned ok, loss 12.0000 -> 11.7000 (4 steps), tokens/s 20,000, MFU " in line
    assert line.endswith("; rocktune / hf-tuned: tokens/s 1.50x, memory 0.80x, 200 s"), line
    flat = _result("rocktune", 90_000, 20e9, losses=(12.0, 12.0, 12.0, 12.0))
    rep = runner.summarise([flat, {"name": "hf-tuned", "kind": "hf", "status": "timeout", "reason": "timed out after "
                                   "110 s (0 steps done, 0 measured)"}], 0, [], "cuda", runner.COMMON)
    path.write_text(json.dumps(rep))
    line = check.pair_line(check.Stage("recurrent-bench", 0, 230, path))
    assert line.startswith("recurrent-bench: FAIL, ? on cuda: rocktune INVALID, loss 12.0000 -> 12.0000 (4 steps), "
                           "tokens/s INVALID (loss did not fall), peak ") and "90,000" not in line, line
    assert "hf-tuned TIMEOUT (partial), loss -, tokens/s -, MFU -, peak - (timed out after 110 s" in line
    path.write_text("")
    assert check.pair_line(check.Stage("recurrent-bench", 124, 260, path)) == \
        "recurrent-bench: TIMEOUT, no report, 260 s"


# ---- dry runs on the CPU (tiny model, the same stages; pytest only collects) -----------------------------------

def _dry_run(part: str, tmp_path: Path, **env) -> subprocess.CompletedProcess:
    env = dict(os.environ, OUT=str(tmp_path / "out"), PY=sys.executable, GPU_CHECK_SUITE=str(tmp_path / "suite"),
               OMP_NUM_THREADS="1", **env)
    return subprocess.run(["bash", str(SCRIPT), part, "--dry-run"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=900)


@pytest.mark.long  # about 2.5 minutes on 2 loaded cores: pytest collects everything twice, two bench children
def test_command_1_dry_run_returns_few_files_one_line_per_stage_and_the_ratios(tmp_path):
    matrix = (ROOT / "tests" / "test_training_matrix.py").is_file()
    proc = _dry_run("1", tmp_path, KEEP_GOING="1")
    out = tmp_path / "out"
    assert proc.returncode == (0 if matrix else 1), proc.stderr  # an absent matrix fails the command
    assert sorted(p.name for p in out.iterdir()) == ["gpu-check.tar.gz", "report.json", "stages.txt", "summary.txt"]
    assert len(list(out.iterdir())) <= MAX_FILES and all(p.stat().st_size < 16 * 2**20 for p in out.iterdir())
    lines = (out / "summary.txt").read_text().splitlines()
    assert [x.split(":", 1)[0] for x in lines] == ["correctness", "machine", "gpu-tests", "varlen-gqa",
                                                   "rocktune-0.5b", "hf-best-0.5b", "ratios tiny"], lines
    assert proc.stdout.splitlines() == lines  # the same lines come back in the command's output
    assert lines[0].startswith("correctness: ok" if matrix else "correctness: FAIL, tests/test_training_matrix.py is "
                                                                  "absent")
    assert "stand-in 2.11 signature float32 ok (K/V un-repeated" in lines[3]
    assert lines[4].startswith("rocktune-0.5b: ok, loss ") and lines[5].startswith("hf-best-0.5b: ok, loss ")
    rep = json.loads((out / "report.json").read_text())["reports"]["tiny"]
    assert rep["best_hf"] == "hf-best" and rep["stages"] == ["rocktune-0.5b", "hf-best-0.5b"]
    ratios = next(r for r in rep["configs"] if r["name"] == "rocktune")["ratios"]["best-hf"]
    assert ratios["tokens_per_s"] > 0 and ratios["memory"] > 0, ratios
    with tarfile.open(out / "gpu-check.tar.gz") as tar:
        names = set(tar.getnames())
    assert {"./correctness.txt", "./gpu-tests.txt", "./varlen-gqa.json", "./rocktune-0.5b.json", "./stages.txt",
            "./suite/rocktune-0.5b/runs/rocktune/metrics.jsonl", "./suite/hf-best-0.5b/runs/hf-best/metrics.jsonl",
            } <= names, names


@pytest.mark.long  # the test stages' collection alone takes half a minute here
def test_a_failed_correctness_stage_skips_the_speed_stages(tmp_path):
    proc = _dry_run("1", tmp_path, GPU_CHECK_MATRIX="tests/no_such_matrix.py")
    lines = (tmp_path / "out" / "summary.txt").read_text().splitlines()
    assert proc.returncode == 1 and lines[0].startswith("correctness: FAIL, tests/no_such_matrix.py is absent")
    assert lines[2].startswith("gpu-tests: ok") and lines[3].startswith("varlen-gqa: ok")  # the rest of the answer
    assert lines[4:] == [f"{n}: SKIPPED (correctness failed: a speed of paths not proven to train is no figure; "
                         "KEEP_GOING=1 runs it)" for n in ("rocktune-0.5b", "hf-best-0.5b")]
    assert not (tmp_path / "out" / "report.json").exists()


@pytest.mark.slow
def test_command_2_dry_runs_the_bench_writing_as_it_goes(tmp_path):
    proc = _dry_run("2", tmp_path)
    assert proc.returncode == 0, proc.stderr
    out = tmp_path / "out"
    stages = (out / "stages.txt").read_text()
    assert "timed out" not in stages and "rocktune-1.5b ends: exit status 0" in stages, stages
    rows = json.loads((out / "report.json").read_text())["reports"]["tiny"]["configs"]
    assert [r["name"] for r in rows] == ["rocktune"] and rows[0]["status"] == "ok"
    assert rows[0]["forwards_per_step"] and rows[0]["measured_steps"] == 1  # the dry suite's single step
    assert (out / "summary.txt").read_text().splitlines()[0].startswith("rocktune-1.5b: ok, loss ")
    with tarfile.open(out / "gpu-check.tar.gz") as tar:
        assert "./suite/rocktune-1.5b/results/rocktune-0.json" in tar.getnames()


@pytest.mark.long  # the extra command is outside the 15-minute plan; its dry run compiles a layer
def test_extra_dry_runs_the_explaining_rows_the_loss_and_the_compiled_layer(tmp_path):
    proc = _dry_run("extra", tmp_path)
    assert proc.returncode == 0, proc.stderr
    lines = (tmp_path / "out" / "summary.txt").read_text().splitlines()
    assert [x.split(":", 1)[0] for x in lines] == ["rt-no-compile-0.5b", "rt-liger-0.5b", "profile-loss",
                                                   "compiled-layer", "ratios tiny"], lines
    assert lines[2].startswith("profile-loss: ok") and lines[3].startswith("compiled-layer: ok"), lines
    assert all("SKIPPED" in x and "needs a ROCm/CUDA device" in x for x in lines[:2])  # GPU-only rows on a CPU
    with tarfile.open(tmp_path / "out" / "gpu-check.tar.gz") as tar:
        loss = json.load(tar.extractfile("./profile-loss.json"))
        layers = json.load(tar.extractfile("./compiled-layer.json"))["layers"]
    assert loss["compiled"]["aten_calls_per_chunk"] < loss["eager"]["aten_calls_per_chunk"]
    assert [x["graph_breaks"] for x in layers] == [0, 0] and all(x["forward"]["generated"] > 0 for x in layers)


@pytest.mark.long  # its dry run: the MoE tests collected, the moe suite's tiny shape one step a side (about 1 min)
def test_moe_dry_runs_the_expert_lora_tests_then_the_moe_suite(tmp_path):
    proc = _dry_run("moe", tmp_path)
    assert proc.returncode == 0, proc.stderr
    lines = (tmp_path / "out" / "summary.txt").read_text().splitlines()
    assert [x.split(":", 1)[0] for x in lines] == ["moe-correctness", "moe-bench", "moe tiny-moe"], lines
    assert lines[1].startswith("moe-bench: ok") and "grouped on the routed tokens" in lines[2], lines


@pytest.mark.slow  # its dry run: the doctor's checks, the tests collected, the bench's two rows (about 40 s)
def test_recurrent_dry_runs_the_doctors_self_tests_the_tests_then_rocktune_beside_hf(tmp_path):
    proc = _dry_run("recurrent", tmp_path)
    assert proc.returncode == 0, proc.stderr
    out = tmp_path / "out"
    lines = (out / "summary.txt").read_text().splitlines()
    assert [x.split(":", 1)[0] for x in lines] == ["recurrent-doctor", "recurrent-tests", "recurrent-bench"], lines
    assert proc.stdout.splitlines() == lines
    assert lines[0].startswith("recurrent-doctor: ok, fla ") and \
        "skip (no GPU): gated_deltanet,float32, causal_conv1d,float32, mamba2,float32, " in lines[0], lines[0]
    assert lines[1].startswith("recurrent-tests: ok, ") and " tests collected " in lines[1], lines[1]
    assert lines[2].startswith("recurrent-bench: ok, qwen3.5-tiny-shape on cpu: rocktune ok, loss ") and \
        "; hf-tuned ok, loss " in lines[2] and "; rocktune / hf-tuned: tokens/s " in lines[2], lines[2]
    assert sorted(p.name for p in out.iterdir()) == ["gpu-check.tar.gz", "stages.txt", "summary.txt"]
    with tarfile.open(out / "gpu-check.tar.gz") as tar:
        names = set(tar.getnames())
        doctor = tar.extractfile("./recurrent-doctor.txt").read().decode()
    assert {"./recurrent-tests.txt", "./recurrent-bench.json", "./suite/recurrent-bench/runs/rocktune/metrics.jsonl",
            "./suite/recurrent-bench/runs/hf-tuned/metrics.jsonl"} <= names, names
    assert doctor.count("@@package ") == 3 and doctor.count("@@result ") == 3


@pytest.mark.long  # outside the plan; its dry run trains GRPO on both sides and the VL task (about 2 minutes)
def test_tasks_dry_runs_grpo_beside_trl_and_the_vision_language_task(tmp_path):
    pytest.importorskip("trl", reason="TRL is the test extra's reference for GRPO")
    proc = _dry_run("tasks", tmp_path)
    assert proc.returncode == 0, proc.stderr
    lines = (tmp_path / "out" / "summary.txt").read_text().splitlines()
    assert [x.split(":", 1)[0] for x in lines] == ["grpo-vs-trl", "vlm-learns", "vlm-packed"], lines
    assert all(x.split(": ", 1)[1].startswith("ok") for x in lines), lines
    with tarfile.open(tmp_path / "out" / "gpu-check.tar.gz") as tar:
        # TRL's trainer prints its logs to stdout: the benchmarks' JSON is the last line
        grpo, vlm, packed = (json.loads(tar.extractfile(f"./{n}.json").read().splitlines()[-1])
                             for n in ("grpo-vs-trl", "vlm-learns", "vlm-packed"))
    assert grpo["update_ratio"] > 0 and grpo["rollout_ratio"] > 0, grpo
    assert vlm["valid"] and vlm["eval_loss_last"] < vlm["eval_loss_first"], vlm
    assert packed["valid"] and packed["packing"], packed


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
