"""Memory of the launching process's check of a JSONL data file larger than the whole-file limit (64 MiB): the file
is streamed line by line (``data/records.py:scan_jsonl``), so the peak is bounded by the longest line, not the file.
Prints one JSON object: the file's size, the peak of Python allocations during the check (tracemalloc), the growth
of the process's peak RSS across it, the time, and whether the error names the torn line as file:line.

    PYTHONPATH=src python benchmarks/precheck_memory.py [--mib 65] [--line-bytes 1000]
"""

from __future__ import annotations

import argparse
import json
import resource
import tempfile
import time
import tracemalloc
from pathlib import Path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=float, default=65.0, help="size of the generated file")
    ap.add_argument("--line-bytes", type=int, default=1000, help="about how long each record's line is")
    args = ap.parse_args()

    from rocktune.config import config_from_dict
    from rocktune.errors import UserError
    from rocktune.tasks import precheck

    fill = max(args.line_bytes - 40, 1) // 4
    line = json.dumps({"prompt": "q " * fill, "completion": "a " * fill}) + "\n"
    with tempfile.TemporaryDirectory(prefix="rocktune-precheck-") as tmp:
        path = Path(tmp) / "train.jsonl"
        n = int(args.mib * 2**20) // len(line) + 1
        torn = n - 10  # near the end: the whole file is read before the error
        with open(path, "w") as f:
            for i in range(1, n + 1):
                f.write(line if i != torn else line[:40] + "\n")
        (Path(tmp) / "model").mkdir()
        cfg = config_from_dict({"model": {"name_or_path": str(Path(tmp) / "model")},
                                "data": {"train_file": str(path)}, "output": {"dir": str(Path(tmp) / "run")}})
        rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        tracemalloc.start()
        t0 = time.perf_counter()
        try:
            precheck(cfg)
            message = ""
        except UserError as exc:
            message = str(exc)
        seconds = time.perf_counter() - t0
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        rss_after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        print(json.dumps({"file_mib": round(path.stat().st_size / 2**20, 2), "lines": n, "line_bytes": len(line),
                          "peak_python_alloc_kib": round(peak / 1024, 1),
                          "peak_rss_growth_kib": rss_after - rss_before,  # ru_maxrss is KiB on Linux
                          "seconds_with_tracemalloc": round(seconds, 2),
                          "names_the_torn_line": f"{path}:{torn}:" in message}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
