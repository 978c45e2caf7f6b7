"""Running out of memory, in one place below both the step that catches it and the fault hooks that raise it in
tests: the device's OOM error type, and the test that tells any out-of-memory failure (GPU or CPU) from other
errors, so that every device takes the same path — split the step, then a clear stop."""

from __future__ import annotations

import re

import torch

from rocktune.errors import first_line

# torch.OutOfMemoryError appeared in torch 2.5; gfx906 users run 2.4.1, where only the cuda alias exists.
DEVICE_OOM = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)

# What an allocation failure looks like when it is not DEVICE_OOM: torch's CPU allocator under an address-space or
# cgroup limit ("DefaultCPUAllocator: can't allocate memory" / "not enough memory"), a C++ std::bad_alloc passed up
# as RuntimeError, and a device runtime's own allocation failures outside the caching allocator (cuBLAS/hipBLAS
# workspaces, "CUDA error: out of memory").
_OOM_TEXT = re.compile(r"can't allocate memory|not enough memory|std::bad_alloc|Cannot allocate memory|"
                       r"(CUDA|HIP) error: out of memory|hipErrorOutOfMemory|cudaErrorMemoryAllocation|"
                       r"(CUBLAS|HIPBLAS|ROCBLAS)_STATUS_ALLOC_FAILED", re.IGNORECASE)


def is_out_of_memory(exc: BaseException) -> bool:
    """True for a failed allocation on any device: DEVICE_OOM, Python's MemoryError, or a RuntimeError whose
    message is an allocator's."""
    if isinstance(exc, (DEVICE_OOM, MemoryError)):
        return True
    return isinstance(exc, RuntimeError) and bool(_OOM_TEXT.search(str(exc)))


def describe(exc: BaseException) -> str:
    """One line that says it was memory and, where the allocator said it, how much was asked for."""
    text = first_line(exc) if str(exc).strip() else ""
    if not text:  # a bare MemoryError from Python's own allocator says nothing more
        return f"out of memory ({type(exc).__name__})"
    return text if re.search(r"memory", text, re.IGNORECASE) else f"out of memory: {text}"
