"""Numeric and transfer guards: catch NaNs, silent zeros and corrupted host-to-device copies."""

from __future__ import annotations

import math

import torch

DOCTOR_HINT = "run `rocktune doctor` to test this device's transfers, conversions and matmuls"


class RollbackRequired(RuntimeError):
    """Too many non-finite steps in a row: continue from the last checkpoint in a safer precision."""


class FatalNumerics(RuntimeError):
    """The run produces numbers that cannot be right; continuing would only waste time."""


class NumericGuard:
    def __init__(self, nan_patience: int, zero_patience: int):
        self.nan_patience, self.zero_patience = nan_patience, zero_patience
        self.nonfinite_in_row = self.zero_in_row = self.skipped_total = 0

    def check(self, step: int, loss: float, grad_norm: float) -> bool:
        """True when the update may be applied; False to skip it. Raises when skipping is not enough."""
        if not (math.isfinite(loss) and math.isfinite(grad_norm)):
            self.nonfinite_in_row += 1
            self.skipped_total += 1
            if self.nonfinite_in_row >= self.nan_patience:
                raise RollbackRequired(f"{self.nonfinite_in_row} steps in a row with a non-finite loss or gradient "
                                       f"(last at step {step})")
            return False
        self.nonfinite_in_row = 0
        self.zero_in_row = self.zero_in_row + 1 if (loss == 0.0 or grad_norm == 0.0) else 0
        if self.zero_in_row >= self.zero_patience:
            raise FatalNumerics(
                f"the loss or every gradient was exactly zero for {self.zero_in_row} steps in a row (step {step}). "
                "A real loss is never exactly zero: this is the signature of data arriving as zeros on the device, "
                "a precision conversion that flushes to zero, or a training path that computes no gradient (a "
                f"compiled graph: try training.compile=false); {DOCTOR_HINT} (with --model for the training path), "
                "and try training.precision=fp32."
            )
        return True


def verify_transfer(host: dict[str, torch.Tensor], device: dict[str, torch.Tensor], step: int) -> None:
    """Copy the device batch back and require it to equal the host batch bit for bit."""
    for key, value in host.items():
        back = device[key].to("cpu")
        if not torch.equal(back, value):
            bad = int((back != value).sum())
            raise FatalNumerics(f"step {step}: the device copy of the batch's {key} differs from the host in {bad} "
                                f"of {value.numel()} elements: host-to-device transfers are corrupting data; "
                                f"{DOCTOR_HINT}.")
