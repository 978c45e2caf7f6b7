"""A CPU stand-in for torch's varlen kernel as the compiler sees it: one opaque custom op with the same inputs and
output shapes, computed by ``rocktune.kernels.attention.reference_varlen``. The reference itself loops over the bounds
in Python, which Dynamo would trace into a graph per document layout; torch's kernel is a custom op Dynamo never
enters, and so is this one, so a compiled model's graphs and recompiles on the CPU are those of the GPU path (the
tests and ``benchmarks/compiled_layer.py`` on a CPU). Slow: a test's yardstick, never a training path.

Two signatures over the one op: torch 2.13's (``enable_gqa``) and torch 2.11's (no ``enable_gqa``; grouped K/V taken as
they are where the query heads are a multiple of theirs, the one check FA2's varlen kernel makes)."""

# No `from __future__ import annotations`: torch 2.4's custom_op reads the signature's annotations as types and
# refuses them as strings ("Parameter q has unsupported type torch.Tensor"); later torches resolve either.
import torch

from rocktune.kernels.attention import reference_varlen


@torch.library.custom_op("rocktune::varlen_standin", mutates_args=())
def _varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, max_q: int,
            scale: float) -> torch.Tensor:
    return reference_varlen(q, k, v, cu, cu, max_q, max_q, scale=scale, window_size=(-1, 0), enable_gqa=True)


@_varlen.register_fake
def _(q, k, v, cu, max_q, scale):
    return torch.empty_like(q)


@torch.library.custom_op("rocktune::varlen_standin_backward", mutates_args=())
def _varlen_backward(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor,
                     max_q: int, scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # Opaque too, as torch's kernel backward is (AOT autograd traces a backward formula into the graph), and written
    # out (autograd does not run inside a custom op): causal softmax attention's gradients, per document.
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    group = q.shape[1] // k.shape[1]
    bounds = cu.tolist()
    for a, b in zip(bounds, bounds[1:]):
        if a == b:
            continue
        qs, ks, vs = (t[a:b].transpose(0, 1) for t in (q, k, v))  # (heads, n, dim)
        ks, vs = ks.repeat_interleave(group, 0), vs.repeat_interleave(group, 0)
        causal = torch.ones(b - a, b - a, dtype=torch.bool).tril()
        p = torch.softmax((qs @ ks.transpose(1, 2) * scale).masked_fill(~causal, float("-inf")), dim=-1)
        go = grad[a:b].transpose(0, 1)
        dp = go @ vs.transpose(1, 2)
        ds = p * (dp - (dp * p).sum(-1, keepdim=True))
        dq[a:b] = (ds @ ks * scale).transpose(0, 1)
        dk[a:b] = (ds.transpose(1, 2) @ qs * scale).unflatten(0, (-1, group)).sum(1).transpose(0, 1)
        dv[a:b] = (p.transpose(1, 2) @ go).unflatten(0, (-1, group)).sum(1).transpose(0, 1)
    return dq, dk, dv


@_varlen_backward.register_fake
def _(grad, q, k, v, cu, max_q, scale):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs[:4])
    ctx.max_q, ctx.scale = inputs[4], inputs[5]


def _backward(ctx, grad):
    q, k, v, cu = ctx.saved_tensors
    dq, dk, dv = _varlen_backward(grad, q, k, v, cu, ctx.max_q, ctx.scale)
    return dq, dk, dv, None, None, None


_varlen.register_autograd(_backward, setup_context=_setup)


def opaque_varlen(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None, window_size=(-1, -1),
                  enable_gqa=False):
    """torch 2.13's ``varlen_attn`` signature (causal, grouped-query) over the custom op."""
    assert tuple(window_size) == (-1, 0) and enable_gqa
    return _varlen(query, key, value, cu_seq_q, max_q, scale if scale is not None else query.shape[-1] ** -0.5)


def opaque_varlen_2_11(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None, window_size=(-1, -1)):
    """torch 2.11's ``varlen_attn`` signature (no ``enable_gqa``) over the custom op: what ``aten``'s FA2 varlen kernel
    accepts, grouped K/V included when their heads divide the query's."""
    assert tuple(window_size) == (-1, 0)
    if query.shape[1] % key.shape[1] or key.shape[1] != value.shape[1]:
        raise RuntimeError("Number of heads in key/value must divide number of heads in query")
    return _varlen(query, key, value, cu_seq_q, max_q, scale if scale is not None else query.shape[-1] ** -0.5)
