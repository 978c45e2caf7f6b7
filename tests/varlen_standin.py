"""A CPU stand-in for torch's varlen kernel as the compiler sees it: one opaque custom op with the same inputs and
output shapes, computed by ``rocktune.attention.reference_varlen``. The reference itself loops over the bounds in
Python, which Dynamo would trace into a graph per document layout; torch's kernel is a custom op Dynamo never
enters, and so is this one, so a compiled model's graphs and recompiles on the CPU are those of the GPU path."""

from __future__ import annotations

import torch

from rocktune.attention import reference_varlen


@torch.library.custom_op("rocktune_test::varlen", mutates_args=())
def _varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, max_q: int,
            scale: float) -> torch.Tensor:
    return reference_varlen(q, k, v, cu, cu, max_q, max_q, scale=scale, window_size=(-1, 0), enable_gqa=True)


@_varlen.register_fake
def _(q, k, v, cu, max_q, scale):
    return torch.empty_like(q)


def _setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs[:4])
    ctx.max_q, ctx.scale = inputs[4], inputs[5]


def _backward(ctx, grad):
    q, k, v, cu = ctx.saved_tensors
    with torch.enable_grad():
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        out = reference_varlen(*leaves, cu, cu, ctx.max_q, ctx.max_q, scale=ctx.scale, window_size=(-1, 0),
                               enable_gqa=True)
        dq, dk, dv = torch.autograd.grad(out, leaves, grad)
    return dq, dk, dv, None, None, None


_varlen.register_autograd(_backward, setup_context=_setup)


def opaque_varlen(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None, window_size=(-1, -1),
                  enable_gqa=False):
    """torch 2.13's ``varlen_attn`` signature (causal, grouped-query) over the custom op."""
    assert tuple(window_size) == (-1, 0) and enable_gqa
    return _varlen(query, key, value, cu_seq_q, max_q, scale if scale is not None else query.shape[-1] ** -0.5)
