"""Bytes that autograd saves for backward in one LoRA training step, tensor by tensor.

Derived from what transformers + PEFT + torch actually save (checked with ``saved_tensors_hooks``, deduplicated by
storage, in ``benchmarks/planner_validation.py``), not from a rule of thumb. The rules that matter:

- a frozen linear saves no input (its weight needs no gradient); a LoRA ``lora_A`` saves its input. In fp32,
  q/k/v (and gate/up) share one saved input; under autocast each adapter saves its own half-precision cast.
- RMSNorm saves an fp32 copy of its input and the per-row rsqrt, whatever the run precision.
- sdpa/flash save q, k, v, the output and the fp32 log-sum-exp; eager saves q, repeated k/v and the s x s fp32
  softmax (plus its half-precision copy under autocast). With a padding mask, sdpa repeats k/v for grouped-query
  attention and each layer converts the boolean mask to a float mask that it saves.
- dropout on the LoRA input saves a mask (bool on GPUs, the input's dtype on CPU) and a dropped copy per adapter.

rocktune's GPU path (varlen attention, the lean LoRA forward, eager or compiled) has its own rules: ``varlen``.
"""

from __future__ import annotations

from dataclasses import dataclass

from rocktune.errors import UserError
from rocktune.planner import moe, recurrent, varlen
from rocktune.planner.shapes import ModelShape

GROUP = {"q_proj": "attn_in", "k_proj": "attn_in", "v_proj": "attn_in", "qkv_proj": "attn_in",
         "o_proj": "attn_out", "gate_proj": "mlp_in", "up_proj": "mlp_in", "gate_up_proj": "mlp_in",
         "down_proj": "mlp_mid",
         # Gated DeltaNet (planner/recurrent.py): the projections read the normed hidden state, out_proj the gated norm
         "in_proj_qkv": "attn_in", "in_proj_z": "attn_in", "in_proj_b": "attn_in", "in_proj_a": "attn_in",
         "in_proj_qkvz": "attn_in", "in_proj_ba": "attn_in",
         "in_proj": "attn_in", "input_linear": "mlp_in", "output_linear": "mlp_mid",
         "out_proj": "attn_out"}


@dataclass(frozen=True)
class Tokens:
    """The sizes one micro-batch gives the activation model."""

    batch: int
    seq: int
    dt: int  # bytes per activation element: 4 (fp32) or 2 (bf16/fp16 autocast)
    amp: bool
    attn: str  # eager | sdpa | flash_attention_2 | varlen
    padded: bool
    rank: int
    dropout: float
    mask_bytes: int  # dropout mask element: 1 on GPUs (bool), 4 on CPU (fp32 noise tensor)
    stream: int = 0  # bytes of the residual stream and the linears' outputs when not ``dt``: 4 on a QLoRA base
    compiled: bool = False  # varlen: the decoder runs under torch.compile (Inductor decides what is kept)
    kv_copies: bool = False  # varlen: the kernel has no grouped-query K/V, so K/V are repeated per query head
    expert_pad: float = 0.0  # MoE: 0 on the grouped expert path, else the busiest expert's rows over the mean

    @property
    def t(self) -> int:
        return self.batch * self.seq


def lora_modules(shape: ModelShape, targets, layer: list | None = None) -> list[tuple[str, int, int]]:
    """The adapted (name, in, out) of one layer: ``layer`` (its linears, a kind of ``shape.layer_linears``), else a
    full-attention layer's. A named target must exist in some kind of layer."""
    linears = {name: (n_in, n_out) for name, n_in, n_out, _ in (layer or shape.linears())}
    if targets in ("all-linear", "all", None):
        names = list(linears)
    else:
        known = {name for _, lin in shape.layer_linears() for name, _, _, _ in lin}
        unknown = sorted(set(targets) - known)
        if unknown:
            raise UserError(f"target module(s) {', '.join(unknown)} do not exist in a {shape.model_type} layer; "
                            f"its linear modules are {', '.join(linears)} (or use all-linear).")
        names = [n for n in linears if n in set(targets)]
    return [(n, *linears[n]) for n in names]


def layer_saved(shape: ModelShape, tok: Tokens, targets, input_grad: bool, linear: bool = False) -> dict[str, int]:
    """Saved-for-backward bytes of one decoder layer, by part. ``input_grad``: the layer input requires grad.
    ``linear``: one of a hybrid's linear-attention layers (planner/recurrent.py) instead of full attention."""
    t, dt, h = tok.t, tok.dt, shape.hidden
    layer = recurrent.linears(shape.linear_attn, h) + shape.mlp_linears() if linear else None
    mods = lora_modules(shape, targets, layer)
    groups = {GROUP[n] for n, _, _ in mods}
    lean = tok.attn == "varlen" and not tok.stream  # (a QLoRA base's fp32 stream is cast per adapter, as PEFT's)
    norm = varlen.norm_bytes(shape, tok) if lean else t * (4 * h + 4) + (4 * h if shape.norms_per_layer == 4 else 0)
    out = {"norms": 0, "attention": 0, "attention_scores": 0, "attention_mask": 0, "mlp": 0,
           "lora_inputs": 0, "lora_dropout": 0, "lora_rank": 0}

    attn_grad = input_grad or "attn_in" in groups
    after_attn_grad = attn_grad or "attn_out" in groups
    mlp_grad = after_attn_grad or "mlp_in" in groups
    out["norms"] = norm * (int(input_grad) + int(after_attn_grad) * (shape.norms_per_layer - 1))
    if attn_grad and linear:
        out["attention"] = recurrent.saved(shape.linear_attn, tok)
    elif attn_grad:
        varlen.attention(shape, tok, out) if tok.attn == "varlen" else _attention(shape, tok, out)
    if mlp_grad and shape.experts:  # the routed rows, the shared expert, the router (planner/moe.py)
        out["mlp"] = moe.saved(shape, tok)
    elif mlp_grad:  # gate out (act input), act out, up out; fused gate_up 2i + i
        out["mlp"] = varlen.mlp_bytes(shape, tok) if lean else 3 * t * shape.mlp_width * (tok.stream or dt)
    grad_in = {"attn_in": input_grad, "attn_out": attn_grad, "mlp_in": after_attn_grad, "mlp_mid": mlp_grad}
    _lora(shape, tok, mods, grad_in, out, own_o_input=linear or shape.o_input_copy or shape.gated_attn)
    if lean:  # dropout's extra bytes as PEFT's path has them; the plain inputs and ranks as the lean forward saves
        varlen.lora(shape, tok, mods, groups, out)
    return out


def _attention(shape: ModelShape, tok: Tokens, out: dict[str, int]) -> None:
    t, dt, b, s = tok.t, tok.dt, tok.batch, tok.seq
    q, kv = shape.q_dim, shape.kv_dim
    if shape.qk_norm:
        out["norms"] += t * (4 * q + 4 * shape.heads) + t * (4 * kv + 4 * shape.kv_heads)
    repeat = shape.heads != shape.kv_heads
    v_storage = (q + 2 * kv) if shape.fused_qkv else kv  # v is a view of the fused qkv output
    scores = b * shape.heads * s * s
    if tok.attn == "eager":
        k_sz = q if repeat else kv
        v_sz = q if repeat else kv  # matmul copies a strided v (fused qkv) before saving it
        out["attention"] = t * (q + k_sz + v_sz) * dt
        out["attention_scores"] = scores * (4 + (dt if tok.amp else 0))
        if shape.attn_softcap:
            out["attention_scores"] += scores * dt  # tanh output
        return
    sdpa_repeats = tok.attn == "sdpa" and tok.padded and repeat
    k_sz = q if sdpa_repeats else kv
    v_sz = q if sdpa_repeats else v_storage
    out["attention"] = t * (2 * q + k_sz + v_sz) * dt + b * shape.heads * s * 4  # q, k, v, out, lse
    if shape.gated_attn:  # Qwen3.5: the gate's sigmoid and the kernel output's contiguous copy, for their product
        out["attention"] += 2 * t * q * dt
    if tok.attn == "sdpa" and tok.padded:
        out["attention_mask"] = b * s * s * dt  # the bool mask, converted to float for each call


def _lora(shape: ModelShape, tok: Tokens, mods, grad_in: dict[str, bool], out: dict[str, int],
          own_o_input: bool) -> None:
    """``own_o_input``: o_proj (out_proj) reads a tensor of its own, not the attention kernel's saved output."""
    t, dt = tok.t, tok.dt
    seen: set[str] = set()
    plain = dropped = 0
    for name, n_in, n_out in mods:
        group = GROUP[name]
        out["lora_rank"] += t * tok.rank * dt
        if tok.amp:
            out["lora_rank"] += (n_in + n_out) * tok.rank * dt  # autocast's half-precision copy of A and B
        # Without dropout lora_A saves one fp32 input per group, or its own cast under autocast.
        if tok.amp:
            plain += t * n_in * dt
        elif group not in seen and not (group == "attn_out" and tok.attn != "eager" and not shape.fused_qkv
                                        and not own_o_input):
            # (sdpa/flash write their output as (b, s, heads, d): it is the o_proj input, counted under attention;
            # measured: with a fused qkv projection the output is copied first)
            plain += t * n_in * 4
        seen.add(group)
        # (the mask is saved only where the input needs a gradient: not in the first layer's q/k/v)
        dropped += t * n_in * (tok.mask_bytes * grad_in[group] + (dt if tok.amp else 4))
    out["lora_inputs"] = plain
    # With dropout every adapter saves a mask and its own dropped copy instead: the difference is dropout's cost.
    out["lora_dropout"] = dropped - plain if tok.dropout > 0 else 0
