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
"""

from __future__ import annotations

import types

import torch


def _lean_forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    if self.disable_adapters or self.merged or args or kwargs:  # e.g. adapter_names (mixed batches): PEFT's own
        return self._peft_forward(x, *args, **kwargs)
    (name,) = self.active_adapters
    if name not in self.lora_A:
        return self._peft_forward(x, *args, **kwargs)
    result = self.base_layer(x)
    side = self.lora_B[name](self.lora_A[name](self.lora_dropout[name](x)))
    return result.add_(side.to(result.dtype), alpha=self.scaling[name])


def lean_lora(model) -> str | None:
    """Give every plain LoRA linear of ``model`` (a PeftModel) the lean forward; returns a note, None when no layer
    qualifies."""
    from peft.tuners.lora.layer import Linear

    patched = 0
    for module in model.modules():
        if type(module) is not Linear or module.lora_variant or len(module.active_adapters) != 1:
            continue
        module._peft_forward = module.forward  # the bound PEFT forward, for the cases the lean one leaves to it
        module.forward = types.MethodType(_lean_forward, module)
        patched += 1
    if not patched:
        return None
    return f"LoRA side path: lean forward on {patched} adapted linear layers (no fp32 round trip of the input)"
