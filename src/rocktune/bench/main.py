"""``rocktune bench`` end to end: run, optionally pick and write the fastest, print the table or the JSON."""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

from rocktune.bench.runner import BenchRequest


def run_bench_command(req: BenchRequest, as_json: bool, pick: bool, write_config: str | None, list_only: bool,
                      suite: str | None = None) -> int:
    from rocktune.bench.configs import CONFIGS

    if list_only:
        for c in CONFIGS.values():
            print(f"{c.name:18} {c.kind:9} {c.description}")
        return 0
    from rocktune.bench import pick as picker
    from rocktune.bench.runner import run_bench
    from rocktune.platform.environment import resolve_device

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    if suite == "vlm":
        from rocktune.tasks.vlm.bench.vlm import run_vlm_bench

        return _reported(run_vlm_bench(req, log), req.out, as_json)
    if suite == "moe":
        from rocktune.bench.moe import run_moe_bench

        result = run_moe_bench(req, log)
        Path(req.out).mkdir(parents=True, exist_ok=True)
        (Path(req.out) / "report.json").write_text(json.dumps(result, indent=1))
        print(json.dumps(result, indent=1) if as_json else
              "\n".join(f"{shape}: {json.dumps(v['vs_hf_peft'])}" for shape, v in result["shapes"].items()))
        return 0
    if suite is not None:
        from rocktune.bench.suites import run_suite

        device = resolve_device(req.device)
        # The default model (tiny) means the suite's own shapes on a GPU, and a quick dry run on a CPU.
        result = run_suite(suite, req.model if req.model != "tiny" or device == "cpu" else None, device, req.out,
                           req.timeout, run_bench, log, req.configs)
        Path(req.out).mkdir(parents=True, exist_ok=True)
        (Path(req.out) / "suite.json").write_text(json.dumps(result, indent=1))
        if as_json:
            print(json.dumps(result, indent=1))
        else:
            from rocktune.bench.render import render

            for report in result["reports"].values():
                render(report)
        return 0
    if pick and req.configs is None:
        req = replace(req, configs=picker.candidates(resolve_device(req.device)))
    report = run_bench(req, log)
    out = req.out
    report["command"] = "rocktune " + " ".join(sys.argv[1:]) if sys.argv[0].endswith("rocktune") else None
    if pick:
        best = picker.fastest(report)
        path = write_config or str(Path(out) / "best.yaml")
        picker.write_config(best, report, path, req.data)
        report["pick"] = {"name": best["name"], "config_file": path}
    return _reported(report, out, as_json)


def _reported(report: dict, out: str, as_json: bool) -> int:
    Path(out).mkdir(parents=True, exist_ok=True)
    (Path(out) / "report.json").write_text(json.dumps(report, indent=1))
    if as_json:
        print(json.dumps(report, indent=1))
    else:
        from rocktune.bench.render import render

        render(report)
    return 0
