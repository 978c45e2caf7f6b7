"""The LoRA side paths (PEFT's own forward, rocktune's lean one, the fused one) compared on the CPU: ops per adapted
linear, forward + backward time, and the losses of a real run (docs/speed.md section 6).

    python benchmarks/lean_lora_parity.py --steps 50 --ops --time

``--ops``: aten ops per adapted linear, forward and backward, counted with a ``TorchDispatchMode`` on a block of
q/k/v projections (one input, as in attention) and on a lone projection, fp32 and bf16-under-autocast (bf16 base as
on a GPU); ``kernels`` leaves out views and allocations, which launch nothing. Counted at steady state (the fused
path's adapter casts are made once per optimizer step; ``step_start_extra`` is what the first call of a step adds).
``--time``: forward + backward seconds (minimum and median) of the q/k/v and gate/up blocks at the Qwen2.5-0.5B
shape (hidden 896, 2 K/V heads of 64, MLP 4,864, r 16), 512 tokens. ``--steps N``: the tiny random Qwen2 of the
test suite trained on the demo task's 256 examples (fp32, CPU, 8 x 2 per step) with each path; the largest
relative loss difference per step against the lean path.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

MODES = ("peft", "lean", "fused")
# allocations and reshapes that PyTorch does not mark as views: no kernel
FREE = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "_unsafe_view"}


class _Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func] += 1
        return func(*args, **(kwargs or {}))


def _summary(counter: Counter, per: int) -> dict:
    kernels = sum(n for f, n in counter.items() if not f.is_view and f._opname not in FREE)
    return {"ops": sum(counter.values()) / per, "kernels": kernels / per,
            "by_op": {f"{f._opname}": n for f, n in sorted(counter.items(), key=lambda kv: str(kv[0]))}}


class Block(torch.nn.Module):
    """Projections that read one input, as a decoder layer calls them: ``names`` of widths ``outs``."""

    def __init__(self, hidden: int, names: tuple[str, ...], outs: tuple[int, ...]):
        super().__init__()
        self.names = names
        for n, o in zip(names, outs):
            setattr(self, n, torch.nn.Linear(hidden, o, bias=n in ("q_proj", "k_proj", "v_proj")))

    def forward(self, x):
        return tuple(getattr(self, n)(x) for n in self.names)


def block(mode: str, hidden: int, names, outs, r: int = 8, dtype=torch.float32):
    from peft import LoraConfig, get_peft_model

    from rocktune.lora.lean import lean_lora

    torch.manual_seed(0)
    model = get_peft_model(Block(hidden, names, outs).to(dtype), LoraConfig(r=r, lora_alpha=2 * r,
                                                                           target_modules=list(names)))
    for n, p in model.named_parameters():
        if "lora_B" in n:
            torch.nn.init.normal_(p, std=0.05)
    if mode != "peft":
        lean_lora(model, fused=mode == "fused")
    return model


def _fwd_bwd(model, x, autocast: bool, count: tuple[_Count, _Count] | None = None):
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        if count:
            with count[0]:
                ys = model(x)
        else:
            ys = model(x)
    grads = [torch.ones_like(y) for y in ys]
    if count:
        with count[1]:
            torch.autograd.backward(ys, grads)
    else:
        torch.autograd.backward(ys, grads)
    model.zero_grad(set_to_none=True)
    x.grad = None


def count_ops(mode: str, names=("q_proj", "k_proj", "v_proj"), precision: str = "bf16") -> dict:
    """Aten ops per adapted linear of one forward and one backward, steady state (after a warm-up call)."""
    outs = {"q_proj": 64, "k_proj": 16, "v_proj": 16, "o_proj": 64, "gate_proj": 128, "up_proj": 128}
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    model = block(mode, 64, names, tuple(outs[n] for n in names), dtype=dtype)
    x = torch.randn(2, 16, 64, dtype=dtype, requires_grad=True)
    autocast = precision == "bf16"
    _fwd_bwd(model, x, autocast)
    fwd, bwd = _Count(), _Count()
    _fwd_bwd(model, x, autocast, (fwd, bwd))
    with torch.no_grad():  # an optimizer step: the adapter weights change, the fused path recasts them once
        for p in model.parameters():
            if p.requires_grad:
                p.add_(0.0)
    first = _Count(), _Count()
    _fwd_bwd(model, x, autocast, first)
    n = len(names)
    extra = sum(first[0].ops.values()) - sum(fwd.ops.values())
    return {"forward": _summary(fwd.ops, n), "backward": _summary(bwd.ops, n), "step_start_extra": extra / n}


def all_op_counts() -> dict:
    return {f"{precision}/{'+'.join(names)}/{mode}": count_ops(mode, names, precision)
            for precision in ("fp32", "bf16") for names in (("q_proj", "k_proj", "v_proj"), ("o_proj",))
            for mode in MODES}


def time_blocks(repeats: int = 9, tokens: int = 512) -> dict:
    """Seconds per forward + backward: the minimum and the median of ``repeats``, the three paths taken in turn
    within each repeat, so that a load that comes and goes on a shared machine falls on all three alike."""
    out = {}
    shapes = {"qkv": (("q_proj", "k_proj", "v_proj"), (896, 128, 128)), "gate_up": (("gate_proj", "up_proj"),
                                                                                    (4864, 4864))}
    for precision in ("fp32", "bf16"):
        dtype = torch.bfloat16 if precision == "bf16" else torch.float32
        for shape, (names, outs) in shapes.items():
            models = {mode: block(mode, 896, names, outs, r=16, dtype=dtype) for mode in MODES}
            x = torch.randn(1, tokens, 896, dtype=dtype, requires_grad=True)
            times = {mode: [] for mode in MODES}
            for i in range(repeats + 1):
                for mode, model in models.items():
                    t0 = time.perf_counter()
                    _fwd_bwd(model, x, precision == "bf16")
                    if i:  # the first round warms up
                        times[mode].append(time.perf_counter() - t0)
            for mode in MODES:
                out[f"{precision}/{shape}/{mode}"] = {"min": round(min(times[mode]), 5),
                                                      "median": round(statistics.median(times[mode]), 5)}
    return out


def train_losses(steps: int) -> dict:
    from rocktune.config import config_from_dict
    from rocktune.demo.task import make_task
    from rocktune.demo.tiny import build_tiny_model
    from rocktune.lora.lean import lean_lora
    from rocktune.tasks import train
    from rocktune.tasks.causal import build

    tmp = Path(tempfile.mkdtemp(prefix="rt-lean-"))
    model_dir = build_tiny_model(tmp / "model", seed=0, hidden=64, layers=2, heads=4, kv_heads=2)
    train_file = tmp / "train.jsonl"
    train_file.write_text("".join(json.dumps(r) + "\n" for r in make_task(n_train=256, n_eval=16, seed=1)[0]))
    patches = {"peft": lambda model: None, "lean": functools.partial(lean_lora, fused=False),
               "fused": functools.partial(lean_lora, fused=True)}
    losses = {}
    for mode, patch in patches.items():
        build.lean_lora = patch  # the one switch: model_with_adapter calls it after PEFT wraps the base
        raw = {"model": {"name_or_path": str(model_dir)}, "lora": {"r": 8, "alpha": 16},
               "data": {"train_file": str(train_file), "eval_fraction": 0.0, "max_length": 64,
                        "cache_dir": str(tmp / "cache")},
               "training": {"max_steps": steps, "micro_batch_size": 8, "grad_accum": 2, "lr": 3e-3,
                            "warmup_steps": 5, "eval_every": 0, "precision": "fp32", "device": "cpu", "seed": 0},
               "output": {"dir": str(tmp / mode)}}
        losses[mode] = train(config_from_dict(raw), quiet=True).losses
    rel = {m: max(abs(a - b) / abs(b) for a, b in zip(losses[m], losses["lean"])) for m in ("peft", "fused")}
    return {"steps": len(losses["lean"]), "max_rel_diff_vs_lean": rel,
            "final": {m: losses[m][-1] for m in losses}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=0, help="train this many steps with each path (0: no run)")
    ap.add_argument("--ops", action="store_true", help="count aten ops per adapted linear")
    ap.add_argument("--time", action="store_true", help="time forward + backward of the 0.5B-shaped blocks")
    ap.add_argument("--repeats", type=int, default=9, help="timed rounds of the three paths (--time)")
    args = ap.parse_args(argv)
    import os

    out: dict = {"torch": torch.__version__, "threads": torch.get_num_threads(), "load_average": os.getloadavg()}
    if args.ops:
        out["ops_per_adapted_linear"] = {k: {p: {q: v[p][q] for q in ("ops", "kernels")} if p != "step_start_extra"
                                             else v[p] for p in v} for k, v in all_op_counts().items()}
    if args.time:
        out["cpu_fwd_bwd_s"] = time_blocks(args.repeats)
    if args.steps:
        out["training"] = train_losses(args.steps)
    out["load_average_after"] = os.getloadavg()
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
