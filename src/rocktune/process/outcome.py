"""What a supervised child tells its supervisor beyond an exit status: whether it got past start-up (finished an
optimizer step) and, when it failed with an exception, the cause in one line. A signal leaves no words, so the file
is written when the first step completes and again on a failure; the supervisor reads it after each attempt.

The supervisor restarts only what a restart can fix: signals (the OOM killer, a segfault in a driver), device faults
and out-of-memory errors. An exception before the first step that is not a device fault is deterministic — the same
input meets the same code — and so is any failure that repeats identically before the first step.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

# Messages of device faults that a fresh process may not meet again (HIP/CUDA runtime errors, collective timeouts).
DEVICE_FAULT = re.compile(r"CUDA error|HIP error|hipError|cudaError|illegal memory access|memory access fault|"
                          r"HIPBLAS|CUBLAS|NCCL|RCCL|out of memory|can't allocate memory|AcceleratorError",
                          re.IGNORECASE)


class Report:
    """The child's side; every method is a no-op without a path (``rocktune train --no-supervise``)."""

    def __init__(self, path: str | None):
        self.path = Path(path) if path else None
        self.stepped = False

    def step_done(self) -> None:
        if not self.stepped:
            self.stepped = True
            self._write({"stepped": True})

    def failed(self, cause: str, unanswered: tuple[int, ...] = ()) -> None:
        """``unanswered``: ranks that stopped answering (a hang another rank noticed), for the incident log."""
        data = {"stepped": self.stepped, "cause": cause}
        self._write({**data, "unanswered": list(unanswered)} if unanswered else data)

    def _write(self, data: dict) -> None:
        if self.path is not None:
            try:
                self.path.write_text(json.dumps(data), encoding="utf-8")
            except OSError:
                pass  # a full disk, most likely: the exit status still says enough


def read(path: Path) -> dict:
    """The supervisor's side: what the last attempt reported ({} when it wrote nothing)."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}


def device_fault(exc: BaseException) -> bool:
    return bool(DEVICE_FAULT.search(f"{type(exc).__name__}: {exc}"))
