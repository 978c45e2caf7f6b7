"""Validate the planner against real training steps; prints one JSON object.

    python benchmarks/planner_validation.py            # CPU grid (tiny and small models), ~1 minute
    python benchmarks/planner_validation.py --gpu      # + predicted peak vs torch.cuda.max_memory_allocated

CPU: one real training step (rocktune's LoRA wrapping, loss and AdamW) per grid point. Bytes saved for backward
are counted with ``torch.autograd.graph.saved_tensors_hooks``, deduplicated by storage, parameters excluded; with
gradient checkpointing the tensors each checkpoint keeps for recomputation are counted too. Parameters, gradients
and optimizer states are counted from the tensors after the step.
"""

from __future__ import annotations

import argparse
import json
import sys
from contextlib import nullcontext

import torch

from rocktune.planner.estimate import RunSpec, estimate
from rocktune.planner.shapes import shape_from_config

TINY = {"model_type": "qwen2", "hidden_size": 64, "intermediate_size": 160, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512, "tie_word_embeddings": True}
SMALL = {"model_type": "llama", "hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 4,
         "num_attention_heads": 8, "num_key_value_heads": 4, "vocab_size": 2048, "tie_word_embeddings": False}
QWEN3 = {"model_type": "qwen3", "hidden_size": 128, "intermediate_size": 384, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 1024}
PHI3 = {"model_type": "phi3", "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 1024, "pad_token_id": 0}
MODELS = {"tiny-qwen2": TINY, "small-llama": SMALL, "tiny-qwen3": QWEN3, "tiny-phi3": PHI3}


def build(config: dict, precision: str, attn: str, r: int, dropout: float, ckpt: bool, device: str = "cpu"):
    from transformers import AutoConfig, AutoModelForCausalLM

    from rocktune.model import DTYPES, apply_lora

    cfg = AutoConfig.for_model(**config)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation=attn, dtype=DTYPES[precision]).to(device)
    model.config.use_cache = False
    model = apply_lora(model, r=r, alpha=2 * r, dropout=dropout, target_modules="all-linear",
                       gradient_checkpointing=ckpt)
    model.train()
    return model


def make_batch(vocab: int, b: int, s: int, device: str = "cpu", seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (b, s), generator=g)
    mask = torch.ones(b, s, dtype=torch.long)
    labels = ids.clone()
    labels[:, : s // 4] = -100  # a prompt carries no loss
    if b > 1:  # dynamic padding: the first example is shorter
        mask[0, s - s // 3 :] = 0
        labels[0, s - s // 3 :] = -100
    return {k: v.to(device) for k, v in {"input_ids": ids, "attention_mask": mask, "labels": labels}.items()}


def _storage_key(t: torch.Tensor):
    s = t.untyped_storage()
    return s.data_ptr(), s.nbytes()


def measure_step(model, batch: dict, precision: str, device: str = "cpu") -> dict:
    """Run one training step; count saved-for-backward bytes and the training state."""
    from rocktune.tasks.lm.loss import causal_lm_loss_sum

    params = {_storage_key(p)[0] for p in model.parameters()}
    saved: dict[int, int] = {}

    def keep(t):
        if isinstance(t, torch.Tensor) and t.device.type != "meta":
            ptr, n = _storage_key(t)
            if ptr not in params and n:
                saved[ptr] = n

    def pack(t):
        keep(t)
        return t

    for layer in model.base_model.model.model.layers:  # checkpoint inputs are kept alive outside the hooks
        fn = getattr(layer, "_gradient_checkpointing_func", None)
        if fn is not None and layer.gradient_checkpointing:
            layer._gradient_checkpointing_func = _counting(fn, keep)
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=1e-3, foreach=True)
    amp = precision != "fp32"
    ctx = torch.autocast(device, dtype={"bf16": torch.bfloat16, "fp16": torch.float16}[precision]) if amp \
        else nullcontext()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), ctx:
        loss_sum, n_tokens = causal_lm_loss_sum(model, batch, chunk_size=1024)
    (loss_sum / n_tokens).backward()
    opt.step()
    state = [t for st in opt.state.values() for t in st.values() if t.dim() > 0]
    return {"saved_bytes": sum(saved.values()),
            "lora_params_bytes": sum(p.numel() * p.element_size() for p in trainable),
            "lora_grads_bytes": sum(p.grad.numel() * p.grad.element_size() for p in trainable),
            "adamw_states_bytes": sum(t.numel() * t.element_size() for t in state),
            "base_weights_bytes": sum(p.numel() * p.element_size() for p in model.parameters() if not p.requires_grad),
            "loss_tokens": n_tokens}


def _counting(fn, keep):
    def wrapped(func, *args, **kwargs):
        for a in [*args, *getattr(func, "keywords", {}).values()]:
            for t in (a if isinstance(a, tuple) else (a,)):
                keep(t)
        return fn(func, *args, **kwargs)

    return wrapped


def predict(config: dict, b: int, s: int, r: int, precision: str, attn: str, ckpt: bool, dropout: float,
            loss_fraction: float, device: str):
    spec = RunSpec(micro_batch=b, seq_len=s, lora_r=r, precision=precision, attn=attn, checkpointing=ckpt,
                   lora_dropout=dropout, loss_fraction=loss_fraction, device="cpu" if device == "cpu" else "gpu")
    return estimate(shape_from_config(config), spec)


def run_point(name: str, b: int, s: int, r: int, precision: str, attn: str, ckpt: bool, dropout: float) -> dict:
    torch.manual_seed(0)
    config = MODELS[name]
    model = build(config, precision, attn, r, dropout, ckpt)
    batch = make_batch(config["vocab_size"], b, s)
    got = measure_step(model, batch, precision)
    est = predict(config, b, s, r, precision, attn, ckpt, dropout, got["loss_tokens"] / (b * (s - 1)), "cpu")
    terms = est.by_name()
    row = {"model": name, "batch": b, "seq": s, "rank": r, "precision": precision, "attn": attn,
           "checkpointing": ckpt, "dropout": dropout, "saved_measured": got["saved_bytes"],
           "saved_predicted": est.saved_bytes}
    row["saved_error"] = (est.saved_bytes - got["saved_bytes"]) / got["saved_bytes"]
    row["state_exact"] = (terms["lora_params"], terms["lora_grads"], terms["adamw_states"],
                          terms["base_weights"]) == (got["lora_params_bytes"], got["lora_grads_bytes"],
                                                     got["adamw_states_bytes"], got["base_weights_bytes"])
    return row


def cpu_grid(quick: bool = False):
    if quick:
        points = [("tiny-qwen2", 1, 64, 8, "fp32", "sdpa", False, 0.0),
                  ("tiny-qwen2", 3, 48, 4, "bf16", "eager", False, 0.0),
                  ("tiny-qwen2", 2, 64, 16, "fp32", "eager", True, 0.1),
                  ("small-llama", 2, 96, 8, "bf16", "sdpa", False, 0.1),
                  ("small-llama", 1, 128, 8, "fp32", "sdpa", True, 0.0),
                  ("tiny-qwen3", 2, 64, 8, "fp32", "sdpa", False, 0.0),
                  ("tiny-phi3", 2, 64, 8, "bf16", "eager", False, 0.0)]
    else:
        # rank and dropout change only small terms: they alternate instead of multiplying the grid
        points = [(m, b, s, 16 if c else 4, p, a, c, 0.1 if (b == 4) == (p == "fp32") else 0.0)
                  for m in ("tiny-qwen2", "small-llama") for b, s in ((1, 128), (4, 64)) for p in ("fp32", "bf16")
                  for a in ("eager", "sdpa") for c in (False, True)]
        points += [(m, 2, 64, 8, p, a, c, 0.0) for m in ("tiny-qwen3", "tiny-phi3") for p in ("fp32", "bf16")
                   for a in ("eager", "sdpa") for c in (False, True)]
    return [run_point(*pt) for pt in points]


def gpu_check(preset: str, b: int, s: int, precision: str = "bf16", ckpt: bool = False) -> dict:
    """Random-init model of a preset's shape on the GPU: predicted allocated peak vs max_memory_allocated."""
    from rocktune.planner.shapes import presets

    config = {k: v for k, v in presets()[preset].items() if k != "source"}
    torch.manual_seed(0)
    model = build(config, precision, "sdpa", 8, 0.0, ckpt, device="cuda")
    batch = make_batch(config["vocab_size"], b, s, device="cuda")
    for _ in range(2):  # the second step has the optimizer states, as every later one does
        torch.cuda.reset_peak_memory_stats()
        got = measure_step(model, batch, precision, device="cuda")
    peak = torch.cuda.max_memory_allocated()
    est = predict(config, b, s, 8, precision, "sdpa", ckpt, 0.0, got["loss_tokens"] / (b * (s - 1)), "cuda")
    return {"model": preset, "batch": b, "seq": s, "precision": precision, "checkpointing": ckpt,
            "peak_measured": peak, "peak_predicted": est.peak_allocated,
            "peak_error": (est.peak_allocated - peak) / peak}


def markdown(rows: list[dict]) -> str:
    lines = ["| model | b | s | r | precision | attn | ckpt | dropout | saved measured | predicted | error |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['batch']} | {r['seq']} | {r['rank']} | {r['precision']} | {r['attn']} "
                     f"| {'on' if r['checkpointing'] else 'off'} | {r['dropout']} | {r['saved_measured']:,} "
                     f"| {r['saved_predicted']:,} | {r['saved_error']:+.1%} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a 7-point subset")
    ap.add_argument("--gpu", action="store_true", help="also compare peaks on the GPU (needs one)")
    ap.add_argument("--markdown", action="store_true", help="print the CPU table as markdown instead of JSON")
    args = ap.parse_args(argv)
    rows = cpu_grid(args.quick)
    out = {"cpu": rows, "max_abs_saved_error": max(abs(r["saved_error"]) for r in rows),
           "state_exact": all(r["state_exact"] for r in rows)}
    if args.gpu and torch.cuda.is_available():
        out["gpu"] = [gpu_check(p, b, s, prec, c) for p in ("Qwen2.5-0.5B", "Qwen2.5-1.5B")
                      for b, s, prec, c in ((1, 1024, "bf16", False), (4, 512, "bf16", True), (2, 512, "fp32", False))]
    print(markdown(rows) if args.markdown else json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
