"""AdamW's step over a LoRA adapter on the CPU: torch's fused kernel against foreach (what ``training.optimizer:
auto`` took on a CPU before) and the per-parameter loop, alternately. Prints one JSON object: milliseconds per step
(main thread's CPU seconds, ``time.thread_time``) for each, two passes each.

    python benchmarks/adamw_cpu.py [--layers 24 --hidden 896 --intermediate 4864 --kv 128 --r 16] [--steps 20]

The defaults are a 0.5B Qwen2's shapes (q, k, v, o, gate, up, down adapted); the GRPO bench's tiny model is
``--layers 2 --hidden 128 --intermediate 352 --kv 64 --steps 200``.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

FLAGS = {"fused": {"fused": True}, "foreach": {"foreach": True}, "loop": {"foreach": False}}


def shapes(a) -> list[tuple[int, int]]:
    linears = [(a.hidden, a.hidden), (a.hidden, a.kv), (a.hidden, a.kv), (a.hidden, a.hidden),
               (a.hidden, a.intermediate), (a.hidden, a.intermediate), (a.intermediate, a.hidden)]
    return [s for _ in range(a.layers) for i, o in linears for s in ((a.r, i), (o, a.r))]


def per_step_ms(kind: str, sizes, steps: int) -> float:
    params = [torch.nn.Parameter(torch.randn(s)) for s in sizes]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW(params, lr=1e-3, **FLAGS[kind])
    for _ in range(3):
        opt.step()
    t0 = time.thread_time()
    for _ in range(steps):
        opt.step()
    return round((time.thread_time() - t0) / steps * 1e3, 3)


def main() -> None:
    ap = argparse.ArgumentParser()
    for name, default in (("layers", 24), ("hidden", 896), ("intermediate", 4864), ("kv", 128), ("r", 16),
                          ("steps", 20)):
        ap.add_argument(f"--{name}", type=int, default=default)
    a = ap.parse_args()
    torch.set_num_threads(1)
    sizes = shapes(a)
    out: dict[str, list[float]] = {k: [] for k in FLAGS}
    for _ in range(2):
        for kind in FLAGS:
            out[kind].append(per_step_ms(kind, sizes, a.steps))
    print(json.dumps({"tensors": len(sizes), "parameters": sum(x * y for x, y in sizes), "ms_per_step": out}))


if __name__ == "__main__":
    main()
