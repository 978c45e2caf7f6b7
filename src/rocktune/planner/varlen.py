"""What one decoder layer saves for backward on rocktune's GPU path: varlen attention over packed rows, the lean
LoRA forward, eagerly or under ``torch.compile``.

The SDPA model (``activations``) sized this path as a padded SDPA forward with a dense mask and PEFT's per-adapter
casts: on the first H200 run it chose 34 rows of 2,048 tokens per forward at 109.9 GiB predicted, and put the
forward of 20 rows that set the run's measured peak (46.4 GiB) at 66 GiB.

Eager (counted on the CPU with torch's own varlen op and its autograd, ``benchmarks/planner_validation.py``):

- the kernel saves q, k, v, its output and the fp32 log-sum-exp (heads x tokens); no mask, no s x s scores. The
  rotary output is (rows, heads, len, dim): the token-major copy the kernel takes is what is saved. A kernel without
  grouped-query support (torch 2.11) gets K/V repeated to every query head, and saves the repeated copies.
- the lean LoRA forward casts nothing per adapter: q/k/v (and gate/up) share one saved input in any precision, and
  o_proj's input is the kernel's output (already saved).
- norms and the MLP save what the SDPA model says (an fp32 copy per RMSNorm; gate out, activation out, up out).

Compiled (counted on the CPU the same way, the decoder under ``torch.compile``): Inductor keeps each norm's input
in the stream's dtype and its per-row rsqrt instead of the fp32 copy, and recomputes the activation in backward
instead of keeping it (gate and up outputs are kept); everything a matmul's weight gradient reads (the LoRA inputs,
the rank-r outputs, the cast adapter weights) and the attention op's inputs and outputs stay.
"""

from __future__ import annotations

from rocktune.planner.shapes import ModelShape

GROUP_INPUT = {"attn_in": "hidden", "mlp_in": "hidden", "mlp_mid": "mlp"}  # attn_out's input is the kernel output


def attention(shape: ModelShape, tok, out: dict[str, int]) -> None:
    """q, k, v, output and log-sum-exp as the varlen kernel saves them (``tok``: activations.Tokens)."""
    t, dt, q, kv = tok.t, tok.dt, shape.q_dim, shape.kv_dim
    repeated = tok.kv_copies and shape.heads != shape.kv_heads  # the copies are kept compiled too (counted)
    k_sz = q if repeated else kv
    # v of a fused qkv projection reaches the kernel as a view of the whole fused output (no copy is needed)
    v_sz = k_sz if repeated or not shape.fused_qkv else q + 2 * kv
    out["attention"] = t * (2 * q + k_sz + v_sz) * dt + t * shape.heads * 4
    if shape.qk_norm:  # per-head norms of q and k: an fp32 copy each eagerly, the input and rsqrt compiled
        width = dt if tok.compiled else 4
        out["norms"] += t * (width * q + 4 * shape.heads) + t * (width * kv + 4 * shape.kv_heads)


def norm_bytes(shape: ModelShape, tok) -> int:
    """One RMSNorm over ``tok.t`` rows: the fp32 copy of its input eagerly; compiled, the input in its own dtype."""
    h = shape.hidden
    width = (tok.stream or tok.dt) if tok.compiled else 4
    return tok.t * (width * h + 4) + (4 * h if shape.norms_per_layer == 4 else 0)


def mlp_bytes(shape: ModelShape, tok) -> int:
    """Gate out, activation out and up out eagerly; compiled only gate and up (the activation is recomputed)."""
    return (2 if tok.compiled else 3) * tok.t * shape.mlp_width * (tok.stream or tok.dt)


def lora(shape: ModelShape, tok, mods, groups: set[str], out: dict[str, int]) -> None:
    """The lean LoRA forward: one saved input per group of adapters that read it, the rank-r output of every
    lora_A, and under autocast the cached half copies of A and B (compiled too: weight gradients read them).
    ``groups``: the adapted groups (``activations.GROUP``) of ``mods``."""
    t, dt = tok.t, tok.dt
    width = {"hidden": shape.hidden, "mlp": shape.mlp_width}
    out["lora_rank"] = sum(t * tok.rank * dt + ((i + o) * tok.rank * dt if tok.amp else 0) for _, i, o in mods)
    if tok.dropout > 0:  # each adapter saves its own dropped copy and the mask (bool on a GPU, the dtype on CPU)
        out["lora_inputs"] = 0
        out["lora_dropout"] = sum(t * i * ((1 if tok.mask_bytes == 1 else dt) + dt) for _, i, _ in mods)
        return
    out["lora_inputs"] = sum(t * width[GROUP_INPUT[g]] * dt for g in groups if g in GROUP_INPUT)
