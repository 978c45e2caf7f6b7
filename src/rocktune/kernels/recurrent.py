"""The kernels of the layers that carry state along the sequence (Gated DeltaNet in Qwen3.5 / Qwen3-Next, Mamba2 in
Granite 4): the fast ones where they prove themselves on the device, transformers' torch reference everywhere else.

transformers 5 resolves each such kernel once, when the modeling module is imported
(``integrations.hub_kernels.use_kernel_func_from_hub_with_fallback``): the package's function where
flash-linear-attention (``fla``), ``causal_conv1d`` or ``mamba_ssm`` imports, else its own torch function; the layer's
forward calls it as a module global. Nothing proves that the package's kernel computes the right values on this GPU
(a Triton or ROCm build for another arch, a release that changed a convention). So, after loading, for each of
those kernels a model's layers call (``settle``):

- on a GPU, the package's kernel when its self-test against transformers' torch function passes there
  (``recurrent_selftest``: the layer's own call, forward and backward, once per process, device and dtype), else
  the torch function; the run log says which and why;
- on the CPU, the torch function (the packages' kernels are Triton and CUDA code);
- never ``mamba_split_conv1d_scan_combined``, Mamba2's training-only fusion of the convolution, scan, gated norm and
  ``out_proj``: it reads ``out_proj.weight`` itself, which under PEFT is the frozen base weight, so the adapter on
  ``out_proj`` would compute nothing and learn nothing. Without it the layer runs the separate fast kernels.

How: the module global is replaced by a ``Choice`` that calls, per call, the kernel chosen for the device and dtype
of the call's activations, and the torch function for any other (a model moved after loading runs the reference
there, since nothing was proven there). ``reference()`` puts every choice on the torch functions for a while: the
training-path tripwire's reference forward (train/tripwire.py).
"""

from __future__ import annotations

import contextlib
import inspect
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch

from rocktune.kernels.recurrent_cases import CASES, KEY_ARG, Dims
from rocktune.kernels.recurrent_selftest import TOLERANCE, Verdict, self_test

# kernels a layer never runs, and why (they have no self-test case either)
NEVER = {"mamba_split_conv1d_scan_combined": "it reads out_proj's weight itself, which under PEFT is the frozen base "
                                             "weight: the LoRA on out_proj would learn nothing"}
# the import name of each package -> what pip installs it as
DISTRIBUTION = {"fla": "flash-linear-attention", "causal_conv1d": "causal-conv1d", "mamba_ssm": "mamba-ssm"}


@dataclass(frozen=True)
class Kernel:
    """One of transformers' kernel functions in a modeling module, as transformers resolved it at import."""

    module: ModuleType
    attr: str  # the global the layer's forward calls
    name: str  # transformers' kernel name (``func_name``), the self-test's key
    package: str
    original: Any  # what transformers put there (put back by ``restore``)
    torch_fn: Callable  # transformers' torch reference
    fast: Callable | None  # ``original`` where the package's kernel was picked, else None


def _closure(obj) -> dict | None:
    """The variables of transformers' kernel wrapper, or None for anything else. The ``kernels`` package, where
    installed, turns the wrapper into a module whose forward calls it."""
    if isinstance(obj, torch.nn.Module):
        cells = type(obj).forward.__closure__ or ()
        obj = next((c.cell_contents for c in cells if callable(c.cell_contents)), None)
    code = getattr(obj, "__code__", None)
    if code is None or not {"func_name", "package", "torch_function", "is_new_implementation"} <= set(
            code.co_freevars):
        return None
    return dict(zip(code.co_freevars, (c.cell_contents for c in obj.__closure__)))


def resolve(module: ModuleType, attr: str) -> Kernel | None:
    obj = module.__dict__.get(attr)
    if isinstance(obj, Choice):
        return obj.kernel
    found = _closure(obj)
    if found is None:
        return None
    return Kernel(module, attr, found["func_name"], found["package"], obj, found["torch_function"],
                  obj if found["is_new_implementation"] else None)


_USED: dict[type, tuple[str, ...]] = {}


def _called(cls: type) -> tuple[str, ...]:
    """The kernel globals a layer class's forward calls (none for any other class)."""
    if cls not in _USED:
        module, forward = sys.modules.get(cls.__module__), inspect.unwrap(cls.forward)
        names = getattr(getattr(forward, "__code__", None), "co_names", ())
        _USED[cls] = tuple(n for n in names if module is not None and resolve(module, n) is not None)
    return _USED[cls]


def _dtype(layer: torch.nn.Module) -> torch.dtype:
    """The layer's compute dtype: its largest weight's (a model may keep small parameters such as A_log in fp32)."""
    weights = [p for p in layer.parameters() if p.is_floating_point()]
    return max(weights, key=lambda p: p.numel()).dtype if weights else torch.float32


def layer_kernels(model: torch.nn.Module) -> dict[Kernel, torch.nn.Module]:
    """Every kernel the model's layers call, with the first layer that calls it."""
    found: dict[Kernel, torch.nn.Module] = {}
    for layer in model.modules():
        for attr in _called(type(layer)):
            kernel = resolve(sys.modules[type(layer).__module__], attr)
            if kernel is not None:
                found.setdefault(kernel, layer)
    return found


class _Forced:
    depth = 0  # > 0 inside ``reference()``


def reference_call(kernel: Kernel) -> Callable:
    """transformers' torch function called as its wrapper calls it: keywords it does not take dropped, packed-row
    bounds refused (it would run one packed example's state on into the next; rocktune refuses packing for these
    models before training)."""
    params = inspect.signature(kernel.torch_fn).parameters
    takes_all = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())

    def reference(*args, **kwargs):
        if kwargs.get("cu_seqlens") is not None or kwargs.get("seq_idx") is not None:
            raise ValueError(f"{kernel.name}: transformers' torch reference cannot keep packed sequences apart")
        return kernel.torch_fn(*args, **(kwargs if takes_all else {k: v for k, v in kwargs.items() if k in params}))
    return reference


class Choice:
    """In a modeling module, in place of transformers' kernel function: per call, the kernel chosen for the device
    and dtype of the call's activations, transformers' torch function for every other."""

    def __init__(self, kernel: Kernel):
        self.kernel, self.reference = kernel, reference_call(kernel)
        self.key_arg = KEY_ARG.get(kernel.name, 0)
        self.chosen: dict[tuple, Callable] = {}  # (device type, index, dtype) -> the fast kernel proven there
        self.forced = 0  # > 0 inside ``reference([this kernel])``

    def __call__(self, *args, **kwargs):
        x = args[self.key_arg]
        fn = None if _Forced.depth or self.forced else self.chosen.get((x.device.type, x.device.index, x.dtype))
        return (fn or self.reference)(*args, **kwargs)


_INSTALLED: list[Choice] = []


def _install(kernel: Kernel) -> Choice:
    current = kernel.module.__dict__[kernel.attr]
    if isinstance(current, Choice):
        return current
    choice = Choice(kernel)
    setattr(kernel.module, kernel.attr, choice)
    _INSTALLED.append(choice)
    return choice


def restore() -> None:
    """Put transformers' own functions back where a ``Choice`` stands in for them."""
    while _INSTALLED:
        kernel = _INSTALLED.pop().kernel
        setattr(kernel.module, kernel.attr, kernel.original)


@contextlib.contextmanager
def reference(kernels: Iterable[Kernel] | None = None) -> Iterator[None]:
    """Inside: the recurrent layers run transformers' torch functions, for every kernel or for ``kernels`` only (the
    tripwire's reference forward, and its search for the wrong one)."""
    only = None if kernels is None else [c for c in _INSTALLED if c.kernel in set(kernels)]
    if only is None:
        _Forced.depth += 1
    for choice in only or ():
        choice.forced += 1
    try:
        yield
    finally:
        if only is None:
            _Forced.depth -= 1
        for choice in only or ():
            choice.forced -= 1


def device_key(device: str | torch.device, dtype: torch.dtype) -> tuple:
    d = torch.device(device)
    if d.type == "cuda" and d.index is None:
        d = torch.device("cuda", torch.cuda.current_device())
    return d.type, d.index, dtype


_VERDICTS: dict[tuple, Verdict] = {}


def _verdict(kernel: Kernel, fast: Callable, key: tuple, dims: Dims) -> Verdict:
    """The self-test's, once per process for a kernel on a device and dtype."""
    cache = (kernel.name, fast, key)
    if cache not in _VERDICTS:
        where = f"{key[0]}:{key[1]}" if key[1] is not None else key[0]
        _VERDICTS[cache] = self_test(kernel.name, fast, reference_call(kernel), where, key[2], dims)
    return _VERDICTS[cache]


@dataclass(frozen=True)
class Outcome:
    kernel: Kernel
    fast: bool
    why: str  # the self-test's finding, or why the torch function runs
    error: float | None = None


def choose(kernel: Kernel, fast: Callable, key: tuple, dims: Dims, stand_in: bool) -> Outcome:
    """Whether the model's layers on ``key``'s device and dtype run ``fast`` for ``kernel``, and why."""
    if kernel.name in NEVER:
        return Outcome(kernel, False, NEVER[kernel.name])
    if kernel.name not in CASES:
        return Outcome(kernel, False, "rocktune has no self-test for it")
    if key[0] == "cpu" and not stand_in:
        return Outcome(kernel, False, "the packages' kernels run on GPUs only")
    if key[2] not in TOLERANCE:
        return Outcome(kernel, False, f"rocktune self-tests them in fp32, bf16 and fp16, not {key[2]}")
    verdict = _verdict(kernel, fast, key, dims)
    return Outcome(kernel, verdict.ok, verdict.detail if verdict.ok else f"its self-test failed: {verdict.detail}",
                   verdict.error)


def settle(model: torch.nn.Module, device: str, stand_ins: Mapping[str, Callable] | None = None) -> list[str]:
    """Choose, for every fast kernel the model's recurrent layers would call, the package's or the torch one on
    ``device`` in the layers' dtype (see the module's docstring); returns the run log's line, none where no fast
    kernel is installed (transformers' own pick is its torch path then). ``stand_ins``: transformers' kernel name ->
    a kernel to try in place of the package's, on the CPU too (the tests feed correct and wrong ones)."""
    outcomes, where, tolerance = [], "", 0.0
    for kernel, layer in layer_kernels(model).items():
        stand_in = (stand_ins or {}).get(kernel.name)
        fast = stand_in or kernel.fast
        key = device_key(device, _dtype(layer))
        where = f"{key[0]}{'' if key[1] is None else f':{key[1]}'} ({str(key[2]).replace('torch.', '')})"
        tolerance = TOLERANCE.get(key[2], 0.0)
        current = kernel.module.__dict__[kernel.attr]
        if fast is None:  # transformers runs its torch function: nothing to choose, an earlier choice forgotten
            if isinstance(current, Choice):
                current.chosen.pop(key, None)
            continue
        outcome = choose(kernel, fast, key, Dims.of(layer), stand_in is not None)
        choice = _install(kernel)
        if outcome.fast:
            choice.chosen[key] = fast
        else:
            choice.chosen.pop(key, None)
        outcomes.append(outcome)
    return [note(outcomes, where, tolerance)] if outcomes else []


def note(outcomes: list[Outcome], where: str, tolerance: float) -> str:
    """One line: the fast kernels with their self-test errors, the others grouped by why they run the torch one."""
    fast = [o for o in outcomes if o.fast]
    worst = max((o.error or 0.0 for o in fast), default=0.0)
    parts = [f"fast {', '.join(f'{o.kernel.name} ({o.kernel.package})' for o in fast)} (self-tested against "
             f"transformers' torch reference: worst relative error {worst:.1e}, tolerance {tolerance:.0e})"
             ] if fast else []
    why: dict[str, list[str]] = {}
    for o in outcomes:
        if not o.fast:
            why.setdefault(o.why, []).append(o.kernel.name)
    parts += [f"transformers' torch reference for {', '.join(names)} ({reason})" for reason, names in why.items()]
    return f"kernels: recurrent layers on {where}: " + "; ".join(parts)


def fast_kernels(model: torch.nn.Module) -> list[Kernel]:
    """The kernels the model's recurrent layers run fast now, on their device and dtype."""
    out = []
    for kernel, layer in layer_kernels(model).items():
        current = kernel.module.__dict__[kernel.attr]
        param = next((p for p in layer.parameters() if p.is_floating_point()), None)
        if isinstance(current, Choice) and param is not None and \
                device_key(param.device, _dtype(layer)) in current.chosen:
            out.append(kernel)
    return out


def apply(model: torch.nn.Module, device: str) -> None:
    """``settle`` after loading, its line on the console (stderr) as the loader's other notes."""
    from rich.console import Console

    for line in settle(model, device):
        Console(stderr=True, highlight=False).print(f"[dim]{line}[/]")
