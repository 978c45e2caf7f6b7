"""The memory budget: parsed from the user's figure, or read from the machine without initialising a GPU."""

from __future__ import annotations

import glob
import os
import re
import shutil
import subprocess
import sys

from rocktune.errors import UserError

_UNITS = {"": 2**30, "b": 1, "k": 2**10, "kib": 2**10, "kb": 10**3, "m": 2**20, "mib": 2**20, "mb": 10**6,
          "g": 2**30, "gib": 2**30, "gb": 10**9, "t": 2**40, "tib": 2**40, "tb": 10**12}


def parse_budget(text: str) -> int:
    """``32GiB``, ``32G`` and ``32`` are 32 x 2^30 bytes; ``32GB`` is 32 x 10^9 (as in ``df -H``)."""
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS or float(m.group(1)) <= 0:
        raise UserError(f"cannot read the memory budget {text!r}: write a positive number with a unit, e.g. 32GiB, "
                        "24GB, 16G or 12000MiB.")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def detect_budget() -> tuple[int, str, str]:
    """(bytes, "gpu" | "cpu", where the figure came from). Reads torch only if the caller already imported it."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        return props.total_memory, "gpu", (f"{props.name} (torch; on an APU this is only the carve-out: "
                                           "pass --vram with the memory you can give it)")
    amd = [_read_int(p) for p in glob.glob("/sys/class/drm/card*/device/mem_info_vram_total")]
    if any(amd):
        return max(amd), "gpu", "AMD GPU VRAM from sysfs (on an APU only the carve-out: pass --vram)"
    if shutil.which("nvidia-smi"):
        try:
            res = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                                 capture_output=True, text=True, timeout=5)
            mib = [int(x) for x in res.stdout.split() if x.isdigit()]
            if mib:
                return max(mib) * 2**20, "gpu", "NVIDIA GPU memory from nvidia-smi"
        except (OSError, subprocess.SubprocessError):
            pass
    if not hasattr(os, "sysconf"):  # Windows: no portable RAM query without extra packages
        raise UserError("no GPU memory size could be detected; pass the budget with --vram (e.g. --vram 16GiB).")
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return ram, "cpu", "no GPU found: the budget is system RAM (training would run on the CPU)"


def _read_int(path: str) -> int:
    try:
        with open(path) as fh:
            return int(fh.read().strip())
    except (OSError, ValueError):
        return 0


def parse_size(text: str, flag: str) -> tuple[int, int]:
    """``WIDTHxHEIGHT`` of a plan's ``flag`` (Wan's --resolution, a VLM's --image-size)."""
    import re

    match = re.fullmatch(r"\s*(\d+)\s*[xX]\s*(\d+)\s*", text)
    if match is None:
        raise UserError(f"{flag} {text!r}: write WIDTHxHEIGHT, e.g. 832x480.")
    return int(match[1]), int(match[2])
