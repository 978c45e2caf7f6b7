"""Memory the training process holds after a step, for every metrics line: a long run whose memory creeps up shows
it in ``rocktune report`` (memory over steps) long before it runs out. On a CPU that is the process's resident set;
on CUDA/ROCm what the caching allocator holds for live tensors (allocated) and has taken from the device (reserved):
fragmentation shows as reserved pulling away from allocated while allocated stays flat."""

from __future__ import annotations

import os

import torch


def held(device: str) -> dict[str, int]:
    """The metrics keys for this step: ``mem_allocated_bytes``/``mem_reserved_bytes`` on a GPU, ``rss_bytes`` on a
    CPU (absent where the platform gives no cheap way to read it)."""
    if device == "cuda":
        return {"mem_allocated_bytes": torch.cuda.memory_allocated(),
                "mem_reserved_bytes": torch.cuda.memory_reserved()}
    rss = resident_bytes()
    return {"rss_bytes": rss} if rss else {}


def resident_bytes() -> int:
    """This process's resident set now (not its peak): psutil where installed, else Linux's /proc."""
    try:
        import psutil
    except ImportError:
        try:
            with open("/proc/self/statm", encoding="ascii") as f:
                return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError, IndexError, AttributeError):
            return 0
    return psutil.Process().memory_info().rss
