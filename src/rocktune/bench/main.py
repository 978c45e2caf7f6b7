"""``rocktune bench`` end to end: run, optionally pick and write the fastest, print the table or the JSON."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def run_bench_command(model: str, data: str | None, configs: str | None, steps: int, warmup: int,
                      threads: int | None, device: str, out: str, n_samples: int, parity_steps: int,
                      timeout: float, rounds: int, as_json: bool, pick: bool, write_config: str | None,
                      list_only: bool, suite: str | None = None, nproc: int = 1) -> int:
    from rocktune.bench.configs import CONFIGS

    if list_only:
        for c in CONFIGS.values():
            print(f"{c.name:18} {c.kind:9} {c.description}")
        return 0
    from rocktune.bench import pick as picker
    from rocktune.bench.runner import _device, run_bench

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    if suite is not None:
        from rocktune.bench.suites import run_suite

        device = _device(device)
        # The default model (tiny) means the suite's own shapes on a GPU, and a quick dry run on a CPU.
        result = run_suite(suite, model if model != "tiny" or device == "cpu" else None, device, out, timeout,
                           run_bench, log)
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / "suite.json").write_text(json.dumps(result, indent=1))
        if as_json:
            print(json.dumps(result, indent=1))
        else:
            from rocktune.bench.render import render

            for report in result["reports"].values():
                render(report)
        return 0
    if pick and configs is None:
        configs = picker.candidates(_device(device))
    report = run_bench(model=model, data=data, configs=configs, steps=steps, warmup=warmup, threads=threads,
                       device=device, out=out, n_samples=n_samples, parity_steps=parity_steps, timeout=timeout,
                       rounds=rounds, log=log, nproc=nproc)
    report["command"] = "rocktune " + " ".join(sys.argv[1:]) if sys.argv[0].endswith("rocktune") else None
    if pick:
        best = picker.fastest(report)
        path = write_config or str(Path(out) / "best.yaml")
        picker.write_config(best, report, path, data)
        report["pick"] = {"name": best["name"], "config_file": path}
    Path(out).mkdir(parents=True, exist_ok=True)
    (Path(out) / "report.json").write_text(json.dumps(report, indent=1))
    if as_json:
        print(json.dumps(report, indent=1))
    else:
        from rocktune.bench.render import render

        render(report)
    return 0
