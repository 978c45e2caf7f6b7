"""The benchmark suites behind docs/benchmarks.md; prints one JSON object (a list of ``rocktune bench`` reports).

    python benchmarks/bench_suite.py cpu    # tiny model (32k vocabulary), fp32, ~10 minutes on 2 cores
    python benchmarks/bench_suite.py gpu    # Qwen2.5-0.5B- and 1.5B-shaped random-init models, bf16 where supported

Each suite is the same `rocktune bench` a user runs; the figures in the docs come from this output.
"""

from __future__ import annotations

import json
import sys

from rocktune.bench.runner import run_bench

SUITES = {
    "cpu": [{"model": "tiny", "steps": 3, "warmup": 1, "rounds": 2, "device": "cpu"}],
    "gpu": [{"model": "qwen2.5-0.5b-shape", "steps": 10, "warmup": 3, "rounds": 1, "device": "cuda"},
            {"model": "qwen2.5-1.5b-shape", "steps": 10, "warmup": 3, "rounds": 1, "device": "cuda"}],
}


def main(suite: str) -> int:
    if suite not in SUITES:
        print(f"usage: bench_suite.py {{{'|'.join(SUITES)}}}", file=sys.stderr)
        return 2
    reports = [run_bench(out=f"runs/bench-{suite}-{i}", log=lambda m: print(m, file=sys.stderr), **kw)
               for i, kw in enumerate(SUITES[suite])]
    print(json.dumps(reports, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "cpu"))
