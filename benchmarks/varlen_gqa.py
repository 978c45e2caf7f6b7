"""Does this device's varlen kernel take grouped K/V as they are? Both calls of rocktune's varlen self-test (14 query
heads over 2 K/V heads, forward and backward against fp32 math attention): K/V un-repeated and K/V repeated per query
head, in each half precision, and what the glue then does (``attention.self_test``: un-repeated where proven).
Prints JSON. On a CPU (the GPU check's dry run) the compiler-opaque stand-ins with torch 2.11's and 2.13's signatures
replace torch's CUDA-only kernel, in fp32.

    python benchmarks/varlen_gqa.py --device cuda
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def calls(device: str, dtype, kernel) -> dict:
    from rocktune.kernels import attention as A

    args = A.KernelArgs.of(kernel)
    both = {"un-repeated": A.self_test_call(device, dtype, kernel, grouped_kv=True)}
    if not args.gqa:
        both["repeated"] = A.self_test_call(device, dtype, kernel, grouped_kv=False)
    chosen = A.self_test(device, dtype, kernel)
    return {"takes_enable_gqa": args.gqa,
            **{name: {"ok": r.ok, "error": r.error, "detail": r.detail} for name, r in both.items()},
            "glue": {"ok": chosen.ok, "grouped_kv_un_repeated": chosen.grouped_kv, "detail": chosen.detail}}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    device = p.parse_args(argv).device
    import torch

    from rocktune.kernels import attention as A

    out: dict = {"torch": torch.__version__, "device": device, "heads": list(A.SELF_TEST_HEADS), "kernels": {}}
    if device == "cpu":  # the stand-ins live with the tests
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        from tests.varlen_standin import opaque_varlen, opaque_varlen_2_11

        out["note"] = "CPU: compiler-opaque stand-ins for torch's CUDA-only kernel, fp32"
        for name, kernel in (("stand-in 2.11 signature", opaque_varlen_2_11), ("stand-in 2.13 signature",
                                                                                opaque_varlen)):
            out["kernels"][name] = {"float32": calls("cpu", torch.float32, kernel)}
    elif A.varlen_kernel() is None:
        out["note"] = f"torch {torch.__version__} has no torch.nn.attention.varlen (>= 2.10)"
    else:
        out["kernels"]["torch.nn.attention.varlen.varlen_attn"] = {
            str(dt).removeprefix("torch."): calls(device, dt, A.varlen_kernel())
            for dt in (torch.bfloat16, torch.float16)}
    print(json.dumps(out, indent=1))
    glue = [d["glue"]["ok"] for k in out["kernels"].values() for d in k.values()]
    return 0 if glue and all(glue) else 1


if __name__ == "__main__":
    sys.exit(main())
