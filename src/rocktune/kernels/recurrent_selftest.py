"""A recurrent-layer kernel against transformers' torch reference on the device: the same inputs
(``recurrent_cases``), forward and backward, each output, in-place state and input gradient compared.

The error is the relative RMS difference ``||fast - ref|| / ||ref||`` (flash-linear-attention's own tests judge
its kernels by this ratio): a kernel that rounds elsewhere stays far below the tolerance, a wrong one (another
formula, a lost term, a gradient that never arrives) lands near 1 or above.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from rocktune.kernels.recurrent_cases import CASES, Case, Dims

# The reference computes in fp32 from the same rounded inputs. fp32: Triton's dots round their inputs to TF32
# (10-bit mantissa). bf16/fp16: the kernels multiply in the half type and round their outputs to it (bf16: ~1e-3 of
# this ratio per rounding), and the backward's chained products (the decay's gradient) lose a few times that;
# flash-linear-attention's own tests hold its bf16 outputs to 5e-3 of this ratio and its gradients to 2e-2. Not yet
# measured on a GPU here. A wrong kernel is off by tens of percent (the tests' perturbations: 5-50%).
TOLERANCE = {torch.float32: 5e-3, torch.bfloat16: 3e-2, torch.float16: 2e-2}


@dataclass(frozen=True)
class Verdict:
    ok: bool
    detail: str  # what was compared and the error, or the exception
    error: float | None = None  # the worst relative error (inf: not finite); None: the kernel raised


def _name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def self_test(kernel: str, fast: Callable, reference: Callable, device: str, dtype: torch.dtype,
              dims: Dims | None = None) -> Verdict:
    """``fast`` against ``reference`` (both called as the layer calls transformers' function ``kernel``) on
    ``device`` in ``dtype``. ``dims``: the model's sizes (``Dims.of`` its layer), else small default heads."""
    dims = dims or Dims()
    try:
        got = _run(fast, CASES[kernel](dims, dtype, torch.Generator().manual_seed(0)), device)
    except Exception as exc:  # noqa: BLE001 -- any failure of the kernel on this device is the finding
        first = str(exc).splitlines()[0] if str(exc) else ""
        return Verdict(False, f"{type(exc).__name__}: {first}")
    try:
        want = _run(reference, CASES[kernel](dims, dtype, torch.Generator().manual_seed(0)), device)
    except Exception as exc:  # noqa: BLE001 -- out of memory beside the model, say: nothing is proven
        first = str(exc).splitlines()[0] if str(exc) else ""
        return Verdict(False, f"the reference itself failed, so nothing is proven: {type(exc).__name__}: {first}")
    errors = {name: _error(got.get(name), w) for name, w in want.items()}
    worst_name = max(errors, key=lambda n: errors[n])
    worst, tol = errors[worst_name], TOLERANCE[dtype]
    return Verdict(worst <= tol, f"relative error {worst:.1e} ({worst_name}) against transformers' torch reference "
                                 f"on {device} in {_name(dtype)}, tolerance {tol:.0e}", worst)


def _run(fn: Callable, case: Case, device: str) -> dict[str, torch.Tensor]:
    """Outputs, states and input gradients of one call, as fp32 on the CPU, by name (``d<input>`` a gradient)."""
    inputs = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in case.inputs.items()}
    for name in case.grads:
        inputs[name] = inputs[name].detach().requires_grad_()
    with torch.enable_grad() if case.grads else torch.no_grad():
        outputs = case.outputs(case.call(fn, inputs), inputs)
        found = {k: v.detach().float().cpu() for k, v in outputs.items()}
        if case.grads:
            gen = torch.Generator().manual_seed(1)
            loss = sum((outputs[k].float() * torch.randn(outputs[k].shape, generator=gen).to(device)).sum()
                       for k in case.differentiable)
            grads = torch.autograd.grad(loss, [inputs[n] for n in case.grads], allow_unused=True)
            found |= {f"d{n}": (g if g is not None else torch.zeros_like(inputs[n])).detach().float().cpu()
                      for n, g in zip(case.grads, grads)}
    return found


def _error(got: torch.Tensor | None, want: torch.Tensor) -> float:
    """Relative RMS difference; a missing, misshapen or non-finite result is infinitely wrong, a zero reference is
    compared absolutely."""
    if got is None or got.shape != want.shape or not bool(torch.isfinite(got).all()):
        return float("inf")
    scale = float(want.norm())
    return float((got - want).norm()) / (scale if scale > 0 else 1.0)
