"""Fault injection for the reliability tests. Only tests set ``ROCKTUNE_FAULTS``; without it nothing here acts.

``ROCKTUNE_FAULTS`` holds JSON such as ``{"kill_at_step": 7}``. Keys:
  kill_at_step      SIGKILL this process after that optimizer step's update, before anything else is written
  oom_at_step       raise a device out-of-memory error in that step (once per process; every time with
                    "oom_repeat": true), at its forward number "oom_at_forward" (default 1)
  nan_at_steps      make the loss of those steps NaN
  zero_loss         make every loss exactly zero (the seeds' silent-zeros failure)
  overflow_at_step  scale that step's loss by 1e30: finite in fp32, its fp16 gradients overflow (GradScaler's case)
  corrupt_transfer_at_step   perturb one element of that step's device copy of the batch
  fail_checkpoint_at_step    make writing that step's checkpoint fail as a full disk would ("fail_checkpoint_kind":
                    "runtime" raises the RuntimeError torch.save gives instead of OSError)
  fail_final_write  make the final adapter write fail as a full disk would (OSError ENOSPC)
  startup_error     raise a RuntimeError in the supervised worker before training starts (a deterministic crash)
  slow_steps        sleep that many seconds in every step (gives a test time to interrupt a run)
  kill_at           "PHASE[:N]": SIGKILL at the N-th pass through that phase of a write (rocktune/atomic.py's
                    PHASES: checkpoint, final adapter, Wan LoRA file, export), read by ``atomic.kill_point``
  rank              several processes: only that rank (torchrun's RANK) injects the faults
  marker            a file path: faults act only while it does not exist, and the first one to act creates it,
                    so a restarted process runs clean (a crash that happens once)
Several processes (read by train/distributed.py through ``hang_here`` and ``junk_all_reduce``, whatever "rank" says):
  hang              "RANK@POINT" (POINT: preflight | step:N): that rank stops answering there, as a hung GPU or
                    driver would (once, with "marker")
  junk_all_reduce_rank   that rank adds junk to the preflight's test all-reduce (a collective returning wrong values)

This is the one list: no other variable injects a fault. What tells the supervisor that the first step completed is
not a fault hook (``train(..., on_step_done=)``).
"""

from __future__ import annotations

import errno
import json
import os
import signal
import time

import torch


class Faults:
    def __init__(self, spec: dict | None = None):
        self.spec = spec if spec is not None else json.loads(os.environ.get("ROCKTUNE_FAULTS", "{}"))
        self._oom_fired = False
        self._forwards: dict[int, int] = {}
        marker = self.spec.get("marker")
        if marker and os.path.exists(marker):
            self.spec = {}
        if "rank" in self.spec and str(self.spec["rank"]) != os.environ.get("RANK", "0"):
            self.spec = {}  # several processes: the fault belongs to one rank

    def _fire(self) -> None:
        marker = self.spec.get("marker")
        if marker:
            open(marker, "w").close()

    def after_update(self, step: int) -> None:
        if self.spec.get("kill_at_step") == step:
            self._fire()
            os.kill(os.getpid(), signal.SIGKILL)

    def before_forward(self, step: int) -> None:
        from rocktune.train.oom import DEVICE_OOM

        n = self._forwards[step] = self._forwards.get(step, 0) + 1
        if self.spec.get("oom_at_step") != step or (self._oom_fired and not self.spec.get("oom_repeat")):
            return
        if n >= self.spec.get("oom_at_forward", 1):
            self._oom_fired = True
            self._fire()
            raise DEVICE_OOM("injected out-of-memory (ROCKTUNE_FAULTS)")

    def loss(self, step: int, loss_sum: torch.Tensor) -> torch.Tensor:
        if step in self.spec.get("nan_at_steps", ()):
            if step == max(self.spec["nan_at_steps"]):
                self._fire()
            return loss_sum * float("nan")
        if self.spec.get("zero_loss"):
            return loss_sum * 0.0
        if self.spec.get("overflow_at_step") == step:
            return loss_sum * 1e30
        return loss_sum

    def transfer(self, step: int, tensor: torch.Tensor) -> torch.Tensor:
        if self.spec.get("corrupt_transfer_at_step") == step:
            tensor = tensor.clone()
            tensor.view(-1)[0] += 1
        return tensor

    def checkpoint_write(self, step: int) -> None:
        if self.spec.get("fail_checkpoint_at_step") == step:
            if self.spec.get("fail_checkpoint_kind") == "runtime":  # what torch.save raises on a full disk
                raise RuntimeError("PytorchStreamWriter failed writing file data/0: file write failed (injected)")
            raise OSError(errno.ENOSPC, "No space left on device (injected)")

    def final_write(self) -> None:
        if self.spec.get("fail_final_write"):
            self._fire()
            raise OSError(errno.ENOSPC, "No space left on device (injected)")

    def startup(self) -> None:
        if self.spec.get("startup_error"):
            raise RuntimeError("injected start-up failure (ROCKTUNE_FAULTS)")

    def slow_step(self) -> None:
        if self.spec.get("slow_steps"):
            time.sleep(float(self.spec["slow_steps"]))


def _injected() -> dict:
    return json.loads(os.environ.get("ROCKTUNE_FAULTS", "{}"))


def hang_here(point: str, rank: int) -> None:
    """``hang``: this rank stops answering at ``point``, once per ``marker``."""
    spec = _injected()
    if spec.get("hang") != f"{rank}@{point}":
        return
    marker = spec.get("marker")
    if marker:
        if os.path.exists(marker):
            return
        open(marker, "w").close()
    while True:
        time.sleep(60)


def junk_all_reduce(rank: int) -> bool:
    """``junk_all_reduce_rank``: this rank's preflight all-reduce contributes wrong values."""
    return _injected().get("junk_all_reduce_rank") == rank
