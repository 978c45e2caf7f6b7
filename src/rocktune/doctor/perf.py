"""Measured throughput: matmul TFLOP/s and copy GB/s. Reported as measured, never assumed."""

from __future__ import annotations

import time

import torch

from rocktune.doctor.checks import DTYPES, CheckResult, sync


def _best_seconds(fn, device: str, reps: int) -> float:
    fn()
    sync(device)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync(device)
        best = min(best, time.perf_counter() - t0)
    return best


def perf_matmul(device: str, dtype: str, n: int | None = None, reps: int = 5) -> CheckResult:
    dt = DTYPES[dtype]
    gpu = device.startswith("cuda")
    if not gpu and dt != torch.float32:
        return CheckResult("", "skip", "low-precision CPU matmuls are not a training path")
    n = n or (4096 if gpu else 512)
    a, b = torch.randn(n, n, device=device, dtype=dt), torch.randn(n, n, device=device, dtype=dt)
    secs = _best_seconds(lambda: a @ b, device, reps)
    tflops = 2 * n**3 / secs / 1e12
    return CheckResult("", "pass", f"{tflops:.2f} TFLOP/s ({n}x{n}x{n}, best of {reps})", None, None,
                       {"tflops": float(f"{tflops:.4g}"), "n": n, "seconds": secs})


def perf_copy(device: str, direction: str, pinned: bool, mib: int | None = None, reps: int = 5) -> CheckResult:
    """GB/s of host->device (h2d), device->host (d2h), or on the CPU a host memcpy (direction 'host')."""
    gpu = device.startswith("cuda")
    if pinned and not gpu:
        return CheckResult("", "skip", "pinned memory needs a GPU")
    if direction != "host" and not gpu:
        return CheckResult("", "skip", "no device to copy to")
    mib = mib or (256 if gpu else 64)
    nbytes = mib * 2**20
    host = torch.empty(nbytes, dtype=torch.uint8)
    host = host.pin_memory() if pinned else host
    if direction == "host":
        dst = torch.empty_like(host)
        secs = _best_seconds(lambda: dst.copy_(host), device, reps)
    elif direction == "h2d":
        dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
        secs = _best_seconds(lambda: dev.copy_(host, non_blocking=pinned), device, reps)
    else:
        dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
        secs = _best_seconds(lambda: host.copy_(dev, non_blocking=pinned), device, reps)
    gbs = nbytes / secs / 1e9
    return CheckResult("", "pass", f"{gbs:.1f} GB/s ({mib} MiB, best of {reps})", None, None,
                       {"gb_per_s": float(f"{gbs:.4g}"), "bytes": nbytes, "seconds": secs})
