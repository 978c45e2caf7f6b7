"""glibc's malloc on a CPU run: freed memory is kept for the next step instead of going back to the kernel.

A training step allocates and frees the same activations, gradients and logits every time. torch's CPU allocator
takes them from malloc and caches nothing; glibc serves a block above its mmap threshold (128 KiB at first, raised
as such blocks are freed) with a fresh mapping that it unmaps on free, and returns the heap's free top to the kernel
above its trim threshold. Every step then faults in and zeroes those pages again: 600 to 4,600 minor page faults per
step of the GRPO bench's update here (docs/speed.md). ``M_MMAP_THRESHOLD`` at glibc's documented maximum for 64-bit
(32 MiB) and ``M_TRIM_THRESHOLD`` at 1 GiB keep them in the heap: 0 to 120 faults per step, and the memory a step
frees is the next step's. A process's peak is unchanged (its largest step is what it holds either way); what
changes is that the heap is not shrunk between steps, which a training process would grow back at once.

Linux with glibc only (``mallopt`` through ctypes); elsewhere, or with ``ROCKTUNE_MALLOC=0``, nothing is changed.
GPU runs leave it alone: their activations are on the device. The setting is the whole process's and cannot be
undone, so only a process that exists to train sets it (``RunOptions.own_process``: the CLI's worker), never a
``train()`` called inside someone else's program or test session.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's malloc.h
MMAP_THRESHOLD = 32 * 2**20  # glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit: the largest it accepts
TRIM_THRESHOLD = 2**30
SWITCH = "ROCKTUNE_MALLOC"


def keep_freed_memory(environ=None) -> str | None:
    """Set glibc's thresholds (module docstring); returns the run's note, None when nothing was changed."""
    environ = os.environ if environ is None else environ
    if environ.get(SWITCH) == "0" or platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        done = libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and libc.mallopt(M_TRIM_THRESHOLD,
                                                                                   TRIM_THRESHOLD) == 1
    except (OSError, AttributeError):
        return None
    if not done:
        return None
    return (f"CPU memory: glibc keeps what a step frees for the next (mallopt: mmap threshold "
            f"{MMAP_THRESHOLD // 2**20} MiB, trim threshold {TRIM_THRESHOLD // 2**20} MiB; {SWITCH}=0 leaves malloc "
            "alone)")
