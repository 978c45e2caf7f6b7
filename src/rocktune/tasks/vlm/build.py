"""The vision-language model with its adapter: LoRA on the language model, the vision side frozen by default."""

from __future__ import annotations

import torch

from rocktune.model import apply_lora
from rocktune.vision_model import VISION_PREFIX, in_vision, language_targets, load_vlm, patch_embed_as_linear


PATCH_RULE = "rocm-conv3d-patch-embed"  # platform/knowledge.yaml


def patch_embed(model, setting: str, platform) -> list[str]:
    """``model.vision_patch_embed``: linear runs the patch embedding's Conv3d as its matmul; auto leaves it and says
    what the platform knowledge reports for this machine (a reported rule is shown, never applied silently)."""
    if setting == "linear":
        return [f"vision patch embedding: {patch_embed_as_linear(model)} Conv3d run as one matmul each "
                "(model.vision_patch_embed=linear)"]
    if setting == "auto" and platform is not None:
        from rocktune.platform.advise import advise

        return [f"note: {f.message}; fix: {f.fix} [{f.id}]" for f in advise(platform).findings if f.id == PATCH_RULE]
    return []


def model_with_adapter(model_cfg, lora_cfg, precision: str, attn_implementation: str, device: str, platform=None):
    """(the PEFT model, notes): LoRA on the language model's linear layers unless lora.target_modules names others;
    the note says which parts carry adapters and that the vision tower and projector are frozen."""
    model = load_vlm(model_cfg.name_or_path, precision, attn_implementation, device)
    patch_notes = patch_embed(model, model_cfg.vision_patch_embed, platform)
    targets = language_targets(model) if lora_cfg.target_modules == "all-linear" else lora_cfg.target_modules
    model = apply_lora(model, lora_cfg.r, lora_cfg.alpha, lora_cfg.dropout, targets,
                       model_cfg.gradient_checkpointing)
    adapted = [n for n, m in model.named_modules() if hasattr(m, "lora_A") and isinstance(m, torch.nn.Module)
               and any(True for _ in m.lora_A.values())]
    vision = sum(in_vision(n.removeprefix("base_model.model.")) for n in adapted)
    if vision:
        where = f"LoRA on {len(adapted) - vision} language-model and {vision} vision-tower/projector modules " \
                "(lora.target_modules reaches the vision side)"
    else:
        where = (f"LoRA on {len(adapted)} language-model modules; the vision tower and projector "
                 f"({VISION_PREFIX}.*) are frozen")
    return model, [where] + patch_notes
