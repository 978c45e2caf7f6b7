"""``rocktune bench --suite moe``: rocktune's expert LoRA (rocktune.lora.moe: the routed tokens only) against HF +
PEFT's ``target_parameters`` step on the same MoE shapes, random init, same batch, seed, LoRA and optimizer.

Each side runs in a fresh interpreter (bench/moe_step.py), one after the other and in alternating order over
rounds, so neither inherits the other's allocator or caches and a drift in the machine's load favours neither. The
figures: useful (loss-bearing) tokens per second from the median measured step, the process's peak memory (the
allocator's on a GPU, the resident set's on a CPU) and the peak above the loaded model, each as a ratio to the HF +
PEFT side; the losses of both sides, which must agree (a speed counts only where the same training happened).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from rocktune.bench.moe_step import SHAPES

SIDES = ("rocktune", "hf-peft")
# Tokens per step (rows x length): small on a CPU so that one layer of the real shape runs in a minute a side.
TOKENS = {"cpu": {"tiny-moe": (4, 64), "qwen3-30b-a3b-layer": (2, 64)},
          "cuda": {"tiny-moe": (8, 256), "qwen3-30b-a3b-layer": (4, 1024)}}
GOAL = {"tokens_per_s": 3.0, "peak": 0.5}  # issue 54: at least 3x the speed, at most half the peak
LOSS_TOLERANCE = 5e-3  # bf16 (rocktune.lora.check.TOLERANCE["bf16"]["loss"])


def run_side(spec: dict, timeout: float, threads: int | None) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        spec_file, result_file = Path(tmp) / "spec.json", Path(tmp) / "result.json"
        spec_file.write_text(json.dumps(spec))
        env = dict(os.environ)
        if threads:
            env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
        try:
            proc = subprocess.run([sys.executable, "-m", "rocktune.bench.moe_step", str(spec_file), str(result_file)],
                                  env=env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return {"status": "error", "side": spec["side"], "reason": f"timed out after {timeout:.0f} s"}
        if not result_file.is_file():  # killed (e.g. out of memory) before it could write
            tail = (proc.stderr or "").strip().splitlines()[-1:] or [f"exit status {proc.returncode}"]
            return {"status": "error", "side": spec["side"], "reason": tail[0]}
        return json.loads(result_file.read_text())


def compare(rt: dict, hf: dict) -> dict:
    """Ratios of rocktune's side to HF + PEFT's, and whether the two trained alike."""
    if rt.get("status") != "ok" or hf.get("status") != "ok":
        return {"valid": False, "reason": rt.get("reason") or hf.get("reason")}
    worst = max(abs(a - b) / max(abs(b), 1.0) for a, b in zip(rt["losses"], hf["losses"]))
    fell = rt["losses"][-1] < rt["losses"][0] and hf["losses"][-1] < hf["losses"][0]
    above_rt, above_hf = rt["peak_bytes"] - rt["model_bytes"], hf["peak_bytes"] - hf["model_bytes"]
    ratios = {"tokens_per_s": rt["tokens_per_s"] / hf["tokens_per_s"], "peak": rt["peak_bytes"] / hf["peak_bytes"],
              "peak_above_model": above_rt / above_hf if above_hf > 0 else None}
    return {"valid": worst <= LOSS_TOLERANCE and fell, "loss_max_rel_diff": worst, "loss_fell": fell, **ratios,
            "goal_met": {k: (ratios[k] >= v if k == "tokens_per_s" else ratios[k] <= v) for k, v in GOAL.items()}}


def run_moe_bench(req, log=print) -> dict:
    """``req``: bench/runner.BenchRequest (device, steps, warmup, rounds, timeout, threads; ``model``: one shape of
    SHAPES, else both)."""
    from rocktune.platform.environment import resolve_device

    device = resolve_device(req.device)
    kind = "cuda" if device.startswith("cuda") else "cpu"
    shapes = [req.model] if req.model in SHAPES else list(SHAPES)
    report: dict = {"schema": "rocktune-bench-moe/1", "device": device, "precision": "bf16", "goal": GOAL,
                    "shapes": {}}
    for shape in shapes:
        spec = {"shape": shape, "device": device, "precision": "bf16", "tokens": TOKENS[kind][shape],
                "warmup": req.warmup, "steps": req.steps, "seed": 0}
        runs: dict[str, list[dict]] = {s: [] for s in SIDES}
        for rnd in range(req.rounds):
            for side in SIDES[:: 1 if rnd % 2 == 0 else -1]:
                log(f"bench moe: {shape} {side} ({req.warmup} warm-up + {req.steps} measured steps, round "
                    f"{rnd + 1}/{req.rounds})")
                runs[side].append(run_side({**spec, "side": side}, req.timeout, req.threads))
        best = {s: _fastest(r) for s, r in runs.items()}
        report["shapes"][shape] = {"config": SHAPES[shape], "tokens": spec["tokens"], **best,
                                   "vs_hf_peft": compare(best["rocktune"], best["hf-peft"])}
        log(f"bench moe: {shape}: {json.dumps(report['shapes'][shape]['vs_hf_peft'])}")
    return report


def _fastest(results: list[dict]) -> dict:
    """The round with the best median step (the machine's load only ever slows a side down)."""
    ok = [r for r in results if r.get("status") == "ok"]
    return min(ok, key=lambda r: r["step_s"]) if ok else results[0]


def summary(report: dict) -> str:
    """One line per shape: the ratios against HF + PEFT, for gpu_check.sh's summary."""
    lines = []
    for shape, row in report["shapes"].items():
        v = row["vs_hf_peft"]
        if "tokens_per_s" not in v:
            lines.append(f"moe {shape}: INVALID ({v.get('reason')})")
            continue
        verdict = "" if v["valid"] else "INVALID (the losses differ or did not fall) "
        lines.append(f"moe {shape}: {verdict}tokens/s x{v['tokens_per_s']:.2f} (goal >= {GOAL['tokens_per_s']}), "
                     f"peak x{v['peak']:.2f} (goal <= {GOAL['peak']}), above the model x{v['peak_above_model']:.2f}; "
                     f"losses within {v['loss_max_rel_diff']:.1e}; {row['rocktune'].get('path', '')}")
    return "\n".join(lines)


if __name__ == "__main__":  # python -m rocktune.bench.moe REPORT.json: the summary lines
    print(summary(json.loads(Path(sys.argv[1]).read_text())))
