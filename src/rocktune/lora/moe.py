"""Expert LoRA on the routed tokens only: the same adapter as PEFT's ``target_parameters``, without the full stack.

PEFT 0.21 adapts transformers 5's 3-D expert stacks (``gate_up_proj`` [E, out, in], ``down_proj``) with
``ParamWrapper``: a parametrization that forms ``W + s·B·A`` for every expert on every forward, so autograd also
forms that whole stack's gradient before it reaches A and B, while a token visits only top-k of E experts. Here the
experts module of a wrapped MoE block computes, per expert e and only for the tokens routed to it,
``x·Wₑᵀ + s·(x·Aₑᵀ)·Bₑᵀ``: tokens sorted by expert, one grouped matmul per factor (``torch.nn.functional.grouped_mm``
in bf16 on CUDA/ROCm sm80+; otherwise one batched matmul over the experts' rows padded to the busiest expert's
count, the CPU included). No adapted weight and no weight gradient of the stack is ever formed.

The parameters are PEFT's own (``lora_A``/``lora_B`` of each ParamWrapper, their names, shapes and init untouched),
read in PEFT's layout (``ParamWrapper.get_delta_factors``: A rows are expert-major ``e·r + j``, B columns
rank-major ``j·E + e``), so the saved adapter is PEFT's format and merges, loads and exports as before. A call
this path does not cover (adapters disabled or merged, several adapters, expert parallelism) takes PEFT's forward;
an experts class without transformers' ``use_experts_implementation`` traits is left to PEFT, with a note.

Llama 4 (``Llama4TextExperts``, no such traits) routes densely: its MoE block runs every expert on every token, the
input scaled by the token's router score (a sigmoid of the top-k logits, exactly 0 for the experts not picked).
Its experts are SwiGLU without bias, so a zero row gives a zero output and a zero Jacobian (silu(0)·u = 0,
silu'(0)·0·… = 0, and the LoRA is linear): the rows of the picked experts alone are the same function with the same
gradients. Its experts get the traits of their layout here (``_adopt_dense_routed``) and its block a forward that
passes the router's picks, the input scaled instead of the output.
"""

from __future__ import annotations

import types
from dataclasses import dataclass

import torch

from rocktune.lora.moe_nf4 import Nf4Matmul

# The expert paths, by name: PEFT's parametrization (the reference) and the grouped one here.
EXPERT_PATHS = ("peft", "grouped")


@dataclass(frozen=True)
class Factors:
    """One expert stack's LoRA in ``x @ w`` form: ``a`` [E, in, r] (applied first), ``b`` [E, r, out], scaling."""

    a: torch.Tensor
    b: torch.Tensor
    scaling: float


def factors(wrapper, transposed: bool) -> Factors:
    """PEFT's A/B of ``wrapper`` (a ParamWrapper) as per-expert factors, views only (no copy). ``transposed``: the
    stack is [E, in, out] (``x @ Wₑ``). PEFT takes a stack's dims 1, 2 as (in, out) and swaps them unless the module
    says ``is_transposed``; Llama 4's [E, in, out] stacks say nothing, so PEFT's "in" is their output there and its
    delta ``Bₑ·Aₑ`` has B on the input side."""
    name = wrapper.active_adapters[0]
    experts = wrapper.num_experts
    a = wrapper.lora_A[name].weight  # [E·r, PEFT's in], row e·r + j
    b = wrapper.lora_B[name].weight  # [PEFT's out, r·E], column j·E + e
    scaling = float(wrapper.scaling[name])
    if wrapper._did_swap_in_out_features and transposed:  # delta [E, in, out] = Bₑ [in, r] · Aₑ [r, out]
        return Factors(b.view(b.shape[0], -1, experts).permute(2, 0, 1), a.view(experts, -1, a.shape[-1]), scaling)
    a_io = a.view(experts, -1, a.shape[-1]).transpose(1, 2)
    b_io = b.view(b.shape[0], -1, experts).permute(2, 1, 0)
    return Factors(a_io, b_io, scaling)


def _grouped_kernel(x: torch.Tensor, widths: tuple[int, ...] = ()) -> bool:
    """torch's grouped matmul pays here: bf16 on CUDA/ROCm from sm80 (what transformers' own grouped_mm experts
    check). torch 2.13's CPU kernel takes bf16 only (fp32 is refused) and is a reference loop, measured 100x slower
    than a matmul of the same size, so the CPU (and fp32) takes the padded batched matmul. ``widths``: the LoRA ranks
    and stack widths, whose rows the kernel wants 16-byte aligned (a multiple of 8 in bf16)."""
    if not hasattr(torch.nn.functional, "grouped_mm") or x.dtype is not torch.bfloat16 or x.device.type != "cuda":
        return False
    return all(w % 8 == 0 for w in widths) and torch.cuda.get_device_capability(x.device) >= (8, 0)


@dataclass(frozen=True)
class Routing:
    """The (token, slot) pairs routed to an expert, sorted by expert. ``offs``: the grouped kernel's group ends;
    ``rows``: without it, each pair's row in an [E, M] padding (M: the most pairs an expert got), where one batched
    matmul per factor replaces E small ones (a loop of per-expert matmuls measured 5x slower on the CPU)."""

    kept: torch.Tensor  # index into the flattened top-k of each routed pair
    tokens: torch.Tensor  # the token of each pair
    expert_of: torch.Tensor
    offs: torch.Tensor | None
    rows: torch.Tensor | None
    width: int  # M


def route(top_k_index: torch.Tensor, num: int, grouped: bool) -> Routing:
    """Pairs whose expert id is >= E (a token routed to no expert) are dropped, as transformers' eager loop skips
    them."""
    ids = top_k_index.reshape(-1)
    order = torch.argsort(ids, stable=True)
    counts = torch.bincount(ids, minlength=num + 1)[:num]
    kept = order[:int(counts.sum())]  # sentinel ids sort to the tail
    expert_of = ids[kept]
    ends = torch.cumsum(counts, 0)
    if grouped:
        return Routing(kept, kept // top_k_index.shape[-1], expert_of, ends.to(torch.int32), None, 0)
    width = int(counts.max()) if num else 0
    slot = torch.arange(kept.numel(), device=ids.device) - (ends - counts)[expert_of]
    return Routing(kept, kept // top_k_index.shape[-1], expert_of, None, expert_of * width + slot, width)


def mm(x: torch.Tensor, w: torch.Tensor, routing: Routing) -> torch.Tensor:
    """Each expert's rows times its ``w[e]`` [in, out]: ``x`` is [pairs, in] sorted (grouped) or [E, M, in]."""
    w = w.to(x.dtype)
    if routing.offs is None:
        return torch.bmm(x, w)
    if w.stride(0) < max(w.stride(1), w.stride(2)):  # B's expert-minor view: the kernel wants experts outermost
        w = w.contiguous()  # the factor is small (E·r·out), never the stack
    return torch.nn.functional.grouped_mm(x, w, offs=routing.offs)


def _compute_dtype(x: torch.Tensor, w: torch.Tensor) -> torch.dtype:
    """What transformers' eager experts compute in: autocast's dtype where it is on, the weights' otherwise."""
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return w.dtype


def experts_forward(experts, wrappers: dict, hidden: torch.Tensor, top_k_index: torch.Tensor,
                    top_k_weights: torch.Tensor) -> torch.Tensor:
    """The experts module's output with the LoRA of ``wrappers`` (parameter name -> ParamWrapper) on its stacks."""
    num = experts.num_experts
    up_name = "gate_up_proj" if experts.has_gate else "up_proj"
    dtype = _compute_dtype(hidden, getattr(experts, up_name))
    widths = tuple(w.r[w.active_adapters[0]] for w in wrappers.values()) + tuple(
        getattr(experts, up_name).shape[1:]) + tuple(experts.down_proj.shape[1:])
    routing = route(top_k_index, num, _grouped_kernel(hidden[:0].to(dtype), widths))
    weights = top_k_weights.reshape(-1)[routing.kept].unsqueeze(-1)
    x = hidden[routing.tokens]
    if getattr(experts, "_rt_input_scaled", False):  # Llama 4 scales the input by the score, as its block does
        x = x * weights
    x = x.to(dtype)
    if routing.rows is not None:  # padding rows are zeros; their outputs are never read back
        x = x.new_zeros(num * routing.width, x.shape[-1]).index_copy(0, routing.rows, x).view(num, routing.width, -1)
    h = _stack(experts, wrappers, up_name, x, routing)
    h = experts._apply_gate(h) if experts.has_gate else experts.act_fn(h)
    h = _stack(experts, wrappers, "down_proj", h, routing)
    if getattr(experts, "has_post_expert_norm", False):
        h = experts.post_expert_norm(h)
    if routing.rows is not None:
        h = h.reshape(-1, h.shape[-1])[routing.rows]
    if not getattr(experts, "_rt_input_scaled", False):
        h = h * weights.to(h.dtype)
    out = torch.zeros(hidden.shape, dtype=h.dtype, device=hidden.device)
    return out.index_add_(0, routing.tokens, h).to(hidden.dtype)


def _stack(experts, wrappers: dict, name: str, x: torch.Tensor, routing: Routing) -> torch.Tensor:
    """``x·Wₑᵀ + s·(x·Aₑᵀ)·Bₑᵀ`` for each expert's rows (the base alone where ``wrappers`` has no LoRA for it)."""
    nf4 = getattr(experts, "_rt_nf4", {}).get(name)
    if nf4 is not None:  # 4-bit stack: one expert dequantised at a time (lora/moe_nf4.py)
        y = Nf4Matmul.apply(x, nf4, routing.offs)
    else:
        weight = getattr(experts, name)
        y = mm(x, weight if experts.is_transposed else weight.transpose(1, 2), routing)
    if name in wrappers:
        f = factors(wrappers[name], experts.is_transposed)
        y = y.add_(mm(mm(x, f.a, routing), f.b, routing).to(y.dtype), alpha=f.scaling)
    if getattr(experts, "has_bias", False):
        bias = getattr(experts, f"{name}_bias")
        y = y + (bias[routing.expert_of] if routing.rows is None else bias.unsqueeze(1)).to(y.dtype)
    return y


def _covered(wrapper) -> bool:
    """The call is one this path computes as PEFT would: one active adapter, present, neither disabled nor merged."""
    return (not wrapper.disable_adapters and not wrapper.merged and len(wrapper.active_adapters) == 1
            and wrapper.active_adapters[0] in wrapper.lora_A)


def _grouped_forward(self, hidden: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    chain, experts = self._rt_experts
    plain = not kwargs and len(args) == 2 and not getattr(experts, "_is_expert_parallel", False)
    if plain and all(map(_covered, chain)):
        return experts_forward(experts, {w.parameter_name: w for w in chain}, hidden, *args)
    if not hasattr(experts, "_rt_nf4"):
        return _peft_call(self, experts, hidden, args, kwargs)
    # 4-bit stacks: PEFT's forward has no full-precision stack to parametrize
    if plain and all(w.disable_adapters for w in chain):  # e.g. a preference task's reference pass: the base alone
        return experts_forward(experts, {}, hidden, *args)
    raise RuntimeError("4-bit expert stacks (lora/moe_nf4.py) run with one active, unmerged adapter or none")


def _peft_call(wrapper, experts, hidden: torch.Tensor, args: tuple, kwargs: dict) -> torch.Tensor:
    """PEFT's forward for a call the grouped path leaves to it. Llama 4's experts take the dense routed input its own
    block forms (every expert's copy of every token, scaled by the score, 0 where not picked): formed here from the
    picks the routed block passes, and the experts' outputs summed per token as that block sums them."""
    if not getattr(experts, "_rt_input_scaled", False):
        return wrapper._peft_forward(hidden, *args, **kwargs)
    index, weights = args
    num = experts.num_experts
    scores = torch.zeros(hidden.shape[0], num, dtype=weights.dtype, device=weights.device).scatter(1, index, weights)
    routed_in = hidden.repeat(num, 1) * scores.transpose(0, 1).reshape(-1, 1)
    return wrapper._peft_forward(routed_in).view(num, -1, hidden.shape[-1]).sum(dim=0)


def _routed_block_forward(self, hidden_states: torch.Tensor):
    """Llama 4's MoE block (transformers' Llama4TextMoe.forward) with its experts called on the router's picks and
    scores instead of on the dense [E·tokens] input; the router (and any hook on it) and the shared expert run as
    there. Where the experts have PEFT's forward back (the reference, lean.peft_forward), the block's own forward
    runs; 4-bit experts keep the grouped forward there too (lora/moe_nf4.py), and so this one."""
    if getattr(vars(self.experts).get("forward"), "__func__", None) is not _grouped_forward:
        return type(self).forward(self, hidden_states)
    hidden = hidden_states.reshape(-1, self.hidden_dim)
    scores, logits = self.router(hidden)
    index = torch.topk(logits, self.top_k, dim=1).indices  # the router's own picks: its topk of the same logits
    routed = self.experts(hidden, index, scores.gather(1, index))
    out = self.shared_expert(hidden)
    out.add_(routed)
    return out, logits


def _swiglu(self, gate_up: torch.Tensor) -> torch.Tensor:
    """Llama 4's gate: [gate; up] halves, ``up · act(gate)`` (Llama4TextExperts.forward)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return up * self.act_fn(gate)


def _adopt_dense_routed(experts, block) -> bool:
    """Llama 4: give its experts the traits of their layout (SwiGLU over concatenated [gate; up], stacks [E, in, out],
    no bias, the score on the input) and its block the routed forward. False: not Llama 4's pair of classes, or the
    block lacks what the routed forward reads. PEFT read ``is_transposed`` when it built the factors (absent then, so
    it swapped in/out: ``factors`` reads that back); a later adapter keeps that swap (``_did_swap_in_out_features``)."""
    if type(experts).__name__ != "Llama4TextExperts" or type(block).__name__ != "Llama4TextMoe":
        return False
    if not all(hasattr(block, n) for n in ("router", "shared_expert", "top_k", "hidden_dim")):
        return False
    for name, value in (("has_gate", True), ("has_bias", False), ("is_transposed", True), ("_rt_input_scaled", True)):
        setattr(experts, name, value)
    setattr(experts, "_apply_gate", types.MethodType(_swiglu, experts))  # noqa: B010
    setattr(block, "forward", types.MethodType(_routed_block_forward, block))  # noqa: B010
    return True


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
        return f"{type(experts).__name__} has no transformers experts-implementation traits"
    if not all(getattr(experts, n, None) is not None and getattr(experts, n).dim() == 3
               for n in ("gate_up_proj" if experts.has_gate else "up_proj", "down_proj")):
        return f"{type(experts).__name__}'s expert stacks are not 3-D tensors (quantised or renamed)"
    return None


def grouped_experts(model) -> str | None:
    """Give every PEFT-wrapped experts module of ``model`` the grouped expert-LoRA forward; returns the note that
    says which expert path runs where (None: the model has no adapted expert stacks)."""
    from peft.tuners.lora.layer import ParamWrapper

    outer = _outer_wrappers(model, ParamWrapper)
    parents = {id(child): m for m in model.modules() for child in m.children()}
    for wrapper in outer:
        chain, experts = _chain(wrapper, ParamWrapper)
        why = refusal(experts)
        if why and _adopt_dense_routed(experts, parents.get(id(wrapper))):
            why = refusal(experts)  # Llama 4's, with the traits of its layout now
        if why:
            setattr(wrapper, "_rt_refused", why)  # noqa: B010 -- read by expert_path_note
            continue
        setattr(wrapper, "_rt_experts", (chain, experts))  # noqa: B010
        # PEFT's forward, for the calls this path leaves to it and for the reference (lean.peft_forward)
        setattr(wrapper, "_peft_forward", wrapper.forward)  # noqa: B010
        setattr(wrapper, "forward", types.MethodType(_grouped_forward, wrapper))  # noqa: B010
    return expert_path_note(model)


def _outer_wrappers(model, wrapper_cls) -> list:
    inner_ids = {id(m.base_layer) for m in model.modules() if isinstance(m, wrapper_cls)}
    return [m for m in model.modules() if isinstance(m, wrapper_cls) and id(m) not in inner_ids]


def expert_path_note(model) -> str | None:
    """Which expert path each adapted MoE block of ``model`` runs now, for the run log (None: no adapted stacks)."""
    from peft.tuners.lora.layer import ParamWrapper

    outer = _outer_wrappers(model, ParamWrapper)
    if not outer:
        return None
    grouped = [m for m in outer if "forward" in vars(m) and hasattr(m, "_rt_experts")]
    notes = []
    if grouped:
        replaced = _replaced(grouped[0]._rt_experts[1])
        nf4 = " (stacks in 4 bit, dequantised per expert)" if hasattr(grouped[0]._rt_experts[1], "_rt_nf4") else ""
        notes.append(f"expert LoRA: grouped on the routed tokens ({len(grouped)} MoE blocks, in place of "
                     f"transformers' {replaced} experts; torch grouped_mm for bf16 on a GPU, a padded batched "
                     f"matmul otherwise){nf4}")
    refused: dict[str, int] = {}
    for m in outer:
        if m not in grouped:
            why = getattr(m, "_rt_refused", "the expert path asked for is PEFT's")
            refused[why] = refused.get(why, 0) + 1
    notes += [f"expert LoRA: PEFT's target_parameters path in {n} MoE blocks ({why})" for why, n in refused.items()]
    return "; ".join(notes)


def _replaced(experts) -> str:
    """The transformers experts forward the grouped path stands in for, as the note names it."""
    if getattr(experts, "_rt_input_scaled", False):
        return "dense-routed"  # Llama 4's block: every expert on every token, the input scaled by the score
    return getattr(getattr(experts, "config", None), "_experts_implementation", None) or "eager"


def patch(model, path: str) -> str | None:
    """Give ``model`` (a PeftModel) the expert path named in EXPERT_PATHS; returns the note (None: PEFT's own)."""
    if path not in EXPERT_PATHS:
        raise ValueError(f"unknown expert LoRA path {path!r}: one of {EXPERT_PATHS}")
    return grouped_experts(model) if path == "grouped" else None
