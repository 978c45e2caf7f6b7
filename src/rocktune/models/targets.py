"""What LoRA on ``all-linear`` adapts, decided by each module's role in the model rather than a list per family.

Adapted: every ``nn.Linear`` but the output head: attention, linear attention (Gated DeltaNet's ``in_proj_*`` and
``out_proj``), Mamba2's ``in_proj``/``out_proj``, dense MLPs, shared experts, Gemma 4's per-layer projections; the
routed experts (3-D parameters in transformers 5) through PEFT's parameter targeting. Left out, whatever their class
or what their forward returns:

- a router: the child of a mixture-of-experts block (a module that holds the 3-D expert stacks) whose weight has one
  row per expert, i.e. the module that produces the router logits. A moved router re-routes tokens to experts the
  adapter never trained on (and Llama 4's, an ``nn.Linear`` returning a tuple, cannot take a LoRA add at all).
- a 1-wide gate (``out_features == 1``, e.g. Qwen3.5-MoE's ``shared_expert_gate``): one scalar per token that mixes
  the shared expert in; a rank-r update of a single row is the same kind of switch as a router.
- a layer outside the text decoder (``get_decoder()``): a multimodal checkpoint loaded for a text task (Gemma 4's
  ``Gemma4ForConditionalGeneration``) has a vision tower and projector that text never runs through, so adapters
  there would train nothing and still be saved and exported.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch

LAYER = re.compile(r"^(.*\.)?layers\.\d+\.")


@dataclass
class TargetPlan:
    adapted: list[str] = field(default_factory=list)  # qualified names of the Linear modules LoRA wraps
    left_out: dict[str, list[str]] = field(default_factory=dict)  # why ("router", "1-wide gate") -> qualified names
    experts: list[str] = field(default_factory=list)  # the expert stacks' parameter names (target_parameters)
    others: set[str] = field(default_factory=set)  # the last names of every module not adapted

    def module_targets(self) -> list[str]:
        """``target_modules`` for PEFT: the adapted modules' last names, or their qualified names where a module
        not adapted (left out, or of another kind: Gemma 4's vision ``q_proj`` wrappers) shares a last name with an
        adapted one (PEFT matches a name by its suffix)."""
        short = {n.rsplit(".", 1)[-1] for n in self.adapted}
        return sorted(self.adapted) if short & self.others else sorted(short)


def plan_targets(model, experts: list[str]) -> TargetPlan:
    """The ``all-linear`` plan of a (not yet PEFT-wrapped) model; ``experts``: its expert stacks' parameter names
    (``models.load.moe_expert_parameters``)."""
    plan = TargetPlan(experts=experts)
    routers = {id(m) for m in router_modules(model)}
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    text = _text_modules(model)
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and module is not head and id(module) not in text:
            plan.left_out.setdefault("outside the text decoder", []).append(name)
        elif id(module) in routers:
            plan.left_out.setdefault("router", []).append(name)
        elif isinstance(module, torch.nn.Linear) and module is not head:
            if module.out_features == 1:
                plan.left_out.setdefault("1-wide gate", []).append(name)
            else:
                plan.adapted.append(name)
    taken = set(plan.adapted)
    plan.others = {n.rsplit(".", 1)[-1] for n, _ in model.named_modules() if n not in taken}
    return plan


def _text_modules(model) -> set[int]:
    """The ids of the modules text runs through: the decoder's (transformers' ``get_decoder``), or all of them."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model
    return {id(m) for m in (decoder if isinstance(decoder, torch.nn.Module) else model).modules()}


def router_modules(model) -> list[torch.nn.Module]:
    """The routers: in every module that holds an expert stack (a child with 3-D parameters, one matrix per expert;
    a convolution's 3-D kernel is not one; PEFT's wrappers of a stack are seen through), its other modules, at any
    depth, whose 2-D weight has one row per expert."""
    modules = dict(model.named_modules())
    found: dict[int, torch.nn.Module] = {}
    for name, owner in modules.items():
        stacks = [p for p in owner.parameters(recurse=False) if p.dim() == 3]
        if not stacks or isinstance(owner, torch.nn.modules.conv._ConvNd):
            continue
        while name.endswith(".base_layer"):
            name = name.removesuffix(".base_layer")
        inside = {id(m) for m in modules[name].modules()}  # the stacks, PEFT's wrappers of them and their factors
        block = modules[name.rpartition(".")[0]]
        # the block's descendants, not only its children: transformers 4's Granite MoE keeps the router's Linear
        # one level down (``router.layer``); never a LoRA factor (a rank may equal the number of experts)
        for sub, child in block.named_modules():
            weight = getattr(child, "weight", None)
            if sub and id(child) not in inside and ".lora_" not in f".{sub}" and isinstance(weight, torch.Tensor) \
                    and weight.dim() == 2 and weight.shape[0] == stacks[0].shape[0]:
                found[id(child)] = child
    return list(found.values())


def keep_v5_names() -> None:
    """Stop PEFT from renaming real targets (installed once; PEFT's private hook, so checked by the family tests).

    On transformers 5, PEFT rewrites the LoRA config of MoE families whose experts were fused since v4 (those on
    Qwen2-MoE's pattern: Qwen3-Next, GLM-4.5, ...): any target named ``gate_proj``/``up_proj``/``down_proj`` is taken
    for a v4 per-expert Linear and moved onto the fused expert stack. That drops the dense-layer MLPs and the shared
    experts, real ``nn.Linear`` modules of those names in v5, on training and again on every reload of the adapter
    (and doubles the experts' rank). A target that names a real Linear of the model is left as it is."""
    try:
        from peft.utils import transformers_weight_conversion as conv
    except ImportError:  # transformers 4 (an older torch's stack): PEFT has no v4->v5 rewrite to correct
        return

    if getattr(conv._convert_peft_config_moe, "keeps_v5_names", False):
        return
    original = conv._convert_peft_config_moe

    def convert(peft_config, model) -> None:
        targets = peft_config.target_modules
        real = {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
        keep = set() if isinstance(targets, str) else {t for t in targets or () if t.rsplit(".", 1)[-1] in real}
        if keep:
            peft_config.target_modules = set(targets) - keep
        try:
            original(peft_config, model)
        finally:
            if keep:
                peft_config.target_modules = set(peft_config.target_modules or ()) | keep

    convert.keeps_v5_names = True  # type: ignore[attr-defined]
    conv._convert_peft_config_moe = convert


def targets_note(model) -> str | None:
    """The run log's line on what LoRA adapted and left out, by kind (the module's place in a layer, e.g.
    ``self_attn``, ``linear_attn``, ``mlp.shared_expert``), for a PEFT-wrapped model; None when nothing is wrapped."""
    adapted: dict[str, set[str]] = {}
    for name, module in model.named_modules():
        if hasattr(module, "lora_A") and ".lora_" not in name:
            where, _, leaf = _in_layer(name).rpartition(".")
            where = where or "layer"
            if getattr(module, "parameter_name", None):  # an expert stack: PEFT nests one wrapper per parameter
                where, leaf = _in_layer(name).replace(".base_layer", ""), module.parameter_name
            adapted.setdefault(where if LAYER.match(name) else "model", set()).add(leaf)
    if not adapted:
        return None
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    routers = {id(m) for m in router_modules(base)}
    text, head = _text_modules(base), base.get_output_embeddings()
    linears = [(n, m) for n, m in base.named_modules() if isinstance(m, torch.nn.Linear) and m is not head]
    out = {"router": {_in_layer(n) for n, m in base.named_modules() if id(m) in routers},
           "1-wide gate": {_in_layer(n) for n, m in linears if m.out_features == 1 and id(m) in text},
           "outside the text decoder": {n.split(".layers.")[0] for n, m in linears if id(m) not in text}}
    said = "; ".join(f"{k}: {', '.join(sorted(v))}" for k, v in sorted(adapted.items()))
    left = "; ".join(f"{why} {', '.join(sorted(names))}" for why, names in out.items() if names)
    return f"lora targets: {said}" + (f" (left out: {left})" if left else "")


def _in_layer(name: str) -> str:
    """A module's name within its decoder layer (``model.layers.3.mlp.gate`` -> ``mlp.gate``)."""
    return LAYER.sub("", name)
