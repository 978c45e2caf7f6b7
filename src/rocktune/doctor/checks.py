"""Numerical self-tests: copies, dtype conversions, matmuls — each compared with a CPU reference.

Every check takes the operation under test as a parameter (``copy``, ``convert``, ``matmul``) so a test can inject
a faulty one and see the check fail. Device results are never trusted on their own: silent zeros and NaNs were
reported after copies, conversions and GEMMs on several archs (see knowledge.yaml).
This module imports only torch, so ``train.autoconf`` can run the bf16 checks without the rest of the doctor.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from rocktune.errors import first_line

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "int64": torch.int64,
          "uint8": torch.uint8}
_BITS = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}
# max |C - ref| / max |ref| for a k=256 matmul with fp32 accumulation; ~8x the rounding error of the output dtype
MATMUL_TOL = {torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 2e-2}


@dataclass
class CheckResult:
    name: str
    status: str  # pass | fail | skip
    detail: str = ""
    error: float | None = None  # the measured error (meaning given in detail)
    tolerance: float | None = None
    metrics: dict = field(default_factory=dict)
    seconds: float = 0.0


def default_copy(t: torch.Tensor, device: str, non_blocking: bool) -> torch.Tensor:
    return t.to(device, non_blocking=non_blocking, copy=True)


def default_convert(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t.to(dtype)


def default_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a @ b


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], CheckResult]) -> CheckResult:
    t0 = time.perf_counter()
    result = fn()
    result.seconds = round(time.perf_counter() - t0, 4)
    return result


def _sample(n: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Nonzero values, so a zero in the copy is always a corruption."""
    if dtype.is_floating_point:
        x = torch.randn(n, generator=gen)
        return (x + torch.sign(x) * 0.25).to(dtype)
    high = 256 if dtype == torch.uint8 else 2**40
    return torch.randint(1, high, (n,), generator=gen, dtype=dtype)


def _compare_bits(got: torch.Tensor, ref: torch.Tensor) -> tuple[int, int]:
    """(elements that differ bit for bit, of those the ones that became zero)."""
    bits = _BITS.get(ref.dtype)
    a, b = (got.view(bits), ref.view(bits)) if bits else (got, ref)
    diff = a != b
    zeros = diff & (got == 0) & (ref != 0)
    return int(diff.sum()), int(zeros.sum())


def check_transfer(device: str, pinned: bool, non_blocking: bool, sizes=(1, 4099, 1 << 18),
                   dtypes=("float32", "bfloat16", "float16", "int64", "uint8"), copy=default_copy) -> CheckResult:
    """host -> device -> host round trips; every element must come back bit for bit."""
    if pinned and not device.startswith("cuda"):
        return CheckResult("", "skip", "pinned memory needs a GPU")
    gen = torch.Generator().manual_seed(0)
    bad, zeroed, total, worst = 0, 0, 0, ""
    for dtype_name in dtypes:
        for n in sizes:
            src = _sample(n, DTYPES[dtype_name], gen)
            if pinned:
                src = src.pin_memory()
            on_dev = copy(src, device, non_blocking)
            back = copy(on_dev, "cpu", False)
            sync(device)
            diff, zeros = _compare_bits(back, src)
            bad, zeroed, total = bad + diff, zeroed + zeros, total + n
            if diff and not worst:
                worst = f"{dtype_name}[{n}]"
    if bad:
        return CheckResult("", "fail", f"{bad} of {total} elements corrupted ({zeroed} became zero), first in {worst}",
                           bad / total, 0.0)
    return CheckResult("", "pass", f"{total} elements in {len(dtypes)} dtypes x {len(sizes)} sizes bit-exact",
                       0.0, 0.0)


def _conversion_input(src: torch.dtype, dst: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    # sign * [1, 2) * 2**e with e inside the normal range of both formats (no subnormals: their handling may
    # legitimately differ), plus exact zeros and small integers
    narrow = torch.float16 in (src, dst)
    exps = torch.arange(-13, 15) if narrow else torch.arange(-60, 61, 4)
    mant = 1.0 + torch.rand(len(exps), 64, generator=gen)
    sign = torch.randint(0, 2, mant.shape, generator=gen) * 2.0 - 1.0
    vals = (sign * mant * torch.exp2(exps.float())[:, None]).flatten()
    return torch.cat([vals, torch.tensor([0.0, -0.0, 1.0, -1.0, 0.5, 3.0])]).to(src)


def check_conversion(device: str, src: str, dst: str, convert=default_convert) -> CheckResult:
    """Convert on the device and compare bit for bit with the CPU's round-to-nearest-even conversion."""
    s, d = DTYPES[src], DTYPES[dst]
    x = _conversion_input(s, d, torch.Generator().manual_seed(1))
    ref = x.to(d)
    got = convert(x.to(device), d).to("cpu")
    sync(device)
    if got.dtype != d or got.shape != ref.shape:
        return CheckResult("", "fail", f"conversion returned {got.dtype} {tuple(got.shape)}", 1.0, 0.0)
    diff, zeros = _compare_bits(got, ref)
    if diff:
        return CheckResult("", "fail", f"{diff} of {ref.numel()} values differ from the CPU ({zeros} flushed to zero)",
                           diff / ref.numel(), 0.0)
    return CheckResult("", "pass", f"{ref.numel()} values bit-exact with the CPU", 0.0, 0.0)


def check_matmul(device: str, dtype: str, m: int = 192, k: int = 256, n: int = 160,
                 matmul=default_matmul) -> CheckResult:
    """``a @ b`` in ``dtype`` on the device against an fp64 CPU product of the same (rounded) inputs."""
    dt = DTYPES[dtype]
    gen = torch.Generator().manual_seed(2)
    a, b = torch.randn(m, k, generator=gen).to(dt), torch.randn(k, n, generator=gen).to(dt)
    ref = a.double() @ b.double()
    try:
        got = matmul(a.to(device), b.to(device)).to("cpu").double()
        sync(device)
    except RuntimeError as exc:  # e.g. HIPBLAS_STATUS_NOT_SUPPORTED, or no kernel for this dtype
        return CheckResult("", "fail", f"{type(exc).__name__}: {first_line(exc)}")
    tol = MATMUL_TOL[dt]
    if not torch.isfinite(got).all():
        return CheckResult("", "fail", f"{int((~torch.isfinite(got)).sum())} non-finite outputs", float("inf"), tol)
    err = float((got - ref).abs().max() / ref.abs().max())
    zeros = int(((got == 0) & (ref != 0)).sum())
    status = "pass" if err <= tol else "fail"
    detail = f"{m}x{k}x{n}: max error {err:.2e} of max |C| (tolerance {tol:.0e})"
    return CheckResult("", status, detail + (f"; {zeros} zeros" if zeros else ""), err, tol)
