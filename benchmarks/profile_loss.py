"""The chunked loss alone, eager against compiled: ATen ops per chunk (torch.profiler) and time per chunk.

    python benchmarks/profile_loss.py                                   # Qwen2.5-0.5B's head, 1,024 rows, fp32
    python benchmarks/profile_loss.py --dtype bf16 --device cuda --chunk 2048 --rows 8192

Runs ``LinearCrossEntropy`` (loss and d/dh, as in a training step) over ``--rows`` random hidden states with a random
``--vocab`` x ``--hidden`` head, chunk by chunk, once with the eager chunk body and once with the compiled one
(tasks/causal/loss.py). Each is warmed up first (the compiled one compiles there, ragged last chunk included), then one
pass is profiled for its op counts; then ``--repeat`` passes of each are timed, alternating. Prints JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="fp32", choices=("fp32", "bf16", "fp16"))
    ap.add_argument("--rows", type=int, default=1024)
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=151_936)
    ap.add_argument("--hidden", type=int, default=896)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args(argv)

    import torch
    from torch.profiler import ProfilerActivity, profile

    from rocktune.models.load import DTYPES
    from rocktune.tasks.causal.loss import LinearCrossEntropy, compiled_chunk, eager_chunk

    dtype = DTYPES[args.dtype]
    g = torch.Generator().manual_seed(0)
    weight = (torch.randn(args.vocab, args.hidden, generator=g) * 0.02).to(args.device, dtype)
    hidden = torch.randn(args.rows, args.hidden, generator=g).to(args.device, dtype).requires_grad_()
    targets = torch.randint(0, args.vocab, (args.rows,), generator=g).to(args.device)
    chunks = -(-args.rows // args.chunk)

    def sync():
        if args.device == "cuda":
            torch.cuda.synchronize()

    def one_pass(body):
        LinearCrossEntropy.apply(hidden, weight, None, targets, args.chunk, body)
        sync()

    result = {"device": args.device, "dtype": args.dtype, "rows": args.rows, "chunk": args.chunk, "chunks": chunks,
              "vocab": args.vocab, "hidden": args.hidden, "threads": torch.get_num_threads(),
              "load_average": os.getloadavg()[0]}
    bodies = {"eager": eager_chunk, "compiled": compiled_chunk()}
    for name, body in bodies.items():
        t0 = time.perf_counter()
        one_pass(body)
        ragged = args.chunk // 2 + 1
        LinearCrossEntropy.apply(hidden[:ragged], weight, None, targets[:ragged], args.chunk, body)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device == "cuda" else [])
        with profile(activities=activities) as prof:
            one_pass(body)
        aten = [e for e in prof.key_averages() if e.key.startswith("aten::")]
        result[name] = {"aten_calls_per_chunk": round(sum(e.count for e in aten) / chunks, 1),
                        "ops_per_chunk": {e.key: round(e.count / chunks, 1)
                                          for e in sorted(aten, key=lambda e: -e.count)[:12]},
                        "warm_up_s": round(time.perf_counter() - t0, 2)}
    # Timed passes alternate between the bodies, so that load from elsewhere on a shared machine hits both alike.
    times = {name: [] for name in bodies}
    for _ in range(args.repeat):
        for name, body in bodies.items():
            t0 = time.perf_counter()
            one_pass(body)
            times[name].append(1e3 * (time.perf_counter() - t0) / chunks)
    for name, ms in times.items():
        result[name].update(ms_per_chunk_median=round(statistics.median(ms), 1), ms_per_chunk_min=round(min(ms), 1))
    result["load_average_after"] = os.getloadavg()[0]
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
