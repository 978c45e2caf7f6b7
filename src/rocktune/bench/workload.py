"""The benchmark's default model and data, built offline and cached.

The data are prompt/completion records of 50-500 tokens (uniform) with the prompt taking 30-70% of each, so that
padding and the share of loss-bearing positions are what a real SFT set gives, not what flatters one recipe.
"""

from __future__ import annotations

import json
import random
import string
from pathlib import Path

# Random-init model shapes. "tiny" is the CPU default: its 32k vocabulary gives the head the weight it has in real
# models; the Qwen2.5 shapes (config.json values of the released models) are for GPUs.
SHAPES: dict[str, dict] = {
    "tiny": {"vocab_size": 32768, "hidden": 128, "layers": 4, "heads": 4, "kv_heads": 2, "intermediate": 512},
    "qwen2.5-0.5b-shape": {"vocab_size": 151936, "hidden": 896, "layers": 24, "heads": 14, "kv_heads": 2,
                           "intermediate": 4864},
    "qwen2.5-1.5b-shape": {"vocab_size": 151936, "hidden": 1536, "layers": 28, "heads": 12, "kv_heads": 2,
                           "intermediate": 8960},
    # "tiny"'s size with Qwen3.5's hybrid stack (3 Gated DeltaNet layers, then full attention): the CPU ratio of a
    # recurrent model, whose rows rocktune never packs, against the HF Trainer
    "qwen3.5-tiny-shape": {"vocab_size": 32768, "hidden": 128, "layers": 4, "heads": 4, "kv_heads": 2,
                           "intermediate": 512, "arch": "qwen3_5"},
    # not a release: "qwen3.5-tiny-shape" scaled up for a GPU (the GPU check's recurrent part). Qwen3.5-0.8B's hidden
    # size, MLP width, depth, attention and KV heads and vocabulary (its published config.json: planner/presets.json),
    # in tiny_config's head layout: heads hidden / heads = 128 wide (the release: 256), and 2 key / 4 value heads of
    # 128 in the Gated DeltaNet layers (the release: 16 / 16). 0.58B parameters, 0.25B of them the tied embedding.
    "qwen3.5-0.6b-scaled-shape": {"vocab_size": 248320, "hidden": 1024, "layers": 24, "heads": 8, "kv_heads": 2,
                                  "intermediate": 3584, "arch": "qwen3_5"},
}
TOKEN_RANGE = (50, 500)  # the CPU workload; the GPU suite uses 50-2,000


def model_dir(name_or_path: str, cache: Path) -> str:
    """A shape name becomes a cached random-init model directory; anything else is passed through."""
    if name_or_path not in SHAPES:
        return name_or_path
    out = cache / "models" / name_or_path
    if not (out / "config.json").is_file():
        from rocktune.demo.tiny import build_tiny_model

        tmp = out.with_name(out.name + ".tmp")
        build_tiny_model(tmp, seed=0, max_positions=1024, **SHAPES[name_or_path])
        tmp.rename(out)
    return str(out)


def make_records(n: int, seed: int = 0, token_range: tuple[int, int] = TOKEN_RANGE) -> list[dict[str, str]]:
    """Byte-level tokens: one per character, plus the end-of-sequence token the encoder appends."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        total = rng.randint(*token_range) - 1
        n_prompt = int(total * rng.uniform(0.3, 0.7))
        rows.append({"prompt": _text(rng, n_prompt), "completion": _text(rng, total - n_prompt)})
    return rows


def data_file(path: str | None, n: int, cache: Path, seed: int = 0, token_range: tuple[int, int] = TOKEN_RANGE) -> str:
    if path is not None:
        return path
    lo, hi = token_range
    out = cache / (f"bench_data_{n}_{seed}.jsonl" if token_range == TOKEN_RANGE else
                   f"bench_data_{n}_{seed}_{lo}-{hi}.jsonl")
    if not out.is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text("".join(json.dumps(r) + "\n" for r in make_records(n, seed, token_range)), encoding="utf-8")
    return str(out)


def _text(rng: random.Random, n: int) -> str:
    words = []
    size = 0
    while size < n:
        w = "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(1, 9)))
        words.append(w)
        size += len(w) + 1
    return " ".join(words)[:n]
