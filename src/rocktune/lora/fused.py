"""The fused LoRA side path: a base linear and its adapter, or siblings that read the same input (q/k/v, gate/up),
as one autograd node of matmuls only.

Forward, per group of n adapted linears on one input ``x`` (2-D views):
``h = x @ cat(A_1..A_n)^T`` (one skinny matmul for the group), then per member ``y_i = x @ W_i^T (+ bias)`` and
``y_i.addmm_(h_i, (s_i B_i)^T)``: the scaled add rides in the matmul's epilogue, so it costs no pass of its own.
Backward, from the members' ``dY_i``: ``dH = cat(dY_i @ s_i B_i)`` (n skinny matmuls), ``dX = dH @ cat(A)`` then
``dX.addmm_(dY_i, W_i)`` (the base's input gradient accumulated in the epilogue, not by a separate add),
``dA = dH^T @ x`` (one matmul for the group), ``dB_i = s_i dY_i^T @ h_i``; dX is skipped where the input needs no
gradient (the first layer's, computed from frozen embeddings). dY is read by exactly two matmuls per
member (dX's and dB's); the scaling is folded into the cast of dB to the master dtype.

The math runs in the compute dtype (autocast's, else the input's), as autocast would run it. The adapter's casts
(``cat(A)`` and each ``s_i B_i`` in the compute dtype) are made inside the node from the real fp32 master parameters,
at every call: nothing is cached. A cache keyed on what torch does not promise (a version counter that torch's fused
AdamW does not bump) trained nothing on the GPUs' defaults; recasting ~9 M adapter parameters per forward is a
pass of a few tens of MB, far below one matmul of the layer. Under ``torch.compile`` Inductor fuses these casts into
its own kernels.

The parameters stay PEFT's own (nothing is concatenated in place), so names, state dicts and saved files are
unchanged. The frozen base weights are never given a gradient (the caller checks ``requires_grad`` is off).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Plan:
    """What one group call needs beside tensors: each member's LoRA scaling and rank. Floats and ints only, so
    ``torch.compile`` treats it as a constant."""

    scalings: tuple[float, ...]
    ranks: tuple[int, ...]


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


def _adapter_casts(plan: Plan, a_params, b_params, dtype):
    """``cat(A)`` and each ``s_i B_i`` in ``dtype``, one kernel each (the concatenation, scaling and cast write the
    result directly); a parameter that needs none of them is used as it is."""
    if len(a_params) == 1:
        a_cat = a_params[0].to(dtype)
    else:
        rows = sum(a.shape[0] for a in a_params)
        a_cat = torch.cat(list(a_params), out=a_params[0].new_empty(rows, a_params[0].shape[1], dtype=dtype))
    bs = [b.to(dtype) if s == 1.0 else torch.mul(b, s, out=torch.empty_like(b, dtype=dtype))
          for b, s in zip(b_params, plan.scalings)]
    return a_cat, bs


def _add_product(c: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``c + a @ b`` as one matmul whose epilogue adds ``c``: in place in eager mode (no pass of its own, no copy of
    ``c``); out of place under ``torch.compile``, whose graphs are functional anyway. An in-place add on the forward's
    output inside this node made torch 2.11's compiled graph hand A and B zero gradients (tests/test_training_matrix.py
    on 2.11), so the compiled node mutates nothing."""
    if torch.compiler.is_compiling():
        return torch.addmm(c, a, b)
    return c.addmm_(a, b)


class FusedLoRA(torch.autograd.Function):
    """Inputs: ``plan``, ``x`` (2-D, compute dtype), then per member ``W, bias, A, B`` (the real parameters; bias
    may be None). The forward computes from A and B themselves, so no compiler can treat them as unused. Outputs:
    one ``y`` per member."""

    @staticmethod
    def forward(ctx, plan, x, *params):
        a_cat, bs = _adapter_casts(plan, params[2::4], params[3::4], x.dtype)
        h = torch.mm(x, a_cat.t())
        ys, ws, start = [], [], 0
        for i, r in enumerate(plan.ranks):
            w, bias = params[4 * i].to(x.dtype), params[4 * i + 1]  # a no-op unless autocast runs an fp32 base
            y = torch.mm(x, w.t()) if bias is None else torch.addmm(bias.to(x.dtype), x, w.t())
            ys.append(_add_product(y, h[:, start:start + r], bs[i].t()))
            ws.append(w)
            start += r
        ctx.plan = plan
        ctx.master = (params[2].dtype, params[3].dtype)  # the adapter's master dtype (fp32 unless cast by hand)
        ctx.save_for_backward(x, a_cat, h, *bs, *ws)
        return tuple(ys)

    @staticmethod
    def backward(ctx, *dys):
        plan = ctx.plan
        n = len(plan.ranks)
        saved = ctx.saved_tensors  # once: checkpointing's recomputation refuses a second unpack
        x, a_cat, h = saved[:3]
        bs, ws = saved[3:3 + n], saved[3 + n:]
        live = [i for i in range(n) if dys[i] is not None]
        dh = [torch.mm(dys[i], bs[i]) if i in live else None for i in range(n)]
        if len(live) < n:  # an output unused by the graph: its share of dH is zero
            dh = [d if d is not None else x.new_zeros(x.shape[0], r) for d, r in zip(dh, plan.ranks)]
        dh_cat = dh[0] if n == 1 else torch.cat(dh, dim=1)
        dx = None
        if ctx.needs_input_grad[1]:  # not for an input no gradient reaches (the first layer's, from frozen embeddings)
            dx = torch.mm(dh_cat, a_cat)
            for i in live:
                dx = _add_product(dx, dys[i], ws[i])
        a_dtype, b_dtype = ctx.master
        da = torch.mm(dh_cat.t(), x).to(a_dtype)  # one cast for the group; the members' rows are contiguous views
        grads, start = [], 0
        for i, r in enumerate(plan.ranks):
            db = None
            if i in live:
                db = torch.mm(dys[i].t(), h[:, start:start + r])
                if plan.scalings[i] != 1.0 or db.dtype != b_dtype:  # scaling and cast to the master dtype: one op
                    db = torch.mul(db, plan.scalings[i], out=torch.empty_like(db, dtype=b_dtype))
            grads += [None, None, da[start:start + r], db]
            start += r
        return (None, dx, *grads)


def run_group(plan: Plan, x: torch.Tensor, members) -> list[torch.Tensor]:
    """``members``: per adapted linear, ``(base nn.Linear, lora_A weight, lora_B weight)``. Returns each member's
    output shaped like ``x`` with its own last dimension, in the compute dtype."""
    params = [t for base, a, b in members for t in (base.weight, base.bias, a, b)]
    x2d = x.reshape(-1, x.shape[-1]).to(compute_dtype(x))
    ys = FusedLoRA.apply(plan, x2d, *params)
    return [y.view(*x.shape[:-1], y.shape[-1]) for y in ys]
