"""The GPU's own account of training steps: how long each took on the device, how busy it was, and with what.

The host's wait at the step's one synchronisation (``device_wait_s`` in metrics.jsonl) cannot show a starved GPU:
when the launch queue is full the host blocks inside the launch calls, not at the sync, so a GPU-bound step of
thousands of kernels shows a small wait as well (the first H200 run: 7% of the step, while its CUDA time accounted
for about the whole step). So, measured on the device:

- a CUDA event recorded after each optimizer step: the device span of a step is the time between two of them;
- one sampled step under the profiler: its kernels (name, device time, the CPU ranges that launched them), counted
  and summed per class (``CLASSES``). Busy share = summed kernel time / that step's device span: near 1 the device
  never waited; well below 1 it did (launch overhead, host work, a sync). The profiler adds host work, so the share
  of the sampled step is a lower bound for the others.
"""

from __future__ import annotations

import re
import statistics
from dataclasses import dataclass, field

CLASSES = ("matmul", "attention", "loss", "optimizer", "elementwise")
# Kernel names: cuBLAS/cuBLASLt (gemm, nvjet, xmma, cutlass, sm90_/sm80_ tiles), rocBLAS/hipBLASLt (Cijk_), Inductor's
# matmul templates (triton_tem_); flash and memory-efficient attention (flash, fmha, attention). Everything else
# (pointwise, reductions, casts, copies, fused Triton kernels, Liger's) is elementwise work.
MATMUL = re.compile(r"gemm|nvjet|xmma|wgmma|cutlass|cublas|hipblas|rocblas|Cijk_|triton_tem|sm\d\d_|ampere_|"
                    r"s16816|s1688|matmul", re.IGNORECASE)
ATTENTION = re.compile(r"flash|fmha|attention", re.IGNORECASE)
# CPU ranges: rocktune's fused head + cross-entropy (an autograd Function, so the profiler names it), and torch's
# optimizers (they record "Optimizer.step#AdamW.step" and "Optimizer.zero_grad#...").
LOSS_RANGES = ("LinearCrossEntropy",)
OPTIMIZER_RANGES = ("Optimizer.step", "Optimizer.zero_grad")
TOP = 12  # the heaviest kernels (by name and class) kept in the report


@dataclass(frozen=True)
class Kernel:
    name: str
    us: float  # device time
    within: tuple[str, ...] = ()  # names of the CPU ranges that launched it, outermost first


def classify(k: Kernel) -> str:
    """The kernel's class: by the CPU range that launched it (loss, optimizer), else by its name."""
    if any(r.startswith(LOSS_RANGES) for r in k.within):
        return "loss"
    if any(r.startswith(OPTIMIZER_RANGES) for r in k.within):
        return "optimizer"
    if ATTENTION.search(k.name):
        return "attention"
    return "matmul" if MATMUL.search(k.name) else "elementwise"


def kernels_of(events) -> list[Kernel]:
    """The kernels of a profile (``prof.events()``: torch's FunctionEvents), each with its launching op's ranges."""
    out = []
    for e in events:
        for k in getattr(e, "kernels", None) or ():
            out.append(Kernel(k.name, float(k.duration), _ranges(e)))
    return out


def _ranges(event) -> tuple[str, ...]:
    names = []
    while event is not None:
        names.append(event.name)
        event = event.cpu_parent
    return tuple(reversed(names))


def summary(kernels: list[Kernel], span_s: float | None) -> dict:
    """Kernel count, summed device time, the busy share against ``span_s`` and the time per class."""
    total = sum(k.us for k in kernels) / 1e6
    by = {c: [k for k in kernels if classify(k) == c] for c in CLASSES}
    classes = {c: {"s": round(sum(k.us for k in ks) / 1e6, 6), "kernels": len(ks),
                   "share": round(sum(k.us for k in ks) / 1e6 / total, 4) if total else None} for c, ks in by.items()}
    top: dict[tuple[str, str], list[float]] = {}
    for k in kernels:
        top.setdefault((k.name, classify(k)), []).append(k.us)
    heavy = sorted(top.items(), key=lambda kv: -sum(kv[1]))[:TOP]
    return {"kernels": len(kernels), "kernel_s": round(total, 6), "span_s": span_s,
            "busy_share": round(total / span_s, 4) if span_s else None, "classes": classes,
            "top_kernels": [{"name": n[:160], "class": c, "calls": len(us), "s": round(sum(us) / 1e6, 6)}
                            for (n, c), us in heavy]}


@dataclass
class DeviceClock:
    """Feeds on ``train(on_step_done=...)``: an event after every step, the profiler around step ``sample``.

    ``cuda`` and ``profile`` default to torch's (``torch.cuda``; a ``torch.profiler.profile`` with CUDA activity);
    the tests give fakes, so that nothing here meets a GPU for the first time on the GPU."""

    sample: int
    cuda: object = None
    profile: object = None
    events: list = field(default_factory=list)
    kernels: list[Kernel] | None = None
    _prof: object = None

    def __post_init__(self):
        if self.cuda is None:
            import torch

            self.cuda = torch.cuda
        if self.profile is None:
            self.profile = _cuda_profiler

    def step_done(self, step: int) -> None:
        event = self.cuda.Event(enable_timing=True)
        event.record()
        self.events.append((step, event))
        if step == self.sample - 1:  # the sampled step starts on an idle device, under the profiler
            self.cuda.synchronize()
            self._prof = self.profile()
            self._prof.__enter__()
        elif step == self.sample and self._prof is not None:
            self.cuda.synchronize()
            self._prof.__exit__(None, None, None)
            self.kernels = kernels_of(self._prof.events())

    def spans(self) -> dict[int, float]:
        """Seconds of device time between the end of each step and the end of the next (the later step's span)."""
        self.cuda.synchronize()
        return {b: a_ev.elapsed_time(b_ev) / 1000 for (_, a_ev), (b, b_ev) in zip(self.events, self.events[1:])}

    def report(self, measured: list[int]) -> dict:
        """``measured``: the steps the speed figures use (their spans' median is reported beside the sample)."""
        spans = self.spans()
        out = {"sampled_step": self.sample if self.kernels is not None else None,
               "step_span_s": {str(k): round(v, 6) for k, v in spans.items()},
               "median_span_s": _median([spans[s] for s in measured if s in spans])}
        if self.kernels is not None:
            out.update(summary(self.kernels, spans.get(self.sample)))
        return out


def _median(values: list[float]) -> float | None:
    return round(statistics.median(values), 6) if values else None


def _cuda_profiler():
    from torch.profiler import ProfilerActivity, profile

    return profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
