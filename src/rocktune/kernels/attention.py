"""Attention over packed rows without a dense mask: torch's variable-length kernel behind transformers' interface.

A packed row holds several documents. With SDPA, transformers finds them from the position ids (one host
synchronisation per forward outside a compiled graph) and builds a dense ``(B, 1, L, L)`` block-diagonal mask: that
rules out the flash kernel, makes the memory-efficient kernel compute the whole square, copies K/V for grouped-query
attention and keeps a mask per forward. Here the collate computes each document's bounds on the host
(``cu_seq_lens``: int32 offsets into the flattened ``B x L`` tokens, a row's padding one trailing segment), they travel
with the batch, and ``torch.nn.attention.varlen.varlen_attn`` (torch >= 2.10, CUDA/ROCm) attends within each
document. The implementation is registered under ``VARLEN`` with transformers' ``AttentionInterface``; since that name
has no mask function, transformers builds no mask and never looks for packed sequences.

The kernel's keyword arguments changed between torch releases (causality as ``is_causal`` or as ``window_size``;
``scale`` and ``enable_gqa`` appeared later): they are read from its signature once, at registration.

Grouped-query models (Qwen2.5-0.5B: 14 query heads, 2 K/V heads) on a torch whose ``varlen_attn`` has no
``enable_gqa`` (2.10, 2.11): the Python wrapper there checks no head counts and hands K/V to
``aten::_flash_attention_forward``/``_backward``, whose FA2 varlen kernel only requires the query heads to be a multiple
of the K/V heads (it sums dK/dV over each group itself); 2.13's ``enable_gqa`` adds the Python check and nothing
else on that path. So the glue passes grouped K/V as they are once the self-test has proven that very call on the
device (forward and backward against math attention), and repeats them (a copy per query head, saved for backward)
where it has not (a cuDNN or ROCm backend that refuses or miscomputes them).
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from rocktune.errors import UserError

VARLEN = "rocktune_varlen"
FLEX = "flex_attention"  # transformers' own: a document block mask from the position ids, built inside compile
# |out - ref| / max |ref| (and the same for each gradient) against fp32 math attention on the same rows
SELF_TEST_TOL = {torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 5e-3}


def varlen_kernel() -> Callable | None:
    """torch's variable-length attention, or None on a torch that has none (before 2.10)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


@dataclass(frozen=True)
class KernelArgs:
    """How to ask this kernel for causal, scaled, grouped-query attention (read from its signature)."""

    causal: dict  # the keyword arguments that make it causal
    scale: bool  # takes ``scale``; else the query is pre-scaled
    gqa: bool  # takes ``enable_gqa``; else K/V heads are repeated (a copy)

    @classmethod
    def of(cls, kernel: Callable) -> KernelArgs:
        params = inspect.signature(kernel).parameters
        if "window_size" in params:  # torch 2.13: (left, right) = (-1, 0) is causal
            causal = {"window_size": (-1, 0)}
        elif "is_causal" in params:  # torch 2.10
            causal = {"is_causal": True}
        else:
            raise TypeError(f"varlen_attn{inspect.signature(kernel)}: no is_causal or window_size argument")
        return cls(causal, "scale" in params, "enable_gqa" in params)


class _Registered:
    """How the glue registered in this process treats grouped K/V (transformers' registry is process-wide too)."""

    grouped_kv = False


def repeats_kv(kernel: Callable | None = None) -> bool:
    """Whether the glue repeats K/V to every query head for this kernel, so that the kernel saves the copies for
    backward: the memory planner counts them. Never with ``enable_gqa``; without it (torch 2.11) unless the glue
    registered here passes them as they are (its self-test proved that call on this device); before any
    registration the copies are counted (the larger estimate)."""
    kernel = kernel or varlen_kernel()
    return kernel is not None and not KernelArgs.of(kernel).gqa and not _Registered.grouped_kv


def make_forward(kernel: Callable, grouped_kv: bool = False) -> Callable:
    """The attention function transformers calls per layer: ``(module, q, k, v, mask, ...) -> (out, None)`` with
    q/k/v of shape ``(B, heads, L, head_dim)`` and out ``(B, L, heads, head_dim)``. Without ``cu_seq_lens_q``
    (evaluation's right-padded rows, generation) it is transformers' causal SDPA: exact there, since no padding
    precedes a real token. ``grouped_kv``: hand grouped K/V un-repeated to a kernel without ``enable_gqa``, only where
    the self-test proved that call on this device."""
    args = KernelArgs.of(kernel)

    def varlen_attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0,
                                 scaling: float | None = None, sliding_window: int | None = None, **kwargs):
        cu = kwargs.get("cu_seq_lens_q")
        if cu is None:
            from transformers.integrations.sdpa_attention import sdpa_attention_forward

            return sdpa_attention_forward(module, query, key, value, None, dropout=dropout, scaling=scaling,
                                          **kwargs)
        if dropout or sliding_window is not None:
            raise NotImplementedError(f"{VARLEN}: attention dropout and sliding windows are not supported; set "
                                      "model.attn_implementation=sdpa")
        batch, heads, length, dim = query.shape
        # (B, H, L, D) -> (B*L, H, D): the projections were viewed as (B, L, H, D), so this is usually free
        q, k, v = (t.transpose(1, 2).reshape(batch * length, t.shape[1], dim) for t in (query, key, value))
        extra = dict(args.causal)
        scale = scaling if scaling is not None else 1.0 / math.sqrt(dim)
        if args.scale:
            extra["scale"] = scale
        elif not math.isclose(scale, 1.0 / math.sqrt(dim)):
            q = q * (scale * math.sqrt(dim))  # the kernel's fixed 1/sqrt(D) then gives the model's scale
        if k.shape[1] != heads:
            if args.gqa:
                extra["enable_gqa"] = True  # K/V heads shared by their query group: no copy
            elif not grouped_kv:
                k, v = (t.repeat_interleave(heads // t.shape[1], dim=1) for t in (k, v))
        # the row width bounds every document: inside a compiled graph it is the query's (possibly symbolic) length
        max_q = kwargs.get("max_length_q") or length
        out = kernel(q, k, v, cu, kwargs.get("cu_seq_lens_k", cu), max_q, kwargs.get("max_length_k", max_q),
                     **extra)
        return out.reshape(batch, length, heads, dim), None

    return varlen_attention_forward


def register(kernel: Callable | None = None, grouped_kv: bool = False) -> str:
    """Register the varlen attention (torch's kernel unless ``kernel`` is given: the CPU tests pass
    ``reference_varlen``) with transformers; returns the name to load a model with. ``grouped_kv``: what the
    self-test proved (``SelfTest.grouped_kv``); unproven, a kernel without ``enable_gqa`` gets repeated K/V."""
    from transformers import AttentionInterface

    kernel = kernel or varlen_kernel()
    if kernel is None:
        raise RuntimeError(f"torch {torch.__version__} has no torch.nn.attention.varlen (torch >= 2.10)")
    AttentionInterface.register(VARLEN, make_forward(kernel, grouped_kv))
    _Registered.grouped_kv = grouped_kv
    return VARLEN


def reference_varlen(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None, window_size=(-1, -1),
                     enable_gqa=False):
    """torch 2.13's ``varlen_attn`` signature, computed segment by segment with SDPA: the kernel's stand-in on a CPU
    (it is CUDA-only) and the self-test's yardstick. Checks what the kernel assumes: equal q/k bounds and every
    segment within ``max_q``."""
    assert torch.equal(cu_seq_q, cu_seq_k) and max_q == max_k
    assert cu_seq_q.dtype == torch.int32 and int(cu_seq_q[-1]) == query.shape[0]
    causal = tuple(window_size) == (-1, 0)
    outs = []
    bounds = cu_seq_q.tolist()
    for a, b in zip(bounds, bounds[1:]):
        assert 0 <= b - a <= max_q, (a, b, max_q)
        if a == b:  # an empty document: the flat stream pads its bounds to a fixed length with these
            continue
        q, k, v = (t[a:b].transpose(0, 1) for t in (query, key, value))
        outs.append(F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale,
                                                   enable_gqa=enable_gqa).transpose(0, 1))
    return torch.cat(outs)


@dataclass
class SelfTest:
    ok: bool
    detail: str
    error: float | None = None
    grouped_kv: bool = False  # the proven call hands grouped K/V to the kernel as they are (no copies)


def self_test(device: str, dtype: torch.dtype, kernel: Callable | None = None) -> SelfTest:
    """Forward and backward of the registered glue with ``kernel`` (torch's by default) on packed rows of mixed
    lengths (grouped-query heads, padding, empty documents at the end of the bounds as the flat stream pads them),
    against fp32 math attention with the dense block-diagonal mask. A kernel without ``enable_gqa`` is tried with
    grouped K/V as they are first; where that fails, with K/V repeated (what the glue then does)."""
    kernel = kernel or varlen_kernel()
    if kernel is None:
        return SelfTest(False, f"torch {torch.__version__} has no torch.nn.attention.varlen (needs >= 2.10)")
    try:
        flag = KernelArgs.of(kernel).gqa
    except TypeError as exc:
        return SelfTest(False, f"TypeError: {exc}")
    grouped = self_test_call(device, dtype, kernel, grouped_kv=True)
    if flag:
        return grouped
    if grouped.ok:
        return SelfTest(True, f"{grouped.detail}; grouped K/V un-repeated (the kernel takes no enable_gqa)",
                        grouped.error, True)
    repeated = self_test_call(device, dtype, kernel, grouped_kv=False)
    return SelfTest(repeated.ok, f"{repeated.detail}; K/V repeated per query head (un-repeated they failed: "
                                 f"{grouped.detail})", repeated.error, False)


# Qwen2.5-0.5B's heads: 14 query heads share 2 K/V heads (a group of 7, not a power of two)
SELF_TEST_HEADS = (14, 2)


def self_test_call(device: str, dtype: torch.dtype, kernel: Callable, grouped_kv: bool) -> SelfTest:
    """One call of the self-test: grouped K/V un-repeated (``grouped_kv``; with ``enable_gqa`` where the kernel takes
    it) or repeated per query head. ``self_test`` picks; ``benchmarks/varlen_gqa.py`` reports both."""
    from rocktune.data.packing import cu_seq_lens

    rows = [[37, 5, 1, 20], [60, 3]]  # documents per row; the rest of each row of 72 is padding
    (heads, kv_heads), width, dim = SELF_TEST_HEADS, 72, 64
    cu = cu_seq_lens(rows, width)
    cu = torch.cat([cu, cu[-1:].expand(2)])  # empty trailing documents: how the flat stream fixes the bounds' length
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(len(rows), h, width, dim, generator=gen) for h in (heads, kv_heads, kv_heads))
    grad_out = torch.randn(len(rows), width, heads, dim, generator=gen)
    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal = heads // kv_heads, True
    try:
        forward = make_forward(kernel, grouped_kv)
        got = _out_and_grads(lambda a, b, c: forward(module, a, b, c, None, scaling=dim ** -0.5,
                                                     cu_seq_lens_q=cu.to(device), cu_seq_lens_k=cu.to(device),
                                                     max_length_q=width, max_length_k=width)[0],
                             (q, k, v), grad_out, device, dtype)
    except Exception as exc:  # noqa: BLE001 -- any failure of the kernel on this device is the finding
        return SelfTest(False, f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
    mask = _dense_mask(cu, len(rows), width)
    want = _out_and_grads(lambda a, b, c: F.scaled_dot_product_attention(
        a, b, c, attn_mask=mask, enable_gqa=True).transpose(1, 2), (q, k, v), grad_out, "cpu", torch.float32)
    real = _real_tokens(rows, width)
    errors = [float((g.cpu().float() - w).flatten(0, 1)[real].abs().max() / w.flatten(0, 1)[real].abs().max())
              for g, w in zip(_token_major(got), _token_major(want))]
    worst = max(errors)
    ok = worst <= SELF_TEST_TOL[dtype]
    what = ("output", "dq", "dk", "dv")[errors.index(worst)]
    return SelfTest(ok, f"varlen_attn {str(dtype).replace('torch.', '')} on {device}: worst relative error "
                        f"{worst:.2e} ({what}) vs fp32 math attention, tolerance {SELF_TEST_TOL[dtype]:.0e}", worst,
                    grouped_kv)


def _out_and_grads(fn, qkv, grad_out, device, dtype):
    leaves = [t.to(device, dtype).requires_grad_() for t in qkv]
    out = fn(*leaves)
    out.backward(grad_out.to(device, dtype))
    return [out.detach()] + [t.grad for t in leaves]


def _token_major(tensors):
    """Output (B, L, H, D) as is; gradients (B, H, L, D) to (B, L, H, D): rows of tokens first for masking."""
    return [tensors[0]] + [t.transpose(1, 2) for t in tensors[1:]]


def _dense_mask(cu: torch.Tensor, rows: int, width: int) -> torch.Tensor:
    """The (rows, 1, L, L) block-diagonal causal mask dense SDPA would use: the yardstick only."""
    seg = torch.zeros(rows * width, dtype=torch.long)
    cu = torch.unique(cu)  # empty documents add no bound
    seg[cu[1:-1].long()] = 1
    seg = seg.cumsum(0).view(rows, width)
    causal = torch.ones(width, width, dtype=torch.bool).tril()
    return ((seg[:, :, None] == seg[:, None, :]) & causal)[:, None]


def _real_tokens(rows: list[list[int]], width: int) -> torch.Tensor:
    """Flat (row, position) indices of document tokens: padding outputs differ by design and are never used."""
    return torch.tensor([r * width + i for r, docs in enumerate(rows) for i in range(sum(docs))])


def varlen_gate(device: str) -> None:
    """``model.attn_implementation=varlen`` where torch's kernel cannot run is the user's to change."""
    if device != "cuda" or varlen_kernel() is None:
        raise UserError(f"model.attn_implementation=varlen needs torch >= 2.10 and a ROCm/CUDA GPU (torch "
                        f"{torch.__version__}, device {device}); use auto or sdpa.")


def choose(setting: str, advised: str, device: str, feeding: tuple[bool, bool], dtype: torch.dtype,
           test: Callable = self_test) -> tuple[str, str | None]:
    """The attention implementation a run loads its model with, and the note that says why.

    ``setting``: ``model.attn_implementation``; ``advised``: what the platform advice resolved ``auto`` to (sdpa);
    ``feeding``: (rows are packed, the decoder is compiled). ``auto`` picks varlen on a GPU when its self-test passes
    (forward and backward against math attention, in the run's dtype); else flex attention with a document block mask
    where compile is on (transformers builds the mask inside the compiled graph: no host sync); else the advice.
    ``varlen`` is taken as given on a GPU (still registered, not tested)."""
    packed, compiled = feeding
    if setting == "varlen":
        varlen_gate(device)
        return register(), "attention: varlen_attn over the collate's document bounds (as set)"
    if setting != "auto":
        return setting, None
    if not packed:
        return advised, f"attention: {advised} (examples are padded per micro-batch, not packed: varlen not needed)"
    if device != "cuda":
        return advised, f"attention: {advised} (varlen_attn is CUDA/ROCm-only; packed rows get a block-diagonal mask)"
    result = test(device, dtype)
    if result.ok:
        return register(grouped_kv=result.grouped_kv), (f"attention: varlen_attn over the collate's document bounds "
                                                        f"(self-test: {result.detail})")
    if compiled:
        return FLEX, (f"attention: flex_attention with a document block mask (varlen self-test failed: "
                      f"{result.detail}; compile is on)")
    return advised, (f"attention: {advised} with a block-diagonal mask (varlen self-test failed: {result.detail}; "
                     "flex attention needs compile)")
