"""One decoder layer with rocktune's LoRA adapters under Inductor: graphs, graph breaks, recompiles and the kernels
in Inductor's output code (rocktune/bench/layer_code.py). Prints JSON.

    python benchmarks/compiled_layer.py                      # CPU: C++ kernels, varlen attention's CPU stand-in
    python benchmarks/compiled_layer.py --device cuda        # GPU: Triton kernels, torch's varlen kernel

Each family's layer (a tiny Qwen2 and Llama config, LoRA on every linear) runs a forward and backward at each
``--widths`` (one packed row of two documents, bounds padded to a fixed length); the kernels are those of the first
width's forward and backward, and the later widths show what a new width recompiles (Dynamo's automatic dynamic
shapes: one symbolic graph after the second width). tests/test_compiled_layer.py bounds the CPU figures.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--widths", default="256,256,384,512", help="tokens per call, comma-separated")
    ap.add_argument("--families", default="qwen2,llama")
    args = ap.parse_args(argv)
    from rocktune.bench.layer_code import LayerCase, compiled_layer_code

    kernel = None
    if args.device == "cpu":  # the varlen kernel's compiler-opaque stand-in lives with the tests
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        from tests.varlen_standin import opaque_varlen as kernel
    widths = tuple(int(w) for w in args.widths.split(","))
    out = [compiled_layer_code(LayerCase(f, widths, args.device), kernel) for f in args.families.split(",")]
    print(json.dumps({"schema": "rocktune-compiled-layer/1", "layers": out}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
