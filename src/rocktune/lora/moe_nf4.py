"""4-bit expert stacks for the grouped expert path (rocktune.lora.moe): each expert's frozen matrix stored in NF4 by
bitsandbytes (``quantize_4bit``, blocks of 64), dequantised one expert at a time inside the grouped forward and again
in backward, so no full-precision stack is held.

bitsandbytes has no 3-D weight type (its Linear4bit is 2-D), so a model loaded with ``model.quantization: nf4``
gets its dense linears in 4 bit from transformers and its expert stacks in full precision; ``quantize_experts`` then
stores the stacks of every experts module on the grouped path in 4 bit and frees the full-precision ones. The
adapter (PEFT's lora_A/lora_B) is untouched, so the saved adapter is the same file as the full-precision run's.
PEFT's own forward needs the full-precision stack, so a wrapper whose stacks are in 4 bit keeps the grouped forward
for every call (its reference is the grouped forward too); a call with adapters disabled computes the base alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Nf4Stack:
    """One expert stack in 4 bit: per expert the packed bytes and bitsandbytes' quantisation state."""

    packed: list
    states: list
    transposed: bool  # stored [E, in, out] (gpt-oss) rather than [E, out, in]
    features: tuple[int, int]  # (in, out)

    def weight(self, e: int, dtype: torch.dtype) -> torch.Tensor:
        """Expert e's matrix as [in, out] in ``dtype``."""
        from bitsandbytes.functional import dequantize_4bit

        w = dequantize_4bit(self.packed[e], self.states[e]).to(dtype)
        return w if self.transposed else w.t()

    def nbytes(self) -> int:
        return sum(p.numel() * p.element_size() + s.absmax.numel() * s.absmax.element_size()
                   for p, s in zip(self.packed, self.states))


def quantize(weight: torch.Tensor, transposed: bool, quant_type: str) -> Nf4Stack:
    from bitsandbytes.functional import quantize_4bit

    pairs = [quantize_4bit(weight[e].detach().contiguous(), blocksize=64, quant_type=quant_type)
             for e in range(weight.shape[0])]
    features = (weight.shape[1], weight.shape[2]) if transposed else (weight.shape[2], weight.shape[1])
    return Nf4Stack([p for p, _ in pairs], [s for _, s in pairs], transposed, features)


def _groups(x: torch.Tensor, offs: torch.Tensor | None) -> list[tuple[int, slice | int]]:
    """(expert, rows of x) for each expert: x padded [E, M, in] (offs None) or sorted rows with group ends."""
    if offs is None:
        return [(e, e) for e in range(x.shape[0])]
    ends = offs.tolist()
    return [(e, slice(a, b)) for e, (a, b) in enumerate(zip([0, *ends[:-1]], ends)) if b > a]


class Nf4Matmul(torch.autograd.Function):
    """Each expert's rows of ``x`` times its dequantised matrix; backward dequantises again for the input gradient
    (the frozen stack gets none), so one expert's full-precision matrix exists at a time."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, stack: Nf4Stack, offs: torch.Tensor | None) -> torch.Tensor:
        ctx.stack, ctx.offs = stack, offs
        out = x.new_zeros(*x.shape[:-1], stack.features[1])
        for e, rows in _groups(x, offs):
            out[rows] = x[rows] @ stack.weight(e, x.dtype)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        stack, offs = ctx.stack, ctx.offs
        dx = None
        if ctx.needs_input_grad[0]:
            dx = grad.new_zeros(*grad.shape[:-1], stack.features[0])
            for e, rows in _groups(grad, offs):
                dx[rows] = grad[rows] @ stack.weight(e, grad.dtype).t()
        return dx, None, None


def quantize_experts(model, quant_type: str = "nf4") -> str | None:
    """Store the expert stacks of every experts module on the grouped path of ``model`` (a PeftModel) in 4 bit and
    free their full-precision storage; returns a note (None: no stack on the grouped path)."""
    from peft.tuners.lora.layer import ParamWrapper

    before = after = blocks = 0
    for wrapper in model.modules():
        if not (isinstance(wrapper, ParamWrapper) and "forward" in vars(wrapper) and hasattr(wrapper, "_rt_experts")):
            continue
        experts = getattr(wrapper, "_rt_experts")[1]  # noqa: B009 -- set by lora.moe, unknown to the type
        stacks = {}
        for name in ("gate_up_proj" if experts.has_gate else "up_proj", "down_proj"):
            param = getattr(experts, name)
            stacks[name] = quantize(param, experts.is_transposed, quant_type)
            before += param.numel() * 2  # against bf16 storage
            after += stacks[name].nbytes()
            param.data = torch.empty(0, dtype=param.dtype, device=param.device)  # the full-precision stack: freed
        setattr(experts, "_rt_nf4", stacks)  # noqa: B010 -- read by lora.moe's grouped forward
        setattr(wrapper, "_peft_forward", wrapper.forward)  # noqa: B010 -- PEFT's needs the freed stack
        blocks += 1
    if not blocks:
        return None
    return (f"expert stacks in {quant_type} ({blocks} MoE blocks): {after / 2**20:.1f} MiB against "
            f"{before / 2**20:.1f} MiB in bf16, dequantised one expert at a time in the grouped forward")
