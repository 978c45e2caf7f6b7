"""The merged model as one GGUF file for llama.cpp, Ollama and LM Studio, written with gguf-py.

The caller supplies fp32 tensors (the merge is done in fp32); each is renamed with gguf-py's tensor map, put in
llama.cpp's rotary layout where the architecture needs it, and cast or quantised once.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from rocktune.errors import UserError
from rocktune.export import arch as archs
from rocktune.export import mxfp4 as packs
from rocktune.export import quant as quants
from rocktune.export.vocab import add_vocab, loader_safe_name


def gguf_tensors(state: dict, cfg, arch: archs.Arch) -> dict[str, np.ndarray]:
    """HF state dict (torch, any dtype) -> GGUF-named fp32 arrays in llama.cpp's layout."""
    state, cfg = archs.language_state(state, cfg), archs.language_config(cfg)
    name_of = archs.tensor_namer(cfg, arch)
    tied = getattr(cfg, "tie_word_embeddings", False)
    out: dict[str, np.ndarray] = {}
    for key, tensor in state.items():
        if key.endswith("rotary_emb.inv_freq") or (tied and key == "lm_head.weight"):
            continue  # recomputed by llama.cpp / the head reuses token_embd when tied
        if tied and arch.output_required and name_of(key) == "token_embd.weight":
            out["output.weight"] = tensor.detach().float().cpu().numpy()  # this loader has no tied head
        for part, data in archs.hf_parts(key, tensor.detach().float().cpu().numpy(), cfg, arch):
            name = name_of(part)
            if name is None:
                raise UserError(f"GGUF export does not know where the tensor {key} of this {cfg.model_type} model "
                                "goes; the checkpoint has parts the supported architecture lacks. Use --to merged.")
            out[name] = archs.to_gguf_layout(name, data, cfg, arch)
    out.update(archs.extra_tensors(cfg, arch))
    return out


def row_lengths(cfg) -> dict[str, int]:
    """Row length (GGUF's ne[0]) of each kind of matrix, from the config alone: what block sizes must divide."""
    cfg = archs.language_config(cfg)
    hd = archs.head_dim(cfg)
    rows = {"token_embd/attn_q/k/v/ffn_gate/up": cfg.hidden_size,
            "attn_output": cfg.num_attention_heads * hd, "ffn_down": cfg.intermediate_size}
    if archs.n_experts(cfg):
        rows["ffn_down_exps"] = archs.expert_ff(cfg)
    return rows


def write_model_gguf(tensors: dict[str, np.ndarray], cfg, arch: archs.Arch, tokenizer_dir: Path, path: Path,
                     quant: str, name: str, source: str | None = None) -> None:
    """Write ``tensors`` (from ``gguf_tensors``) as a GGUF model file at ``path`` (k-quants via llama.cpp);
    ``source``: the digest of what it was made from (export/reuse.py), kept in its metadata."""
    if quants.QUANTS[quant][2]:
        f32 = path.with_name(path.name + ".f32")
        try:
            # llama.cpp's quantiser requantises no block type: packed experts go in as their values
            _write(packs.unpacked(tensors), cfg, arch, tokenizer_dir, f32, "f32", name, source)
            quants.llama_cpp_quantize(str(f32), str(path), quant)  # llama-quantize copies the metadata
        finally:
            f32.unlink(missing_ok=True)
        return
    _write(tensors, cfg, arch, tokenizer_dir, path, quant, name, source)


def _write(tensors, cfg, arch, tokenizer_dir: Path, path: Path, quant: str, name: str, source: str | None) -> None:
    import gguf

    from rocktune.export.reuse import KEY

    cfg = archs.language_config(cfg)
    writer = gguf.GGUFWriter(str(path), arch.gguf_name)
    writer.add_type(gguf.GGUFType.MODEL)
    writer.add_name(loader_safe_name(name, tokenizer_dir))
    if source is not None:
        writer.add_string(KEY, source)
    writer.add_file_type(packs.file_type(tensors, quants.file_type(quant)))
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    archs.add_hparams(writer, cfg, arch)
    add_vocab(writer, tokenizer_dir, cfg.vocab_size)
    for tname, data in tensors.items():
        encoded, raw = (data.data, data.ggml_type) if isinstance(data, packs.Packed) else \
            quants.encode(data, "f32" if archs.keeps_f32(tname) else quant)  # Packed: a base's own MXFP4 blocks
        writer.add_tensor(tname, encoded, raw_dtype=raw)
    archs.write_out(writer)
