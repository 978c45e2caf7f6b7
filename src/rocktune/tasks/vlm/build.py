"""The vision-language model with its adapter: LoRA on the language model, the vision side frozen by default."""

from __future__ import annotations

from typing import cast

import torch

from rocktune.lora.moe import expert_path_note
from rocktune.models.load import apply_lora, moe_expert_parameters
from rocktune.errors import UserError
from rocktune.tasks.vlm.vision.families import Family
from rocktune.tasks.vlm.vision.model import family, language_targets, load_vlm, patch_embed_as_linear


PATCH_RULE = "rocm-conv3d-patch-embed"  # platform/knowledge.yaml


def patch_embed(model, setting: str, platform) -> list[str]:
    """``model.vision_patch_embed``: linear runs the patch embedding's Conv3d as its matmul; auto leaves it and says
    what the platform knowledge reports for this machine (a reported rule is shown, never applied silently)."""
    if setting == "linear":
        count = patch_embed_as_linear(model)
        if not count:
            raise UserError(f"model.vision_patch_embed=linear runs a Conv3d patch embedding as a matmul; "
                            f"{cast(Family, family(model.config)).name}'s vision tower has none (a Conv2d); "
                            "set it to auto.")
        return [f"vision patch embedding: {count} Conv3d run as one matmul each (model.vision_patch_embed=linear)"]
    if setting == "auto" and platform is not None:
        from rocktune.platform.advise import advise

        return [f"note: {f.message}; fix: {f.fix} [{f.id}]" for f in advise(platform).findings if f.id == PATCH_RULE]
    return []


def model_with_adapter(model_cfg, lora_cfg, precision: str, attn_implementation: str, device: str, platform=None):
    """(the PEFT model, notes): LoRA on the language model's linear layers unless lora.target_modules names others;
    the note says which parts carry adapters and that the vision tower and projector are frozen."""
    model = load_vlm(model_cfg.name_or_path, precision, attn_implementation, device)
    patch_notes = patch_embed(model, model_cfg.vision_patch_embed, platform)
    targets = _targets(model, lora_cfg)
    model = apply_lora(model, lora_cfg.r, lora_cfg.alpha, lora_cfg.dropout, targets,
                       model_cfg.gradient_checkpointing)
    frozen_tower_input(model)
    return model, [adapted_note(model)] + [n for n in (expert_path_note(model),) if n] + patch_notes


def _targets(model, lora_cfg):
    """PEFT's target_modules. ``all-linear`` on a mixture-of-experts language model (Qwen3.5-MoE) is the text
    tasks' own (models/targets.py: the text decoder's linear layers but its routers and 1-wide gates, plus the expert
    stacks, which are 3-D parameters that only its ``all-linear`` reaches), whose decoder leaves the vision side out;
    otherwise the language model's linear layers by name, with the vision side that ``lora.vision`` adds."""
    if lora_cfg.target_modules != "all-linear":
        return lora_cfg.target_modules
    if not moe_expert_parameters(model):
        return language_targets(model, lora_cfg.vision)
    if lora_cfg.vision != "none":
        raise UserError(f"lora.vision={lora_cfg.vision} with a mixture-of-experts language model "
                        f"({cast(Family, family(model.config)).name}): its expert stacks take LoRA through the text "
                        "tasks' all-linear, which adapts the language model only; set lora.vision: none, or list "
                        "the target modules yourself (the experts then stay frozen).")
    return "all-linear"


def frozen_tower_input(model) -> int:
    """Gradient checkpointing makes every input embedding's output require a gradient (transformers'
    ``enable_input_require_grads``), the vision tower's patch embedding included: the frozen tower would then keep
    its blocks' inputs and run its whole backward for a gradient nothing uses (the pixels are not trained; an adapter
    on the vision side needs no gradient of its input). The hook is removed from the vision side only; the language
    model's stays. Returns how many were removed."""
    removed, fam = 0, cast(Family, family(model.get_base_model().config))  # a supported family
    for name, module in model.named_modules():
        if not fam.in_vision(name.removeprefix("base_model.model.")) or not hasattr(module, "get_input_embeddings"):
            continue
        try:
            embed = module.get_input_embeddings()
        except NotImplementedError:
            continue
        for key, hook in list(getattr(embed, "_forward_hooks", {}).items()):
            if getattr(hook, "__name__", "") == "make_inputs_require_grads":  # transformers' hook, by its name
                del embed._forward_hooks[key]
                removed += 1
    return removed


def adapted_note(model) -> str:
    """Which parts carry adapters, counted, and which stay frozen: the run log's statement of what trains."""
    fam = cast(Family, family(model.get_base_model().config))  # a supported family
    parts = {"language": 0, "projector": 0, "tower": 0}
    for name, module in model.named_modules():
        if isinstance(getattr(module, "lora_A", None), torch.nn.ModuleDict) and len(module.lora_A):
            parts[fam.part(name.removeprefix("base_model.model."))] += 1
    words = {"language": "language-model", "projector": "projector", "tower": "vision-tower"}
    trained = " and ".join(f"{n} {words[p]}" for p, n in parts.items() if n)
    every, tower = ", ".join(f"{root}.*" for root in fam.roots), f"{fam.roots[0]}.*"
    frozen = {(True, True): f"; the vision tower and projector ({every}) are frozen",
              (True, False): f"; the vision tower ({tower}) is frozen", (False, True): "; the projector is frozen",
              (False, False): ""}[(not parts["tower"], not parts["projector"])]
    return f"LoRA on {trained} modules" + frozen
