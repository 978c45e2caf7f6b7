"""One training step of a tiny Granite 4 (Mamba2 + attention + MoE) on torch's reference Mamba2 scan, the path
transformers takes without mamba-ssm: transformers' default Mamba2 settings against the matrix fixture's.

    OMP_NUM_THREADS=1 python benchmarks/mamba_reference_scan.py

The reference scan's cost grows with chunk^2 x heads x state whatever the sequence length (a sequence shorter than
the chunk is padded to it), so a config that keeps the defaults (128 heads of width 1 at hidden 64, state 256,
chunk 256) is slow where one with real Granite 4 proportions is not (docs/families.md, the quirks).
"""

from __future__ import annotations

import time

import torch

SHAPE = dict(vocab_size=300, hidden_size=64, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, shared_intermediate_size=64,
             layer_types=["mamba", "mamba", "mamba", "attention"])
MAMBA = {"transformers' defaults": {},
         "matrix fixture": dict(mamba_n_heads=4, mamba_d_state=16, mamba_d_head=32, mamba_chunk_size=16)}


def step_seconds(extra: dict, steps: int = 2) -> float:
    from transformers import AutoModelForCausalLM, GraniteMoeHybridConfig

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(GraniteMoeHybridConfig(**SHAPE, **extra))
    ids = torch.randint(0, 300, (8, 96))
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        model(ids, labels=ids).loss.backward()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    for name, extra in MAMBA.items():
        print(f"{name}: {step_seconds(extra):.2f} s per forward+backward (8 x 96 tokens)")


if __name__ == "__main__":
    main()
