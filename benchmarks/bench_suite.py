"""The benchmark suites behind docs/benchmarks.md; prints one JSON object (a list of ``rocktune bench`` reports).

    python benchmarks/bench_suite.py cpu    # tiny model (32k vocabulary), fp32, ~10 minutes on 2 cores
    python benchmarks/bench_suite.py gpu    # = rocktune bench --suite gpu: both Qwen2.5 shapes, 64 x 50-2,000 tokens

Each suite is the same `rocktune bench` a user runs; the figures in the docs come from this output.
"""

from __future__ import annotations

import json
import sys

from rocktune.bench.runner import BenchRequest, run_bench

SUITES = {
    "cpu": [{"model": "tiny", "steps": 3, "warmup": 1, "rounds": 2, "device": "cpu"}],
}


def main(suite: str) -> int:
    if suite == "gpu":  # one definition of the GPU suite: rocktune.bench.suites
        from rocktune.bench.suites import run_suite

        result = run_suite("gpu", None, "cuda", "runs/bench-gpu", 1800.0, run_bench,
                           lambda m: print(m, file=sys.stderr))
        print(json.dumps(list(result["reports"].values()), indent=1))
        return 0
    if suite not in SUITES:
        print("usage: bench_suite.py {cpu|gpu}", file=sys.stderr)
        return 2
    reports = [run_bench(BenchRequest(out=f"runs/bench-{suite}-{i}", **kw), lambda m: print(m, file=sys.stderr))
               for i, kw in enumerate(SUITES[suite])]
    print(json.dumps(reports, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "cpu"))
