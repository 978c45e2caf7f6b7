"""Training against the reference: the fast LoRA paths checked by what they compute, never by how they are built.

The reference is PEFT's own forward, eager, and torch's single-tensor AdamW: nothing of rocktune's side paths,
compiled graphs or fused optimizers. A fast path is trusted when, on the same model, batch and seed, a few of its
optimizer steps give the reference's losses and adapter movement within a stated tolerance, and every adapter
tensor has a gradient at the first step. The correctness matrix (tests/test_training_matrix.py), ``rocktune doctor
--model`` and a run's tripwire (train/tripwire.py) all judge with ``compare`` and ``compare_probe`` here, so a
failure names the same cause wherever it shows:

- ``no-gradient``: adapter tensors got no gradient (a compiled graph that loses them, as torch 2.11's did for an
  in-place add inside the fused node; a side path that detaches them);
- ``stale``: the loss stopped following the adapter (a forward that keeps an old adapter, e.g. cached casts an
  optimizer never invalidated);
- ``no-update``: the optimizer step left the adapter where it was;
- ``mismatch``: values differ from the reference beyond rounding (a wrong kernel or cast).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

from rocktune.lora.lean import peft_forward

# Worst relative differences from the reference that rounding explains, per compute precision. fp32: summation
# order only. bf16 autocast: the fused add rounds once inside the matmul where PEFT rounds the side term and then
# the sum (~2^-8 relative per rounding), and Adam's early, sign-like steps turn those roundings into adapter
# movements of up to 2 lr for elements whose gradient is near zero: hence a norm-based, looser movement bound.
TOLERANCE = {
    "fp32": {"loss": 1e-5, "grad": 1e-4, "delta": 1e-3},
    "bf16": {"loss": 5e-3, "grad": 1e-1, "delta": 2.5e-1},
    "fp16": {"loss": 5e-3, "grad": 1e-1, "delta": 2.5e-1},
}


@dataclass
class Trace:
    """What a few optimizer steps on one batch did: the loss before each update, the largest gradient of each adapter
    tensor at the first step, and each adapter tensor's movement over all the steps."""

    losses: list[float] = field(default_factory=list)
    first_grads: dict[str, float] = field(default_factory=dict)
    deltas: dict[str, torch.Tensor] = field(default_factory=dict)


def adapter_params(model) -> dict[str, torch.nn.Parameter]:
    return {n: p for n, p in model.named_parameters() if p.requires_grad and "lora_" in n}


def reference_optimizer(params, lr: float) -> torch.optim.Optimizer:
    """torch's plain AdamW, one tensor at a time: no fused or multi-tensor kernel between it and the math."""
    return torch.optim.AdamW(params, lr=lr, weight_decay=0.0, foreach=False, fused=False)


def train_trace(model, loss_fn, optimizer: torch.optim.Optimizer, steps: int, autocast=contextlib.nullcontext
                ) -> Trace:
    """``steps`` optimizer steps of ``loss_fn(model)`` (the same batch each time, so a path that learns makes the
    loss fall); the model's current path and compile state are what is measured."""
    params = adapter_params(model)
    start = {n: p.detach().clone() for n, p in params.items()}
    trace = Trace()
    for step in range(steps):
        optimizer.zero_grad(set_to_none=True)
        with autocast():
            loss = loss_fn(model)
        loss.float().backward()
        trace.losses.append(float(loss.detach().float()))
        if step == 0:
            trace.first_grads = {n: 0.0 if p.grad is None else float(p.grad.detach().abs().max())
                                 for n, p in params.items()}
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    trace.deltas = {n: (p.detach() - start[n]).float() for n, p in params.items()}
    return trace


def _rel(got: float, want: float) -> float:
    """Relative to the reference, but never to less than 1: a loss that is zero by construction (an on-policy RL
    objective's value) is compared absolutely, not against its own rounding."""
    return abs(got - want) / max(abs(want), 1.0)


def _delta_error(got: dict, want: dict) -> float:
    num = sum(float((got[n] - want[n]).pow(2).sum()) for n in want)
    den = sum(float(want[n].pow(2).sum()) for n in want)
    if den == 0.0:  # the reference has nothing (a step without signal): any value the path has is wrong
        return 0.0 if num == 0.0 else float("inf")
    return (num / den) ** 0.5


@dataclass(frozen=True)
class Problem:
    cause: str  # no-gradient | stale | no-update | mismatch
    detail: str

    def __str__(self) -> str:
        return f"{self.cause}: {self.detail}"


def compare(got: Trace, ref: Trace, precision: str) -> list[Problem]:
    """Everything in which ``got`` departs from the reference trace ``ref`` (same model, batch, seed and steps)."""
    tol = TOLERANCE[precision]
    problems = []
    dead = sorted(n for n, g in got.first_grads.items() if g == 0.0 and ref.first_grads.get(n, 0.0) > 0.0)
    if dead:
        problems.append(Problem("no-gradient", f"{len(dead)} of {len(got.first_grads)} adapter tensors got no "
                                               f"gradient at the first step (e.g. {dead[0]})"))
    fell = ref.losses[0] - ref.losses[-1]
    if len(got.losses) > 1 and fell > 0 and abs(got.losses[-1] - got.losses[0]) < 0.1 * fell:
        problems.append(Problem("stale", f"the loss stayed at {got.losses[0]:.6g} -> {got.losses[-1]:.6g} while the "
                                         f"reference's fell {ref.losses[0]:.6g} -> {ref.losses[-1]:.6g}: the forward "
                                         "does not follow the adapter's updates"))
    still = sum(1 for d in got.deltas.values() if float(d.abs().max()) == 0.0)
    if got.deltas and still == len(got.deltas):
        problems.append(Problem("no-update", "no adapter tensor moved over the steps"))
    worst = max(_rel(g, w) for g, w in zip(got.losses, ref.losses))
    if worst > tol["loss"]:
        problems.append(Problem("mismatch", f"losses {[round(x, 6) for x in got.losses]} against the reference's "
                                            f"{[round(x, 6) for x in ref.losses]}: relative difference {worst:.2e} "
                                            f"(tolerance {tol['loss']:.0e})"))
    moved = _delta_error(got.deltas, ref.deltas)
    if moved > tol["delta"]:
        problems.append(Problem("mismatch", f"the adapter moved differently from the reference: relative difference "
                                            f"{moved:.2e} (tolerance {tol['delta']:.0e})"))
    return problems


@dataclass
class Probe:
    """One forward and backward of a small batch: its loss and the adapter's gradients."""

    loss: float
    grads: dict[str, torch.Tensor]


def probe(model, loss_fn, autocast=contextlib.nullcontext, seed: int = 0, params: dict | None = None) -> Probe:
    """Loss and adapter gradients of ``loss_fn(model)`` without touching the run: the RNG is forked and reseeded (a
    dropout mask is the same for the path and the reference, and the run's own RNG stream does not move) and the
    gradients are taken out and cleared. Call it between optimizer steps, when no gradient is accumulated.
    ``params``: ``adapter_params(model)`` when the caller has it already (a walk of every module otherwise)."""
    params = adapter_params(model) if params is None else params
    devices = sorted({p.device.index for p in params.values() if p.device.type == "cuda"})
    with torch.random.fork_rng(devices=devices):
        _seed(seed, devices)
        with autocast():
            loss = loss_fn(model)
        loss.float().backward()
    grads = {n: (p.grad.detach().float().clone() if p.grad is not None else torch.zeros_like(p, dtype=torch.float32))
             for n, p in params.items()}
    for p in params.values():
        p.grad = None
    return Probe(float(loss.detach().float()), grads)


def _seed(seed: int, devices: list[int]) -> None:
    """Seed the generators ``probe`` forked, as ``torch.manual_seed`` seeds them, and no other: that one also seeds
    every other device's generator, outside the fork, and where CUDA is not initialised (a CPU run) it queues the
    CUDA and XPU seeds with the caller's formatted stack: a quarter of a millisecond per seed on the GRPO bench's CPU
    run, more under a deeper stack."""
    torch.random.default_generator.manual_seed(seed)
    for index in devices:
        torch.cuda.default_generators[index].manual_seed(seed)


def compare_probe(got: Probe, ref: Probe, precision: str) -> list[Problem]:
    """The run's path against the reference on the same probe batch and adapter values."""
    tol = TOLERANCE[precision]
    problems = []
    dead = sorted(n for n, g in got.grads.items() if float(g.abs().max()) == 0.0
                  and float(ref.grads[n].abs().max()) > 0.0)
    if dead:
        problems.append(Problem("no-gradient", f"{len(dead)} of {len(got.grads)} adapter tensors got no gradient "
                                               f"where the reference gives one (e.g. {dead[0]})"))
    if _rel(got.loss, ref.loss) > tol["loss"]:
        problems.append(Problem("mismatch", f"probe loss {got.loss:.6g} against the reference's {ref.loss:.6g} "
                                            f"(tolerance {tol['loss']:.0e} relative)"))
    err = _delta_error(got.grads, ref.grads)
    if not dead and err > tol["grad"]:
        problems.append(Problem("mismatch", f"adapter gradients differ from the reference's by {err:.2e} relative "
                                            f"(tolerance {tol['grad']:.0e})"))
    return problems


@contextlib.contextmanager
def reference_mode(model):
    """Inside: ``model`` computes the reference's way (PEFT's own forward, every compiled module eager, recurrent
    layers on transformers' torch kernels); the run's path is back on leaving. The same parameters, so the two are
    compared on identical adapter values."""
    from rocktune.kernels import recurrent

    compiled = [m for m in model.modules() if getattr(m, "_compiled_call_impl", None) is not None]
    saved = [m._compiled_call_impl for m in compiled]
    try:
        for m in compiled:
            m._compiled_call_impl = None
        with peft_forward(model), recurrent.reference():
            yield
    finally:
        for m, impl in zip(compiled, saved):
            m._compiled_call_impl = impl
