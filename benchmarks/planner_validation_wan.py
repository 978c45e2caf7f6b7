"""Validate the Wan planner (``rocktune.tasks.wan.plan``) against real training steps; prints one JSON object.

    python benchmarks/planner_validation_wan.py            # CPU grid (tiny and small random transformers)
    python benchmarks/planner_validation_wan.py --markdown # the same as a table

One real step of a random diffusers ``WanTransformer3DModel`` per grid point, built as the training loop builds it
(``rocktune.tasks.wan.diffusion.components``: frozen base loaded with diffusers' dtype rules, PEFT LoRA on the blocks'
attention and FFN linears, fp32 adapters) and trained with its flow-matching loss and AdamW. Bytes saved for backward
are counted with
``torch.autograd.graph.saved_tensors_hooks``, deduplicated by storage, parameters excluded; with gradient
checkpointing the tensors each block's checkpoint keeps are counted too. Parameters, gradients and optimizer states
are counted from the tensors after the step and must match the prediction exactly.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from contextlib import nullcontext

import torch

from rocktune.tasks.wan.diffusion.objective import FlowMatchLoss
from rocktune.tasks.wan.plan import LORA_TARGETS, WanSpec, estimate_wan, shape_from_config

TINY = {"patch_size": [1, 2, 2], "num_attention_heads": 2, "attention_head_dim": 12, "in_channels": 16,
        "out_channels": 16, "text_dim": 32, "freq_dim": 256, "ffn_dim": 32, "num_layers": 2, "cross_attn_norm": True,
        "qk_norm": "rms_norm_across_heads", "rope_max_seq_len": 32}
SMALL = {"patch_size": [1, 2, 2], "num_attention_heads": 4, "attention_head_dim": 32, "in_channels": 16,
         "out_channels": 16, "text_dim": 64, "freq_dim": 256, "ffn_dim": 256, "num_layers": 2,
         "cross_attn_norm": True, "qk_norm": "rms_norm_across_heads", "rope_max_seq_len": 64}
MODELS = {"tiny": TINY, "small": SMALL}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
VAE = (8, 4)  # spatial, temporal compression of the Wan 2.1 VAE


def build(config: dict, precision: str, r: int, ckpt: bool):
    """The transformer as the training loop builds it (rocktune.tasks.wan.diffusion.components): loaded with
    diffusers' dtype rules (its fp32 modules stay fp32), LoRA on the blocks' attention and FFN linears,
    fp32 adapters."""
    from diffusers import WanTransformer3DModel

    from rocktune.tasks.wan.diffusion import components

    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        WanTransformer3DModel(**config).save_pretrained(f"{tmp}/transformer")
        base = components.load_transformer(tmp, DTYPES[precision], "cpu")
    model = components.apply_lora(base, r, r, 0.0, LORA_TARGETS, ckpt)
    for p in model.parameters():
        if p.requires_grad:
            p.data = p.data.float()
    model.train()
    return model


def make_batch(config: dict, width: int, height: int, frames: int, b: int, text_tokens: int) -> dict:
    """One forward's batch as the latent feed builds it: fp32 latents, noise and text states, a noise level each."""
    g = torch.Generator().manual_seed(0)
    spatial, temporal = VAE
    shape = (b, config["in_channels"], (frames - 1) // temporal + 1, height // spatial, width // spatial)
    return {"latents": torch.randn(shape, generator=g), "noise": torch.randn(shape, generator=g),
            "sigma": torch.rand(b, generator=g), "text": torch.randn(b, text_tokens, config["text_dim"], generator=g)}


def _storage_key(t: torch.Tensor):
    s = t.untyped_storage()
    return s.data_ptr(), s.nbytes()


def measure_step(model, batch: dict, precision: str) -> dict:
    params = {_storage_key(p)[0] for p in model.parameters()} | {_storage_key(b)[0] for b in model.buffers()}
    saved: dict[int, int] = {}

    def keep(t):
        if isinstance(t, torch.Tensor) and t.device.type != "meta":
            ptr, n = _storage_key(t)
            if ptr not in params and n:
                saved[ptr] = n

    def pack(t):
        keep(t)
        return t

    inner = model.base_model.model
    if inner.gradient_checkpointing:  # checkpoint inputs are kept alive outside the hooks
        inner._gradient_checkpointing_func = _counting(inner._gradient_checkpointing_func, keep)
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=1e-3, foreach=True)
    ctx = torch.autocast("cpu", dtype=torch.bfloat16) if precision == "bf16" else nullcontext()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), ctx:
        loss = FlowMatchLoss(model)(batch)
    loss.backward()
    opt.step()
    state = [t for st in opt.state.values() for t in st.values() if t.dim() > 0]
    return {"saved_bytes": sum(saved.values()),
            "lora_params_bytes": sum(p.numel() * p.element_size() for p in trainable),
            "lora_grads_bytes": sum(p.grad.numel() * p.grad.element_size() for p in trainable),
            "adamw_states_bytes": sum(t.numel() * t.element_size() for t in state),
            "base_weights_bytes": sum(p.numel() * p.element_size() for p in model.parameters() if not p.requires_grad)}


def _counting(fn, keep):
    def wrapped(block, *args):
        for a in args:
            for t in (a if isinstance(a, tuple) else (a,)):
                keep(t)
        return fn(block, *args)

    return wrapped


def run_point(name: str, width: int, height: int, frames: int, b: int, r: int, precision: str, ckpt: bool,
              text_tokens: int = 512) -> dict:
    config = MODELS[name]
    model = build(config, precision, r, ckpt)
    got = measure_step(model, make_batch(config, width, height, frames, b, text_tokens), precision)
    est = estimate_wan(shape_from_config(config, VAE, name),
                       WanSpec(width, height, frames, b, text_tokens, r, precision, ckpt))
    terms = est.by_name()
    row = {"model": name, "size": f"{width}x{height}", "frames": frames, "batch": b, "rank": r,
           "precision": precision, "checkpointing": ckpt, "tokens": est.tokens, "text_tokens": text_tokens,
           "saved_measured": got["saved_bytes"], "saved_predicted": est.saved_bytes}
    row["saved_error"] = (est.saved_bytes - got["saved_bytes"]) / got["saved_bytes"]
    row["state_exact"] = (terms["lora_params"], terms["lora_grads"], terms["adamw_states"],
                          terms["base_weights"]) == (got["lora_params_bytes"], got["lora_grads_bytes"],
                                                     got["adamw_states_bytes"], got["base_weights_bytes"])
    return row


# (model, width, height, frames, batch, rank, precision, checkpointing, text tokens): every model at a video, an
# image and a long-video size, both precisions, with and without checkpointing; rank alternates with checkpointing
SIZES = ((32, 32, 9, 1, 512), (64, 48, 5, 2, 512), (48, 32, 1, 1, 512), (128, 128, 17, 1, 64))
GRID = [(m, w, h, f, b, 4 if c else 16, p, c, n) for m in MODELS for (w, h, f, b, n) in SIZES
        for p in ("fp32", "bf16") for c in (False, True)]


def markdown(rows: list[dict]) -> str:
    lines = ["| model | WxH | frames | b | tokens | text | r | precision | ckpt | saved measured | predicted | error |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['size']} | {r['frames']} | {r['batch']} | {r['tokens']} "
                     f"| {r['text_tokens']} | {r['rank']} | {r['precision']} | {'on' if r['checkpointing'] else 'off'} "
                     f"| {r['saved_measured']:,} "
                     f"| {r['saved_predicted']:,} | {r['saved_error']:+.1%} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--markdown", action="store_true", help="print the table as markdown instead of JSON")
    args = ap.parse_args(argv)
    rows = [run_point(*pt) for pt in GRID]
    out = {"cpu": rows, "max_abs_saved_error": max(abs(r["saved_error"]) for r in rows),
           "state_exact": all(r["state_exact"] for r in rows)}
    print(markdown(rows) if args.markdown else json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
