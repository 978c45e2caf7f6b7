"""Learned figures under the CPU kernels torch can be told to use: do they hold on every CPU?

A figure a test asserts after training (a loss, an exact-match rate, greedy tokens) is the product of thousands of
matmuls whose rounding depends on the kernel the CPU's instruction set selects: ATen's vectorised kernels
(ATEN_CPU_CAPABILITY), oneDNN's (ONEDNN_MAX_CPU_ISA), MKL's GEMMs (MKL_ENABLE_INSTRUCTIONS) and the thread count (the
order of a parallel reduction). CI machines differ (Intel Xeon with AMX, AMD EPYC without), so each variant below
stands in for another machine. Every variant runs in a fresh child process, since all four are read at start-up.

    python benchmarks/cpu_variants.py demo                      # rocktune demo --json per variant, and the spread
    python benchmarks/cpu_variants.py pytest tests/test_train.py::test_losses_match_recorded_values ...

Prints one JSON object: per variant its environment, the demo's figures (or pytest's outcome and the failing
asserts), and for the demo the min/max of each figure over the variants.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# name -> environment added to this process's. "native" is what this CPU picks by itself.
VARIANTS: dict[str, dict[str, str]] = {
    "native": {},
    "aten-default": {"ATEN_CPU_CAPABILITY": "default"},
    "aten-avx2": {"ATEN_CPU_CAPABILITY": "avx2"},
    "aten-avx512": {"ATEN_CPU_CAPABILITY": "avx512"},
    "onednn-avx2": {"ONEDNN_MAX_CPU_ISA": "AVX2"},
    "mkl-avx2": {"MKL_ENABLE_INSTRUCTIONS": "AVX2"},
    "mkl-sse42": {"MKL_ENABLE_INSTRUCTIONS": "SSE4_2"},
    "all-avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"},
    "all-oldest": {"ATEN_CPU_CAPABILITY": "default", "ONEDNN_MAX_CPU_ISA": "SSE41",
                   "MKL_ENABLE_INSTRUCTIONS": "SSE4_2"},
    "threads-1": {"OMP_NUM_THREADS": "1"},
    "threads-2": {"OMP_NUM_THREADS": "2"},
    "threads-4": {"OMP_NUM_THREADS": "4"},
}
DEMO_FIGURES = ("eval_loss_before", "eval_loss_after", "exact_match")


def run_demo(env: dict[str, str], steps: int | None) -> dict:
    with tempfile.TemporaryDirectory(prefix="rocktune-variant-") as tmp:
        cmd = [sys.executable, "-m", "rocktune", "demo", "--json", "--out", str(Path(tmp) / "demo")]
        cmd += ["--steps", str(steps)] if steps else []
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, env={**os.environ, **env}, capture_output=True, text=True, cwd=ROOT)
        wall = round(time.perf_counter() - t0, 1)
    if proc.returncode != 0:
        return {"exit": proc.returncode, "stderr_tail": proc.stderr[-2000:], "wall_s": wall}
    fig = json.loads(proc.stdout.strip().splitlines()[-1])
    keep = (*DEMO_FIGURES, "exact_match_by_skill", "train_seconds", "steps")
    return {"exit": 0, "wall_s": wall, **{k: fig[k] for k in keep if k in fig}}


def run_pytest(env: dict[str, str], nodes: list[str]) -> dict:
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfE", *nodes]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env={**os.environ, **env}, capture_output=True, text=True, cwd=ROOT)
    lines = proc.stdout.strip().splitlines()
    failed = [x for x in lines if x.startswith(("FAILED", "ERROR"))]
    return {"exit": proc.returncode, "summary": lines[-1] if lines else "", "failed": failed,
            "wall_s": round(time.perf_counter() - t0, 1)}


def spread(rows: dict[str, dict]) -> dict:
    ok = [r for r in rows.values() if r.get("exit") == 0]
    return {k: {"min": min(r[k] for r in ok), "max": max(r[k] for r in ok)} for k in DEMO_FIGURES if ok}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=("demo", "pytest"))
    ap.add_argument("nodes", nargs="*", help="pytest node ids (with `pytest`)")
    ap.add_argument("--variants", default=",".join(VARIANTS), help="comma list of: " + ", ".join(VARIANTS))
    ap.add_argument("--steps", type=int, default=None, help="demo: optimizer steps (default: the demo's own)")
    ap.add_argument("--marker", default=None, help="pytest: run with -m MARKER (e.g. real_model, llama_cpp)")
    args = ap.parse_intermixed_args(argv)  # options may come between the node ids
    names = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        ap.error(f"unknown variant(s) {', '.join(unknown)}; choose from {', '.join(VARIANTS)}")
    if args.what == "pytest" and not args.nodes:
        ap.error("pytest needs the test node ids to run")
    rows: dict[str, dict] = {}
    for name in names:
        env = VARIANTS[name]
        nodes = [*args.nodes, *(["-m", args.marker] if args.marker else [])]
        rows[name] = {"env": env, **(run_demo(env, args.steps) if args.what == "demo" else run_pytest(env, nodes))}
        print(f"{name}: {json.dumps(rows[name])}", file=sys.stderr, flush=True)
    import platform

    from rocktune.bench.measure import cpu_name

    out = {"what": args.what, "nodes": args.nodes, "cpu": cpu_name(), "machine": platform.machine(),
           "variants": rows}
    if args.what == "demo":
        out["spread"] = spread(rows)
    print(json.dumps(out, indent=1))
    return 0 if all(r["exit"] == 0 for r in rows.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
