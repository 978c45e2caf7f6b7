"""The adapter alone as a GGUF LoRA, loaded by ``llama-cli -m base.gguf --lora adapter.gguf`` and Ollama's ADAPTER.

llama.cpp pairs ``<base tensor>.lora_a`` (r x in) with ``.lora_b`` (out x r) and scales B·A by alpha / r, r read
off each B. PEFT's own scale can differ from that per module (rsLoRA's alpha/sqrt(r), rank and alpha patterns), so
the ratio between the two is folded into B: the file then computes exactly what the PEFT model did. What llama.cpp
cannot apply as a LoRA (DoRA, trained biases, full copies of modules, head or embedding LoRAs) is refused before
any work, pointing at ``--to gguf``, which merges everything.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np

from rocktune.errors import UserError
from rocktune.export import arch as archs
from rocktune.tasks.vlm.export.gguf_vision import VisionFamily
from rocktune.tasks.vlm.vision.table import FAMILIES
from rocktune.readers.adapter import read_adapter_config

# families whose expert stacks PEFT adapts in transformers' x @ W storage (gpt-oss's it adapts as W @ x)
XW_EXPERTS = {"llama4_text"}
TEXT = FAMILIES["qwen2_vl"].gguf  # a text model's modules match neither side; Qwen's names were the first vlm adapters'


def _refuse(adapter: Path, what: str) -> None:
    raise UserError(f"{adapter}: {what}, which a GGUF LoRA cannot carry; export the merged model instead "
                    "(--to gguf or --to ollama), which includes every trained weight.")


def check_adapter(adapter: Path) -> dict:
    cfg = read_adapter_config(adapter, "restore the run directory from a copy, or train again.")
    if cfg.get("peft_type", "LORA") != "LORA":
        _refuse(adapter, f"the adapter is {cfg.get('peft_type')}, not LoRA")
    if cfg.get("use_dora"):
        _refuse(adapter, "the adapter is DoRA (a magnitude vector per weight)")
    if cfg.get("bias", "none") != "none":
        _refuse(adapter, f"the adapter trained biases (bias={cfg['bias']!r})")
    if cfg.get("modules_to_save"):
        _refuse(adapter, f"the adapter holds full trained copies of {cfg['modules_to_save']}")
    return cfg


def module_scale(module: str, cfg: dict, rank: int) -> float:
    """PEFT's scaling of one module: alpha / r (alpha / sqrt(r) with rsLoRA), with rank/alpha patterns applied."""
    alpha = float(cfg.get("lora_alpha", 8))
    for pattern, value in (cfg.get("alpha_pattern") or {}).items():
        if re.match(rf"(.*\.)?({pattern})$", module):
            alpha = float(value)
    return alpha / (math.sqrt(rank) if cfg.get("use_rslora") else rank)


def lora_tensors(adapter: Path, model_cfg, arch: archs.Arch,
                 family: VisionFamily = TEXT) -> tuple[dict[str, np.ndarray], float]:
    """GGUF-named lora_a / lora_b arrays (fp32) and the alpha to record (``family``: a vision-language model's, which
    says where its language model and its vision side sit)."""
    from safetensors.torch import load_file

    cfg = check_adapter(adapter)
    state = load_file(str(adapter / "adapter_model.safetensors"))
    heads = [k for k in state if "lora_embedding" in k or "lm_head" in k or "embed_tokens" in k]
    if heads:
        _refuse(adapter, f"the adapter changes the embedding or the output head ({heads[0]})")
    ignored = sorted({k.removeprefix("base_model.model.").split(f".{m}.")[0] + f".{m}"
                      for k in state for m in arch.no_lora if f".{m}." in k})
    if ignored:
        _refuse(adapter, f"the adapter adapts {ignored[0]} (llama.cpp's {arch.gguf_name} graph multiplies it without "
                         "applying a LoRA)")
    model_cfg = archs.language_config(model_cfg)  # a multimodal checkpoint's language model (Gemma 4's)
    name_of = archs.tensor_namer(model_cfg, arch)
    alpha = float(cfg.get("lora_alpha", 8))
    out: dict[str, np.ndarray] = {}
    for key in sorted(k for k in state if k.endswith(".lora_A.weight")):
        module = _language_model_name(adapter, key.removeprefix("base_model.model.").removesuffix(".lora_A.weight"),
                                      family)
        a = state[key].float().numpy()
        b = state[key.replace(".lora_A.", ".lora_B.")].float().numpy()
        if ".experts" in module:
            out.update(_expert_lora(adapter, module, (a, b), cfg, model_cfg, name_of))
            continue
        scale = module_scale(module, cfg, a.shape[0]) / (alpha / a.shape[0])
        parts = [(module, a, b)] if arch.lora_order is None else arch.lora_order(module, a, b, model_cfg)
        for part, part_a, part_b in parts:  # a fused projection llama.cpp keeps as several tensors: one pair each
            base = name_of(part + ".weight")
            if base is None:
                _refuse(adapter, f"the adapter adapts {module}, which has no GGUF tensor")
            out[base + ".lora_a"] = part_a
            out[base + ".lora_b"] = archs.to_gguf_layout(base, part_b * scale, model_cfg, arch)
    if not out:
        _refuse(adapter, "the adapter has no LoRA matrices")
    return out, alpha


def _language_model_name(adapter: Path, module: str, family: VisionFamily) -> str:
    """A vision-language adapter's module as the language model's GGUF names it; a LoRA on the vision tower or
    projector is refused: llama.cpp applies a LoRA file to the language model only, never to the mmproj."""
    if module.startswith(family.vision):
        _refuse(adapter, f"the adapter adapts the vision tower or projector ({module}), and llama.cpp applies a LoRA "
                         "to the language model only")
    return "model." + module.removeprefix(family.text) if module.startswith(family.text) else module


def _expert_lora(adapter: Path, module: str, ab: tuple[np.ndarray, np.ndarray], cfg: dict, model_cfg,
                 name_of) -> dict[str, np.ndarray]:
    """A LoRA on a 3-D expert parameter (PEFT's target_parameters) as llama.cpp's per-expert LoRA on the stacked
    ffn_*_exps tensor: lora_a (experts, r, in), lora_b (experts, out, r). PEFT stacks one wrapper per targeted
    parameter (``experts`` and ``experts.base_layer`` for two); a fused gate_up LoRA is the same A with B split
    between ffn_gate_exps and ffn_up_exps."""
    a, b = ab
    path = module.replace(".base_layer", "")
    n_exp, ff, hidden = archs.n_experts(model_cfg), archs.expert_ff(model_cfg), model_cfg.hidden_size
    # which parameter a wrapper adapts: its (in, out), never the same for the two (hidden = ff and 2 ff = hidden
    # cannot both hold); the wrappers' nesting follows PEFT's own order, not adapter_config's list. Llama 4's x @ W
    # stacks are adapted as stored: B·A is the transpose of what llama.cpp's W @ x tensors take
    transposed = model_cfg.model_type in XW_EXPERTS
    shapes = ({(2 * ff, hidden): "gate_up_proj", (hidden, ff): "down_proj"} if transposed
              else {(hidden, 2 * ff): "gate_up_proj", (ff, hidden): "down_proj"})
    param = shapes.get((a.shape[1], b.shape[0]))
    if param is None or not n_exp or a.shape[0] % n_exp or b.shape[1] != a.shape[0]:
        _refuse(adapter, f"the adapter adapts the experts of {path} in a layout rocktune does not map to llama.cpp's "
                         f"expert tensors (A {a.shape}, B {b.shape})")
    rank = a.shape[0] // n_exp
    alpha = float(cfg.get("lora_alpha", 8))
    lora_a = a.reshape(n_exp, rank, a.shape[1])  # PEFT's A rows: expert-major
    lora_b = b.reshape(b.shape[0], rank, n_exp).transpose(2, 0, 1)  # PEFT's B columns: rank-major
    if transposed:  # (B·A)^T = A^T·B^T
        lora_a, lora_b = lora_b.transpose(0, 2, 1), lora_a.transpose(0, 2, 1)
    lora_b = lora_b * (module_scale(f"{path}.{param}", cfg, rank) / (alpha / rank))
    # gate and up: the two halves of the fused rows, or every other row (gpt-oss)
    gate, up = ((lora_b[:, ::2], lora_b[:, 1::2]) if model_cfg.model_type == "gpt_oss"
                else (lora_b[:, :ff], lora_b[:, ff:]))
    parts = {"gate_proj": gate, "up_proj": up} if param == "gate_up_proj" else {"down_proj": lora_b}
    out = {}
    for part, part_b in parts.items():
        base = name_of(f"{path}.{part}.weight")
        if base is None:
            _refuse(adapter, f"the adapter adapts {path}.{param}, which has no GGUF tensor")
        out[base + ".lora_a"] = np.ascontiguousarray(lora_a)
        out[base + ".lora_b"] = np.ascontiguousarray(part_b)
    return out


def write_lora_gguf(tensors: dict[str, np.ndarray], alpha: float, arch: archs.Arch, path: Path, dtype: str,
                    name: str) -> None:
    import gguf

    writer = gguf.GGUFWriter(str(path), arch.gguf_name)
    writer.add_type(gguf.GGUFType.ADAPTER)
    writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
    writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, alpha)
    writer.add_name(name)
    for tname, data in tensors.items():
        writer.add_tensor(tname, data.astype(np.float16 if dtype == "f16" else np.float32))
    archs.write_out(writer)
