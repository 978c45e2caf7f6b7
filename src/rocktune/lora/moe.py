"""Expert LoRA on the routed tokens only: the same adapter as PEFT's ``target_parameters``, without the full stack.

PEFT 0.21 adapts transformers 5's 3-D expert stacks (``gate_up_proj`` [E, out, in], ``down_proj``) with
``ParamWrapper``: a parametrization that forms ``W + s·B·A`` for every expert on every forward, so autograd also
forms that whole stack's gradient before it reaches A and B, while a token visits only top-k of E experts. Here the
experts module of a wrapped MoE block computes, per expert e and only for the tokens routed to it,
``x·Wₑᵀ + s·(x·Aₑᵀ)·Bₑᵀ``: tokens sorted by expert, one grouped matmul per factor (``torch.nn.functional.grouped_mm``
where torch has a kernel for the dtype: bf16 on this CPU, bf16 on CUDA sm80+; a loop over the experts that received
tokens otherwise). No adapted weight and no weight gradient of the stack is ever formed.

The parameters are PEFT's own (``lora_A``/``lora_B`` of each ParamWrapper, their names, shapes and init untouched),
read in PEFT's layout (``ParamWrapper.get_delta_factors``: A rows are expert-major ``e·r + j``, B columns
rank-major ``j·E + e``), so the saved adapter is PEFT's format and merges, loads and exports as before. A call
this path does not cover (adapters disabled or merged, several adapters, expert parallelism) takes PEFT's forward;
an experts class without transformers' ``use_experts_implementation`` traits (Llama 4's dense-routed experts) is
left to PEFT, with a note.
"""

from __future__ import annotations

import types
from dataclasses import dataclass

import torch

# The expert paths, by name: PEFT's parametrization (the reference) and the grouped one here.
EXPERT_PATHS = ("peft", "grouped")


@dataclass(frozen=True)
class Factors:
    """One adapted expert projection in ``x @ w`` form: base [E, in, out], A [E, in, r], B [E, r, out], scaling."""

    base: torch.Tensor
    a: torch.Tensor
    b: torch.Tensor
    scaling: float


def factors(wrapper, base: torch.Tensor, transposed: bool) -> Factors:
    """PEFT's A/B of ``wrapper`` (a ParamWrapper over ``base``) as per-expert factors, views only (no copy)."""
    name = wrapper.active_adapters[0]
    experts = wrapper.num_experts
    a = wrapper.lora_A[name].weight  # [E·r, in], row e·r + j
    b = wrapper.lora_B[name].weight  # [out, r·E], column j·E + e
    a_io = a.view(experts, -1, a.shape[-1]).transpose(1, 2)
    b_io = b.view(b.shape[0], -1, experts).permute(2, 1, 0)
    return Factors(base if transposed else base.transpose(1, 2), a_io, b_io, float(wrapper.scaling[name]))


def _grouped_kernel(x: torch.Tensor) -> bool:
    """torch's grouped matmul has a kernel here: bf16 on the CPU (torch 2.13 refuses fp32 there), bf16/fp16 on
    CUDA from sm80 (what transformers' own grouped_mm experts check)."""
    if not hasattr(torch.nn.functional, "grouped_mm") or x.dtype not in (torch.bfloat16,):
        return False
    if x.device.type == "cuda":
        return torch.cuda.get_device_capability(x.device) >= (8, 0)
    return x.device.type == "cpu"


def grouped_mm(x: torch.Tensor, w: torch.Tensor, counts: list[int], offs: torch.Tensor) -> torch.Tensor:
    """Rows of ``x`` sorted by expert (``counts`` per expert) times their expert's ``w[e]`` [in, out]."""
    w = w.to(x.dtype)
    if _grouped_kernel(x):
        if w.stride(0) < max(w.stride(1), w.stride(2)):  # B's expert-minor view: the kernel wants experts outermost
            w = w.contiguous()  # the factor is small (E·r·out), never the stack
        return torch.nn.functional.grouped_mm(x, w, offs=offs)
    parts = [xe @ w[e] for e, xe in enumerate(x.split(counts)) if counts[e]]
    return torch.cat(parts) if parts else x.new_zeros(0, w.shape[-1])


def project(x: torch.Tensor, f: Factors, counts: list[int], offs: torch.Tensor) -> torch.Tensor:
    """``x·Wₑᵀ + s·(x·Aₑᵀ)·Bₑᵀ`` for each expert's rows."""
    base = grouped_mm(x, f.base, counts, offs)
    side = grouped_mm(grouped_mm(x, f.a, counts, offs), f.b, counts, offs)
    return base.add_(side.to(base.dtype), alpha=f.scaling)


def _compute_dtype(x: torch.Tensor, w: torch.Tensor) -> torch.dtype:
    """What transformers' eager experts compute in: autocast's dtype where it is on, the weights' otherwise."""
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return w.dtype


def experts_forward(experts, wrappers: dict, hidden: torch.Tensor, top_k_index: torch.Tensor,
                    top_k_weights: torch.Tensor) -> torch.Tensor:
    """The experts module's output with the LoRA of ``wrappers`` (parameter name -> ParamWrapper) on its stacks.
    ``top_k_index`` entries >= E (a token routed to no expert) contribute nothing, as in transformers' eager loop."""
    num = experts.num_experts
    up_name = "gate_up_proj" if experts.has_gate else "up_proj"
    ids = top_k_index.reshape(-1)
    order = torch.argsort(ids, stable=True)
    counts_all = torch.bincount(ids, minlength=num + 1)
    counts = counts_all[:num].tolist()  # host sizes for the loop (and the kept rows); one sync per block
    kept = order[:sum(counts)]  # sentinel ids sort to the tail and are dropped
    tokens = kept // top_k_index.shape[-1]
    expert_of = ids[kept]
    offs = torch.cumsum(counts_all[:num], 0).to(torch.int32)
    dtype = _compute_dtype(hidden, getattr(experts, up_name))
    x = hidden[tokens].to(dtype)
    h = _stack(experts, wrappers, up_name, x, (counts, offs, expert_of))
    h = experts._apply_gate(h) if experts.has_gate else experts.act_fn(h)
    h = _stack(experts, wrappers, "down_proj", h, (counts, offs, expert_of))
    if getattr(experts, "has_post_expert_norm", False):
        h = experts.post_expert_norm(h)
    h = h * top_k_weights.reshape(-1)[kept].unsqueeze(-1).to(h.dtype)
    out = torch.zeros(hidden.shape, dtype=h.dtype, device=hidden.device)
    return out.index_add_(0, tokens, h).to(hidden.dtype)


def _stack(experts, wrappers: dict, name: str, x: torch.Tensor, groups: tuple) -> torch.Tensor:
    counts, offs, expert_of = groups
    weight = getattr(experts, name)
    if name in wrappers:
        y = project(x, factors(wrappers[name], weight, experts.is_transposed), counts, offs)
    else:  # a stack the adapter does not target: the base only
        y = grouped_mm(x, weight if experts.is_transposed else weight.transpose(1, 2), counts, offs)
    if getattr(experts, "has_bias", False):
        y = y + getattr(experts, f"{name}_bias")[expert_of].to(y.dtype)
    return y


def _covered(wrapper) -> bool:
    """The call is one this path computes as PEFT would: one active adapter, present, neither disabled nor merged."""
    return (not wrapper.disable_adapters and not wrapper.merged and len(wrapper.active_adapters) == 1
            and wrapper.active_adapters[0] in wrapper.lora_A)


def _grouped_forward(self, hidden: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    chain, experts = self._rt_experts
    if kwargs or len(args) != 2 or getattr(experts, "_is_expert_parallel", False) or not all(map(_covered, chain)):
        return self._peft_forward(hidden, *args, **kwargs)
    return experts_forward(experts, {w.parameter_name: w for w in chain}, hidden, *args)


def _chain(wrapper, wrapper_cls) -> tuple[list, torch.nn.Module]:
    """The nested ParamWrappers from ``wrapper`` inwards (one per targeted stack) and the experts module inside."""
    chain, inner = [], wrapper
    while isinstance(inner, wrapper_cls):
        chain.append(inner)
        inner = inner.base_layer
    return chain, inner


def refusal(experts) -> str | None:
    """Why the grouped path cannot compute this experts module (None: it can)."""
    traits = ("has_gate", "is_transposed", "num_experts", "_apply_gate")
    if not all(hasattr(experts, t) for t in traits):
        return (f"{type(experts).__name__} has no transformers experts-implementation traits (e.g. Llama 4's "
                "dense-routed experts)")
    if not all(getattr(experts, n, None) is not None and getattr(experts, n).dim() == 3
               for n in ("gate_up_proj" if experts.has_gate else "up_proj", "down_proj")):
        return f"{type(experts).__name__}'s expert stacks are not 3-D tensors (quantised or renamed)"
    return None


def grouped_experts(model) -> str | None:
    """Give every PEFT-wrapped experts module of ``model`` the grouped expert-LoRA forward; returns the note that
    says which expert path runs where (None: the model has no adapted expert stacks)."""
    from peft.tuners.lora.layer import ParamWrapper

    inner_ids = {id(m.base_layer) for m in model.modules() if isinstance(m, ParamWrapper)}
    outer = [m for m in model.modules() if isinstance(m, ParamWrapper) and id(m) not in inner_ids]
    done, refused = 0, {}
    for wrapper in outer:
        chain, experts = _chain(wrapper, ParamWrapper)
        why = refusal(experts)
        if why:
            refused.setdefault(why, 0)
            refused[why] += 1
            continue
        wrapper._rt_experts = (chain, experts)
        wrapper._peft_forward = wrapper.forward  # PEFT's, for the calls this path leaves to it and the reference
        wrapper.forward = types.MethodType(_grouped_forward, wrapper)
        done += 1
    if not outer:
        return None
    notes = []
    if done:
        kind = "torch grouped_mm where the dtype has a kernel (bf16), a loop over the routed experts otherwise"
        notes.append(f"expert LoRA: grouped on the routed tokens in {done} MoE blocks ({kind})")
    notes += [f"expert LoRA: PEFT's target_parameters path in {n} MoE blocks: {why}" for why, n in refused.items()]
    return "; ".join(notes)


def expert_path_note(model) -> str | None:
    """Which expert path ``model`` runs now, for the run log (None: no adapted expert stacks)."""
    from peft.tuners.lora.layer import ParamWrapper

    wrapped = [m for m in model.modules() if isinstance(m, ParamWrapper)]
    if not wrapped:
        return None
    grouped = [m for m in wrapped if "forward" in vars(m) and hasattr(m, "_rt_experts")]
    if not grouped:
        return "expert LoRA: PEFT's target_parameters path"
    config = getattr(grouped[0]._rt_experts[1], "config", None)
    replaced = getattr(config, "_experts_implementation", None) or "eager"
    return (f"expert LoRA: grouped on the routed tokens ({len(grouped)} MoE blocks, in place of transformers' "
            f"{replaced} experts; torch grouped_mm for bf16, a loop over the routed experts otherwise)")


def patch(model, path: str) -> str | None:
    """Give ``model`` (a PeftModel) the expert path named in EXPERT_PATHS; returns the note (None: PEFT's own)."""
    if path not in EXPERT_PATHS:
        raise ValueError(f"unknown expert LoRA path {path!r}: one of {EXPERT_PATHS}")
    return grouped_experts(model) if path == "grouped" else None
