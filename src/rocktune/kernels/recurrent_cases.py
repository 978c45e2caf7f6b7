"""The self-test inputs of each recurrent-layer kernel: small random tensors shaped, typed and passed exactly as
transformers' layer forwards pass them (transformers 5: ``modeling_qwen3_5.Qwen3_5GatedDeltaNet.forward``,
``modeling_granitemoehybrid.GraniteMoeHybridMambaLayer.forward``), so a kernel is tried on the call that training
and generation make: the same positional and keyword arguments, non-contiguous views where the forward hands views,
fp32 where the forward computes in fp32 (the decay ``g``, ``A``, the recurrent states).

Keyed by transformers' kernel name (``use_kernel_func_from_hub_with_fallback``'s ``func_name``). A kernel that has
no case here is never used: it cannot be proven.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class Dims:
    """The layer's sizes the inputs take (a model's own, read from its first layer of the kind, or these: small
    Qwen3.5- and Granite 4-like heads). ``length`` crosses Gated DeltaNet's chunk of 64 and is no multiple of it;
    Mamba2's scan takes two of its chunks and a part."""

    batch: int = 2
    length: int = 80
    k_heads: int = 2  # Gated DeltaNet: query/key heads, grouped under the value heads
    v_heads: int = 4
    k_dim: int = 128
    v_dim: int = 128
    conv_width: int = 4
    heads: int = 8  # Mamba2
    head_dim: int = 64
    groups: int = 1
    state: int = 128
    chunk: int = 256
    channels: int = 0  # the short convolution's (0: Gated DeltaNet's q, k and v)

    # the layer attributes each size is read from (transformers 5's names; a missing one keeps the default)
    FROM_LAYER = {"k_heads": "num_k_heads", "v_heads": "num_v_heads", "k_dim": "head_k_dim", "v_dim": "head_v_dim",
                  "conv_width": "conv_kernel_size", "heads": "num_heads", "head_dim": "head_dim",
                  "groups": "n_groups", "state": "ssm_state_size", "chunk": "chunk_size",
                  "channels": "conv_dim"}

    @classmethod
    def of(cls, layer: torch.nn.Module) -> Dims:
        return cls(**{f: getattr(layer, a) for f, a in cls.FROM_LAYER.items()
                      if isinstance(getattr(layer, a, None), int)})


@dataclass
class Case:
    """One call: ``call(fn, inputs)`` calls a kernel as the layer does; ``outputs(result, inputs)`` names what is
    compared (a state the kernel updates in place is read back from ``inputs``); the gradients of ``grads`` (inputs,
    by name) are compared too, from a backward of the differentiable outputs against fixed random weights."""

    inputs: dict[str, Any]
    call: Callable[[Callable, dict], Any]
    outputs: Callable[[Any, dict], dict[str, torch.Tensor]]
    grads: tuple[str, ...] = ()
    differentiable: tuple[str, ...] = ("out",)


def _randn(gen: torch.Generator, *shape: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=gen) * scale


def _uniform(gen: torch.Generator, low: float, high: float, *shape: int) -> torch.Tensor:
    return torch.rand(*shape, generator=gen) * (high - low) + low


def _gdn_inputs(d: Dims, dtype: torch.dtype, gen: torch.Generator, length: int) -> dict:
    """q/k/v after the short convolution's SiLU, beta a sigmoid in the model's dtype, the decay g in fp32 and <= 0
    (``-exp(A_log) * softplus(a + dt_bias)``, A in Qwen3.5's initial range)."""
    b = d.batch
    q, k = (F.silu(_randn(gen, b, length, d.k_heads, d.k_dim)).to(dtype) for _ in range(2))
    v = F.silu(_randn(gen, b, length, d.v_heads, d.v_dim)).to(dtype)
    g = -_uniform(gen, 0.01, 16, d.v_heads) * F.softplus(_randn(gen, b, length, d.v_heads) + 1.0)
    beta = torch.sigmoid(_randn(gen, b, length, d.v_heads)).to(dtype)
    return {"x": q, "k": k, "v": v, "g": g, "beta": beta}


def chunk_gated_delta_rule(d: Dims, dtype: torch.dtype, gen: torch.Generator) -> Case:
    """Training's and prefill's call, with the final state asked for (prefill fills the cache with it)."""
    return Case(_gdn_inputs(d, dtype, gen, d.length),
                lambda fn, i: fn(i["x"], i["k"], i["v"], g=i["g"], beta=i["beta"], initial_state=None,
                                 output_final_state=True, use_qk_l2norm_in_kernel=True),
                lambda r, i: {"out": r[0], "state": r[1]}, grads=("x", "k", "v", "g", "beta"))


def fused_recurrent_gated_delta_rule(d: Dims, dtype: torch.dtype, gen: torch.Generator) -> Case:
    """Generation's one-token step from a cached fp32 state."""
    inputs = {**_gdn_inputs(d, dtype, gen, 1), "state": _randn(gen, d.batch, d.v_heads, d.k_dim, d.v_dim, scale=0.1)}
    return Case(inputs, lambda fn, i: fn(i["x"], i["k"], i["v"], g=i["g"], beta=i["beta"], initial_state=i["state"],
                                         output_final_state=True, use_qk_l2norm_in_kernel=True),
                lambda r, i: {"out": r[0], "state": r[1]})


def _channels(d: Dims) -> int:
    """The convolved channels: the layer's own, else Gated DeltaNet's q, k and v."""
    return d.channels or 2 * d.k_heads * d.k_dim + d.v_heads * d.v_dim


def causal_conv1d_fn(d: Dims, dtype: torch.dtype, gen: torch.Generator) -> Case:
    """The projection's output transposed to (batch, channels, length), a strided view as the forward hands it; with
    a bias (Granite 4's; Qwen3.5's convolution has none) and SiLU."""
    c = _channels(d)
    inputs = {"x": _randn(gen, d.batch, d.length, c).to(dtype), "weight": _randn(gen, c, d.conv_width, scale=0.3
                                                                                 ).to(dtype),
              "bias": _randn(gen, c, scale=0.1).to(dtype)}
    return Case(inputs, lambda fn, i: fn(i["x"].transpose(1, 2), i["weight"], i["bias"], activation="silu"),
                lambda r, i: {"out": r}, grads=("x", "weight", "bias"))


def causal_conv1d_update(d: Dims, dtype: torch.dtype, gen: torch.Generator) -> Case:
    """Generation's one-token step: the cached window (as wide as the kernel) is updated in place."""
    c = _channels(d)
    inputs = {"x": _randn(gen, d.batch, 1, c).to(dtype), "state": _randn(gen, d.batch, c, d.conv_width).to(dtype),
              "weight": _randn(gen, c, d.conv_width, scale=0.3).to(dtype), "bias": _randn(gen, c, scale=0.1).to(dtype)}
    return Case(inputs, lambda fn, i: fn(i["x"].transpose(1, 2), i["state"], i["weight"], i["bias"], "silu"),
                lambda r, i: {"out": r, "state": i["state"]})


def _mamba_params(d: Dims, dtype: torch.dtype, gen: torch.Generator) -> dict:
    """A = -exp(A_log) in fp32 (Granite 4 initialises A_log to log(1..heads)); D and dt_bias are parameters in the
    model's dtype."""
    return {"A": -_uniform(gen, 1, d.heads, d.heads), "D": _uniform(gen, 0.5, 1.5, d.heads).to(dtype),
            "dt_bias": _randn(gen, d.heads, scale=0.5).to(dtype)}


def mamba_chunk_scan_combined(d: Dims, dtype: torch.dtype, gen: torch.Generator) -> Case:
    """Training's and prefill's scan, dt raw (softplus of dt + dt_bias inside), the final state asked for; two
    chunks and a part, so the inter-chunk recurrence and the padding are both exercised."""
    b, n = d.batch, 2 * d.chunk + 5
    inputs = {"x": _randn(gen, b, n, d.heads, d.head_dim).to(dtype), "dt": _randn(gen, b, n, d.heads).to(dtype),
              "B": _randn(gen, b, n, d.groups, d.state).to(dtype), "C": _randn(gen, b, n, d.groups, d.state).to(dtype),
              **_mamba_params(d, dtype, gen)}
    return Case(inputs, lambda fn, i: fn(i["x"], i["dt"], i["A"], i["B"], i["C"], chunk_size=d.chunk, D=i["D"],
                                         z=None, return_final_states=True, dt_bias=i["dt_bias"], dt_softplus=True,
                                         initial_states=None, dt_limit=(0.0, float("inf"))),
                lambda r, i: {"out": r[0], "state": r[1]}, grads=("x", "dt", "A", "B", "C", "D", "dt_bias"))


def selective_state_update(d: Dims, dtype: torch.dtype, gen: torch.Generator) -> Case:
    """Generation's one-token step; dt, A, D and dt_bias broadcast over the head dimension by ``expand`` (stride 0),
    as the forward passes them; the fp32 state is updated in place."""
    b, p = d.batch, d.head_dim
    inputs = {"state": _randn(gen, b, d.heads, p, d.state, scale=0.1), "x": _randn(gen, b, d.heads, p).to(dtype),
              "dt": _randn(gen, b, 1, d.heads).to(dtype), "B": _randn(gen, b, d.groups, d.state).to(dtype),
              "C": _randn(gen, b, d.groups, d.state).to(dtype), **_mamba_params(d, dtype, gen)}
    return Case(inputs, lambda fn, i: fn(i["state"], i["x"], i["dt"].transpose(1, 2).expand(-1, -1, p),
                                         i["A"][:, None, None].expand(-1, p, d.state), i["B"], i["C"],
                                         i["D"][:, None].expand(-1, p), z=None,
                                         dt_bias=i["dt_bias"][:, None].expand(-1, p), dt_softplus=True),
                lambda r, i: {"out": r, "state": i["state"]})


CASES: dict[str, Callable[[Dims, torch.dtype, torch.Generator], Case]] = {
    f.__name__: f for f in (chunk_gated_delta_rule, fused_recurrent_gated_delta_rule, causal_conv1d_fn,
                            causal_conv1d_update, mamba_chunk_scan_combined, selective_state_update)}
# the positional argument whose device and dtype a layer's kernel choice is keyed by (0 unless named): the
# activations, since a generation step's recurrent state is fp32 whatever the model's dtype
KEY_ARG = {"selective_state_update": 1}
