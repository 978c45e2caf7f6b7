"""The rollout's per-token pick: rocktune's keyed inverse-CDF draw (``rollout.pick`` with one uniform per row) beside
``torch.multinomial`` over the same softmax (what the rollout drew with before its draws were keyed), for 32 rows at
a tiny and at Qwen2.5's vocabulary. CPU seconds of one thread (``time.thread_time``). Prints one JSON object.

    OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/grpo_sampler_pick.py
"""

from __future__ import annotations

import json
import time

import torch

from rocktune.tasks.grpo.rollout import Sampling, pick

ROWS = 32


def multinomial(logits: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    return torch.multinomial(logits.float().softmax(-1), 1, generator=generator).squeeze(-1)


def per_token_us(fn, calls: int) -> float:
    fn()  # warm-up
    t0 = time.thread_time()
    for _ in range(calls):
        fn()
    return round((time.thread_time() - t0) / calls * 1e6, 1)


def main() -> None:
    torch.set_num_threads(1)
    out = {"rows": ROWS, "threads": 1, "torch": torch.__version__}
    for vocab, calls in ((512, 2000), (151936, 50)):
        logits = torch.randn(ROWS, vocab, generator=torch.Generator().manual_seed(0))
        gen, draws = torch.Generator().manual_seed(0), torch.rand(ROWS, dtype=torch.float64)
        out[f"multinomial_us_per_token_v{vocab}"] = per_token_us(lambda: multinomial(logits, gen), calls)  # noqa: B023
        out[f"keyed_pick_us_per_token_v{vocab}"] = per_token_us(lambda: pick(logits, Sampling(1), draws), calls)  # noqa: B023
    print(json.dumps(out))


if __name__ == "__main__":
    main()
