"""Base + LoRA -> one plain transformers model, merged in fp32 and cast once.

Merging in the training dtype rounds W + s·BA to bf16 per layer and drifts from what the adapter computed
(peft#1388), so the base is loaded in fp32, merged, and only the result is cast. A tied head is untied first when
the adapter changed the head or the embedding: merging into a shared tensor would move both, and a saved config
that still says "tied" reloads the head from the embedding (transformers#45127, peft#2777).
"""

from __future__ import annotations

from pathlib import Path

from rocktune.errors import UserError, first_line
from rocktune.export.source import Source, load_config
from rocktune.readers.adapter import names, read_adapter_config

DTYPE_NAMES = ("auto", "fp32", "bf16", "fp16")
HEAD_MODULES = ("lm_head", "embed_tokens", "wte", "embed_in", "embed_out")


def base_dtype(name_or_path: str, trust_remote_code: bool) -> str:
    """The base checkpoint's own dtype, as rocktune names it (fp32 when the config does not say)."""
    cfg = load_config(name_or_path, trust_remote_code)
    dtype = str(getattr(cfg, "dtype", None) or getattr(cfg, "torch_dtype", None) or "float32")
    return {"torch.bfloat16": "bf16", "bfloat16": "bf16", "torch.float16": "fp16", "float16": "fp16"}.get(dtype,
                                                                                                       "fp32")


def touches_head(adapter: Path) -> bool:
    """Does the adapter change the output head or the input embedding (LoRA on them, or full copies)?"""
    cfg = read_adapter_config(adapter, "restore the run directory from a copy, or train again.")
    modules = names(cfg, "target_modules") + names(cfg, "modules_to_save")
    return any(h in n for n in modules for h in HEAD_MODULES if n != "all-linear")


def load_base_fp32(name_or_path: str, trust_remote_code: bool):
    import torch
    from transformers import AutoModelForCausalLM

    from rocktune.models import mxfp4
    from rocktune.models.load import quiet_transformers

    from rocktune.tasks.vlm.vision.model import model_class

    quiet_transformers()
    vision = model_class(load_config(name_or_path, trust_remote_code))  # task=vlm: the vision tower comes along
    try:
        if vision is not None:
            return vision.from_pretrained(name_or_path, dtype=torch.float32)
        # MXFP4 experts (gpt-oss): dequantised as training loaded them, also where transformers' kernels would
        # keep them packed (a merge adds the LoRA delta to each stack as a tensor)
        return AutoModelForCausalLM.from_pretrained(name_or_path, dtype=torch.float32,
                                                    trust_remote_code=trust_remote_code,
                                                    **mxfp4.load_kwargs(name_or_path, "none"))
    except (OSError, ValueError) as exc:
        raise UserError(f"could not load the base model {name_or_path}: {first_line(exc)} "
                        "(offline? pass a local model directory with --base)") from None


def untie_head(model) -> bool:
    """Give the head its own copy of the embedding matrix; returns whether it was tied."""
    import torch

    if not getattr(model.config, "tie_word_embeddings", False):
        return False
    head = model.get_output_embeddings()
    head.weight = torch.nn.Parameter(head.weight.detach().clone(), requires_grad=False)
    model.config.tie_word_embeddings = False
    return True


def merged_model(src: Source, dtype: str):
    """Load base fp32, apply the adapter, merge, cast to ``dtype`` ('auto': the base checkpoint's dtype)."""
    import torch
    from peft import PeftModel

    from rocktune.models.load import DTYPES

    if src.adapter is None:
        raise UserError(f"{src.base} is a model directory without an adapter: there is nothing to merge.")
    target = base_dtype(src.base, src.trust_remote_code) if dtype == "auto" else dtype
    model = load_base_fp32(src.base, src.trust_remote_code)
    untied = untie_head(model) if touches_head(src.adapter) else False
    try:
        peft_model = PeftModel.from_pretrained(model, str(src.adapter), torch_device="cpu")
        merged = peft_model.merge_and_unload(safe_merge=True)
    except ValueError as exc:
        raise UserError(f"could not merge {src.adapter} into {src.base}: {first_line(exc)}") \
            from None
    with torch.no_grad():
        merged = merged.to(DTYPES[target])
    merged.config.use_cache = True  # a training run switches it off; the exported model is for inference
    notes = [f"merged in fp32, saved as {target}"]
    if target != "fp32":  # llama.cpp's converter would cast it again: two roundings instead of one
        notes.append(f"for a GGUF, use --to gguf (one rounding) or --dtype fp32 before llama.cpp's converter; this "
                     f"{target} copy would be rounded a second time")
    if untied:
        notes.append("the adapter changed the tied head/embedding: the head is saved as its own tensor "
                     "(tie_word_embeddings=false) so it reloads as trained")
    return merged, notes


def save_merged(model, tok, out: Path, base: str | None = None) -> None:
    """Write ``model`` and the run's tokenizer ``tok`` (the chat template it trained with included) into ``out``; a
    vision-language model also gets its base's image processor (``preprocessor_config.json``) and the combined
    processor's settings (``processor_config.json``), so that the merged directory sees as the base did, also through
    transformers' ``AutoProcessor``."""
    from rocktune.tasks.vlm.vision.model import model_class, save_processor_settings, with_processor_template

    model.save_pretrained(out, safe_serialization=True)
    if base is not None and model_class(model.config) is not None:
        from transformers import AutoImageProcessor

        AutoImageProcessor.from_pretrained(base).save_pretrained(out)
        save_processor_settings(model.config, out)
        tok = with_processor_template(tok, base)
    tok.save_pretrained(out)
