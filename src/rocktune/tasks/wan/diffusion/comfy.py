"""The Wan LoRA file ComfyUI and diffusers both load: ``RUN/wan_lora.safetensors``.

Training wraps diffusers' ``WanTransformer3DModel``, whose module names differ from the ones in Wan's own repository,
which ComfyUI's Wan model keeps. This file uses Wan's original names, the form most published Wan LoRAs take.

What was confirmed, and where:

- Name map. diffusers' ``convert_wan_transformer_to_diffusers`` (loaders/single_file_utils.py, diffusers 0.42) renames
  Wan's original checkpoint keys: ``self_attn``/``cross_attn`` -> ``attn1``/``attn2``; ``.q .k .v .o`` -> ``.to_q
  .to_k .to_v .to_out.0``; ``k_img``/``v_img`` -> ``add_k_proj``/``add_v_proj``; ``ffn.0``/``ffn.2`` ->
  ``ffn.net.0.proj``/``ffn.net.2``; ``time_projection.1`` -> ``condition_embedder.time_proj``; ``head.head`` ->
  ``proj_out``; ``text_embedding.0/.2`` and ``time_embedding.0/.2`` -> ``condition_embedder.text_embedder
  .linear_1/_2`` and ``.time_embedder.linear_1/_2``; ``img_emb.proj.1/.3`` -> ``condition_embedder.image_embedder
  .ff.net.0.proj/.ff.net.2``. ComfyUI's ``comfy/ldm/wan/model.py`` builds its WanModel with these original names.
- diffusers' loader. ``WanLoraLoaderMixin.lora_state_dict`` converts any file with a key starting ``diffusion_model.``
  through ``_convert_non_diffusers_wan_lora_to_diffusers`` (loaders/lora_conversion_utils.py). It accepts
  ``lora_A``/``lora_B`` (or ``lora_down``/``lora_up``). For block modules it reads ``<name>.alpha`` and multiplies
  alpha/rank into the two matrices; for the modules outside the blocks it never reads ``.alpha``, and any key left
  over makes it raise ("state_dict should be empty"). It finds the blocks with ``min()`` over the block numbers, so a
  file without a block module fails to load, and it converts ``k_img``/``v_img`` only when both appear. The converted
  adapter is loaded with lora_alpha == rank (scale 1), utils/peft_utils.py ``get_peft_kwargs``.
- ComfyUI's loader (comfy/lora.py). ``model_lora_keys_unet`` maps ``diffusion_model.<name>`` (the model's own weight
  name without ``.weight``) onto that weight for every model, Wan included. ``load_lora`` accepts
  ``<x>.lora_B.weight`` / ``<x>.lora_A.weight`` (also ``lora_up``/``lora_down``) and ``<x>.alpha``; it scales the
  product by alpha / rank (rank = lora_A's first dimension) and by 1.0 when ``.alpha`` is absent.
"""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from rocktune.atomic import kill_point
from rocktune.errors import UserError

if TYPE_CHECKING:
    import torch

LORA_FILE = "wan_lora.safetensors"  # in the run directory: ComfyUI and diffusers' WanPipeline both load it
PREFIX = "diffusion_model."
_PEFT_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<half>[AB])(?:\.default)?\.weight$")
_BLOCK = re.compile(r"^blocks\.(?P<index>\d+)\.(?P<rest>.+)$")

# diffusers name inside a transformer block -> Wan's original name
_IN_BLOCK = {
    "attn1.to_q": "self_attn.q", "attn1.to_k": "self_attn.k", "attn1.to_v": "self_attn.v",
    "attn1.to_out.0": "self_attn.o",
    "attn2.to_q": "cross_attn.q", "attn2.to_k": "cross_attn.k", "attn2.to_v": "cross_attn.v",
    "attn2.to_out.0": "cross_attn.o",
    "attn2.add_k_proj": "cross_attn.k_img", "attn2.add_v_proj": "cross_attn.v_img",
    "ffn.net.0.proj": "ffn.0", "ffn.net.2": "ffn.2",
}
# diffusers name outside the blocks -> Wan's original name
_OUTSIDE = {
    "condition_embedder.time_proj": "time_projection.1",
    "proj_out": "head.head",
    "condition_embedder.text_embedder.linear_1": "text_embedding.0",
    "condition_embedder.text_embedder.linear_2": "text_embedding.2",
    "condition_embedder.time_embedder.linear_1": "time_embedding.0",
    "condition_embedder.time_embedder.linear_2": "time_embedding.2",
    "condition_embedder.image_embedder.ff.net.0.proj": "img_emb.proj.1",
    "condition_embedder.image_embedder.ff.net.2": "img_emb.proj.3",
}


def original_name(diffusers_module: str) -> str | None:
    """Wan's original name for a diffusers transformer module, or None where ComfyUI/diffusers could not load it."""
    block = _BLOCK.match(diffusers_module)
    if block is None:
        return _OUTSIDE.get(diffusers_module)
    rest = _IN_BLOCK.get(block["rest"])
    return None if rest is None else f"blocks.{block['index']}.{rest}"


def check_targets(module_names: list[str]) -> None:
    """Refuse, before training, targets whose LoRA the written file could not carry into ComfyUI or diffusers."""
    unmapped = [name for name in module_names if original_name(name) is None]
    if unmapped:
        shown = ", ".join(unmapped[:8]) + (f" and {len(unmapped) - 8} more" if len(unmapped) > 8 else "")
        raise UserError(f"lora.target_modules selects modules a Wan LoRA file cannot name for ComfyUI or diffusers: "
                        f"{shown}. Target the blocks' attention (attn1/attn2 to_q, to_k, to_v, to_out.0) and "
                        "feed-forward (ffn.net.0.proj, ffn.net.2) linears, or remove these from lora.target_modules.")
    if module_names and not any(_BLOCK.match(name) for name in module_names):
        raise UserError("lora.target_modules selects no module inside the transformer blocks; diffusers' Wan LoRA "
                        "loader cannot load such a file. Add the blocks' attention or feed-forward linears.")
    img = {name.rsplit(".", 1)[-1] for name in module_names if name.endswith((".add_k_proj", ".add_v_proj"))}
    if len(img) == 1:
        raise UserError(f"lora.target_modules selects attn2.{img.pop()} without its pair; diffusers loads the "
                        "image cross-attention LoRA only with both add_k_proj and add_v_proj. Target both or neither.")


def comfy_state_dict(peft_state: dict[str, torch.Tensor], r: int, alpha: float,
                     dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """PEFT LoRA tensors -> ``diffusion_model.<original>.lora_A/.lora_B.weight`` (+ ``.alpha`` in the blocks)."""
    import torch

    dtype = dtype or torch.float32
    halves: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in peft_state.items():
        match = _PEFT_KEY.match(key)
        if match is None:
            raise UserError(f"LoRA tensor {key} is not a plain lora_A/lora_B weight; a Wan LoRA file carries only "
                            "those (DoRA magnitudes and LoRA biases have no place in it).")
        halves.setdefault(match["module"], {})[match["half"]] = tensor
    check_targets(sorted(halves))
    out = {}
    for module, pair in sorted(halves.items()):
        if set(pair) != {"A", "B"}:
            raise UserError(f"LoRA module {module} has lora_{''.join(pair)} but not its other half; the adapter "
                            "state is incomplete (a damaged checkpoint?).")
        original = original_name(module)
        assert original is not None  # check_targets refused every module without an original name
        name = PREFIX + original
        down, up = pair["A"].float(), pair["B"].float()
        if _BLOCK.match(module):
            out[f"{name}.alpha"] = torch.tensor(float(alpha))
        else:
            # diffusers' converter drops .alpha for modules outside the blocks (a leftover key even makes it raise),
            # while ComfyUI scales by 1.0 without one: folding alpha/r into lora_B loads the same in both.
            up = up * (alpha / r)
        out[f"{name}.lora_A.weight"] = down.to(dtype).contiguous()
        out[f"{name}.lora_B.weight"] = up.to(dtype).contiguous()
    return out


def write_lora(path: Path, peft_state: dict[str, torch.Tensor], r: int, alpha: float, metadata: dict[str, str],
               dtype: torch.dtype | None = None) -> Path:
    """Write the ComfyUI/diffusers Wan LoRA file atomically (a temp name renamed over ``path``); returns ``path``.

    ``metadata`` (e.g. base model, task) is stored in the safetensors header beside rank, alpha and rocktune's
    version; values must be strings.
    """
    from safetensors.torch import save_file

    from rocktune import __version__

    tensors = comfy_state_dict(peft_state, r, alpha, dtype)
    header = {"format": "pt", "rocktune_version": __version__, "lora_rank": str(r), "lora_alpha": str(alpha),
              **metadata}
    path = Path(path)
    for stale in path.parent.glob(f".{path.name}.*.tmp"):  # left by a write that was killed: never read, cleared
        stale.unlink(missing_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        save_file(tensors, tmp, metadata=header)
        kill_point("lora_file.written")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path
