"""A lean forward for PEFT's LoRA linear layers: the same parameters and the same adapter files, fewer ops.

PEFT keeps the adapter in fp32 (the master weights) and, per adapted linear, casts the layer's input to fp32 before
``lora_A`` (``_cast_input_dtype``); under autocast ``lora_A`` then casts it back to bf16, so every adapted linear pays
an fp32 round trip of its input forward and backward, then ``* scaling``, ``+ result`` and ``.to(result dtype)``.
Here the side path runs in the input's dtype (autocast still casts the fp32 adapter weights once per region, cached)
and is added to the base output in place, scaled in the same op: ``base(x).add_(B(A(dropout(x))), alpha=scaling)``.
A bf16 -> fp32 -> bf16 round trip is exact, so the values are those of PEFT's path up to the fused scaling.

Only PEFT's plain ``lora.Linear`` with one active vanilla adapter is patched (not quantised layers, not DoRA or other
variants); a layer whose adapters are disabled, merged or mixed per batch takes PEFT's own forward. Nothing about
the parameters or their names changes, so the saved adapter loads in PEFT unchanged.

``fused=True`` (the default) goes further (``rocktune.lora.fused``): a layer whose base is a plain frozen
``nn.Linear`` and whose dropout is off (or which is evaluating) runs base and adapter as one autograd node of
matmuls, the scaled add in the matmul's epilogue, and siblings that read the same input (q/k/v, gate/up) share one
A matmul, wherever autograd records (training). A call without gradients (an eval pass, generation) takes the lean
forward, whose fp32 values are PEFT's to the bit: the eval loss a run logs is the one its saved adapter gives when
loaded with PEFT (tests/test_train.py). Anything else (dropout while training, disabled, merged, mixed or several
active adapters) takes the lean forward, which hands the cases it does not cover to PEFT's own; DoRA and quantised
layers are never patched.
"""

from __future__ import annotations

import contextlib
import types

import torch

from rocktune.lora.fused import Plan, run_group

# Every side path a LoRA linear can take, by name: PEFT's own forward (the reference), the lean one and the fused
# one. tests/test_training_matrix.py proves each against the reference and fails when a path is added here without
# entering its matrix.
SIDE_PATHS = ("peft", "lean", "fused")

# Siblings that a decoder layer calls on one and the same input tensor (Llama/Qwen/Mistral-style naming).
SHARED_INPUT = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def _lean_forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    # e.g. adapter_names (mixed batches), or several adapters active at once: PEFT's own
    if self.disable_adapters or self.merged or args or kwargs or len(self.active_adapters) != 1:
        return self._peft_forward(x, *args, **kwargs)
    (name,) = self.active_adapters
    if name not in self.lora_A:
        return self._peft_forward(x, *args, **kwargs)
    result = self.base_layer(x)
    side = self.lora_B[name](self.lora_A[name](self.lora_dropout[name](x)))
    return result.add_(side.to(result.dtype), alpha=self.scaling[name])


class _Group:
    """Adapted linears that read one input. The first member called with a tensor computes every member's output in
    one fused node and keeps the others' until they are asked for with that same tensor; a member called with
    another tensor (or twice) starts a new computation, so a stale output is never handed out."""

    def __init__(self, modules, name: str):
        self.modules, self.name = modules, name
        self.plan = Plan(tuple(float(m.scaling[name]) for m in modules), tuple(m.r[name] for m in modules))
        self.pending: tuple = (None, {})  # (input, {member index: output}) not yet handed out

    def output(self, index: int, x: torch.Tensor) -> torch.Tensor:
        seen, outs = self.pending
        if seen is x and index in outs:
            y = outs.pop(index)
            if not outs:
                self.pending = (None, {})
            return y
        members = [(m.base_layer, m.lora_A[self.name].weight, m.lora_B[self.name].weight) for m in self.modules]
        ys = run_group(self.plan, x, members)
        self.pending = (x, {i: y for i, y in enumerate(ys) if i != index}) if len(ys) > 1 else (None, {})
        return ys[index]


def _fusable(module, name: str) -> bool:
    """Whether this call may take the fused node: autograd records (no grad: the lean forward, PEFT's values to the
    bit), and the adapter it was patched for is the one active, untouched."""
    return (torch.is_grad_enabled() and not module.disable_adapters and not module.merged
            and module.active_adapters == [name]
            and not (module.training and module.lora_dropout[name].__class__ is not torch.nn.Identity)
            and not module.base_layer.weight.requires_grad  # the node gives the base no gradient
            and (module.base_layer.bias is None or not module.base_layer.bias.requires_grad))


def _fused_forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    group, index = self._rt_group
    if args or kwargs or not all(_fusable(m, group.name) for m in group.modules):
        return _lean_forward(self, x, *args, **kwargs)
    return group.output(index, x)


def _plain(module, linear_cls) -> bool:
    # a base whose class has a forward of its own may return something else than the product (Llama 4's router, an
    # nn.Linear returning a tuple): the in-place add would fail on it, so it keeps PEFT's forward
    return (type(module) is linear_cls and not module.lora_variant and len(module.active_adapters) == 1
            and type(module.base_layer).forward is torch.nn.Linear.forward)


def _groups(model, linear_cls) -> list[list]:
    """Fusable layers, siblings on one input together: same parent, names in SHARED_INPUT, same input width."""
    fusable = {n: m for n, m in model.named_modules()  # lora_B with a bias (PEFT's lora_bias) is not in the node
               if _plain(m, linear_cls) and type(m.base_layer) is torch.nn.Linear
               and m.lora_B[m.active_adapters[0]].bias is None}
    groups, taken = [], set()
    for n in fusable:
        parent, _, leaf = n.rpartition(".")
        for names in SHARED_INPUT:
            siblings = [f"{parent}.{s}" for s in names]
            if leaf == names[0] and all(s in fusable for s in siblings):
                mods = [fusable[s] for s in siblings]
                if len({m.in_features for m in mods}) == 1 and len({m.active_adapters[0] for m in mods}) == 1:
                    groups.append(mods)
                    taken.update(siblings)
    return groups + [[m] for n, m in fusable.items() if n not in taken]


def lean_lora(model, fused: bool = True) -> str | None:
    """Give every plain LoRA linear of ``model`` (a PeftModel) the lean forward, or where it can the fused one
    (``fused``); returns a note, None when no layer qualifies."""
    from peft.tuners.lora.layer import Linear

    patched = 0
    for module in model.modules():
        if not _plain(module, Linear):
            continue
        module._peft_forward = module.forward  # the bound PEFT forward, for the cases the lean one leaves to it
        module.forward = types.MethodType(_lean_forward, module)
        patched += 1
    if not patched:
        return None
    if not fused:
        return f"LoRA side path: lean forward on {patched} adapted linear layers (no fp32 round trip of the input)"
    groups = _groups(model, Linear)
    for mods in groups:
        group = _Group(mods, mods[0].active_adapters[0])
        for i, m in enumerate(mods):
            m._rt_group = (group, i)
            m.forward = types.MethodType(_fused_forward, m)
    fused_n = sum(len(g) for g in groups)
    shared = sum(1 for g in groups if len(g) > 1)
    return (f"LoRA side path: fused on {fused_n} of {patched} adapted linear layers ({shared} groups share one A "
            f"matmul; the others and other cases: the lean forward)")


def patch(model, path: str) -> str | None:
    """Give ``model`` (a PeftModel) the side path named in SIDE_PATHS; returns the note (None: PEFT's own)."""
    if path not in SIDE_PATHS:
        raise ValueError(f"unknown LoRA side path {path!r}: one of {SIDE_PATHS}")
    return None if path == "peft" else lean_lora(model, fused=path == "fused")


@contextlib.contextmanager
def peft_forward(model):
    """Inside: every layer this module patched runs PEFT's own forward again (the reference); restored after."""
    patched = [m for m in model.modules() if "forward" in vars(m) and hasattr(m, "_peft_forward")]
    saved = [m.forward for m in patched]
    try:
        for m in patched:
            m.forward = m._peft_forward
        yield
    finally:
        for m, fwd in zip(patched, saved):
            m.forward = fwd
