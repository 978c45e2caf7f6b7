"""Child process that runs the checks: ``python -m rocktune.doctor.child DEVICE '["name", ...]'``.

It prints ``@@start NAME`` before each check and ``@@result {json}`` after it, flushing each line, so the parent
knows which check was running if the process dies (a "Memory access fault by GPU node" aborts the process).
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import asdict


def main(argv: list[str]) -> int:
    device, names = argv[0], json.loads(argv[1])
    from rocktune.doctor.registry import faults_from_env, plan, run_one

    if device.startswith("cuda"):
        import torch

        # matmul checks compare true fp32; TF32 would need a looser tolerance and hide real errors
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    faults = faults_from_env()
    checks = dict(plan(device, faults))
    for name in names:
        print(f"@@start {name}", flush=True)
        if faults.get("crash") == name:  # test hook: behave like a hard GPU fault (without a core file)
            _no_core_file()
            os.abort()
        if name not in checks:
            print("@@result " + json.dumps({"name": name, "status": "skip", "detail": "not applicable here"}),
                  flush=True)
            continue
        result = run_one(name, checks[name])
        print("@@result " + json.dumps(asdict(result), default=str), flush=True)
    return 0


def _no_core_file() -> None:
    try:
        import resource

        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    except (ImportError, ValueError, OSError):
        pass  # Windows has no core files to suppress


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
