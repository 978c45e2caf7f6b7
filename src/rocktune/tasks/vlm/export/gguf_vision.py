"""A merged vision-language model (task=vlm) as llama.cpp runs it: two GGUF files, the language model
(``general.architecture`` qwen2vl, qwen3vl, gemma3 or llama) and the vision tower with its projector in llama.cpp's
mmproj layout (architecture ``clip``, ``v.*`` / ``mm.*`` tensors), written with gguf-py's names and keys. One entry
per family says where its vision side sits and which of llama.cpp's projector types runs it.

Facts taken from llama.cpp (its converter's Qwen2-VL classes and mtmd's clip loader), not its code: the patch
embedding's Conv3d (temporal kernel 2) is stored as two Conv2d kernels, ``v.patch_embd.weight`` and
``v.patch_embd.weight.1``; the fused ``qkv`` of each vision block as separate q/k/v (Qwen3-VL keeps it fused, and
adds learned position embeddings and deepstack mergers); Qwen2.5-VL's full-attention
blocks as one period ``clip.vision.n_wa_pattern``, while the window itself is fixed at 112 pixels in mtmd (no key).
Gemma 3 (projector gemma3) and Idefics3/SmolVLM (idefics3) have a SigLIP tower; Gemma 3's soft-embedding norm is
stored as 1 + w (Gemma's RMSNorm), its pooling kernel as the projector's scale factor (mtmd assumes 4 otherwise);
Idefics3's pixel shuffle as the scale factor and its resize-before-tiling side as the preprocessing image size.
A family or configuration llama.cpp would compute differently is refused before any weight is loaded.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from rocktune.errors import UserError
from rocktune.export import arch as archs
from rocktune.export import quant as quants
# the run's image-token range (ImageTokens, for next_command.py and main.py): below the trainer too, whose adapter card
# writes the same llama.cpp flags
from rocktune.tasks.vlm.vision.families import ImageTokens as ImageTokens
from rocktune.tasks.vlm.vision.families import image_tokens
from rocktune.tasks.vlm.vision import table as vision_table
from rocktune.tasks.vlm.vision.table import GgufFacts

LLAMA_CPP_WINDOW = 112  # pixels: mtmd's Qwen2.5-VL window attention ignores the config's window_size
VISION_EPS = 1e-6  # transformers' Qwen2-VL/2.5-VL vision norms use this fixed epsilon
GEMMA3_POOL = 4  # mtmd's Gemma 3 pooling kernel when the mmproj does not say


# one entry per family in the one table (tasks/vlm/vision/table.py, read live): llama.cpp's projector type, where the
# vision side sits in the state dict, and the flags that change what is written
VisionFamily = GgufFacts


def family_facts(kind: str) -> VisionFamily | None:
    """The GGUF facts of the vision-language family ``kind`` (a model_type), None for a family the table lacks."""
    entry = vision_table.FAMILIES.get(kind)
    return entry.gguf if entry is not None else None


def is_vision(cfg) -> bool:
    return getattr(cfg, "vision_config", None) is not None and getattr(cfg, "text_config", None) is not None


def check(cfg) -> VisionFamily:
    """The family's projector, or a refusal saying why this model cannot be exported with its eyes."""
    kind = getattr(cfg, "model_type", "?")
    family = family_facts(kind)
    if family is None:
        raise UserError(f"GGUF export does not know the vision-language family {kind} (supported: "
                        f"{', '.join(sorted(vision_table.FAMILIES))}); a GGUF without its vision projector would be a "
                        "model that cannot see. Use --to merged.")
    vision = cfg.vision_config
    if getattr(vision, "temporal_patch_size", 2) != 2:
        raise UserError(f"GGUF export: this {kind} model's temporal_patch_size is {vision.temporal_patch_size}; "
                        "llama.cpp's mmproj holds the patch embedding as two frames (2). Use --to merged.")
    if family.windows:
        wa_pattern(vision)
    if family.pooling:
        gemma3_pooling(cfg)
    if family.imrope:
        imrope_pairs(cfg.text_config)
    deep = len(getattr(vision, "deepstack_visual_indexes", None) or [])
    if deep and deep >= cfg.text_config.num_hidden_layers:  # llama.cpp adds them after its last layer has been cut
        raise UserError(f"GGUF export: this {kind} model feeds {deep} deepstack layers into a language model of "
                        f"{cfg.text_config.num_hidden_layers}; llama.cpp's graph can feed every layer but the last. "
                        "Use --to merged.")
    archs.arch_for(text_config(cfg))
    return family


def imrope_pairs(text) -> None:
    """Qwen3.5's language model rotates ``head_dim x partial_rotary_factor / 2`` pairs, pair i by height when
    i % 3 == 1 and i < 3 x the height section, by width likewise (i % 3 == 2), else by time. llama.cpp's imrope counts
    the pair modulo the sections' sum and gives time only those with i % 3 == 0 within 3 x the time section, the rest
    a fourth position. Text alone cannot tell (its three positions are one), an image's tokens can: a pair placed
    otherwise is refused. The released sections [11, 11, 10] over 32 pairs place every pair alike."""
    rope = getattr(text, "rope_parameters", None) or {}
    sections = [int(x) for x in rope.get("mrope_section") or [11, 11, 10]] + [0, 0, 0]
    pairs = int(int(text.head_dim) * float(rope.get("partial_rotary_factor", 1.0))) // 2
    total = sum(sections[:4]) or 1

    def ours(i: int) -> str:
        return {1: "h", 2: "w"}[i % 3] if i % 3 and i < 3 * sections[i % 3] else "t"

    def theirs(i: int) -> str:
        s = i % total
        return "thw"[s % 3] if s < 3 * sections[s % 3] else "e"

    moved = [i for i in range(pairs) if ours(i) != theirs(i)]
    if moved:
        raise UserError(f"GGUF export: this Qwen3.5 model's interleaved rotary sections {sections[:3]} over its "
                        f"{pairs} rotated pairs place pairs {moved} by another position in llama.cpp than in "
                        "transformers, which changes what it computes for image tokens. Use --to merged.")


def wa_pattern(vision) -> int:
    """Qwen2.5-VL's full-attention blocks as llama.cpp's period (block i is full when (i + 1) % period == 0; 0: no
    block attends in windows)."""
    full = list(getattr(vision, "fullatt_block_indexes", None) or [])
    depth = int(vision.depth)
    period = full[0] + 1 if full else 0
    if not full or [i for i in range(depth) if (i + 1) % period == 0] != full:
        raise UserError(f"GGUF export: this Qwen2.5-VL vision tower's full-attention blocks {full} are not every "
                        "n-th block, which is all llama.cpp's mmproj can say (n_wa_pattern). Use --to merged.")
    windowed = len(full) < depth
    if not windowed:  # every block attends fully: llama.cpp's converter would write period 1, with which mtmd aborts
        return 0      # ("Failed to get tensor window_mask"); 0 is mtmd's "no window attention", the same result
    if int(getattr(vision, "window_size", LLAMA_CPP_WINDOW)) != LLAMA_CPP_WINDOW:
        raise UserError(f"GGUF export: this Qwen2.5-VL vision tower attends in windows of {vision.window_size} "
                        f"pixels; llama.cpp's are fixed at {LLAMA_CPP_WINDOW}. Use --to merged.")
    return period


def gemma3_pooling(cfg) -> int:
    """Gemma 3's projector averages kernel x kernel patches into each soft token; llama.cpp's mmproj says the kernel
    (``clip.vision.projector.scale_factor``, 4 when absent), so the grid must pool evenly into a square of tokens."""
    side = int(round(cfg.mm_tokens_per_image ** 0.5))
    patches = int(cfg.vision_config.image_size) // int(cfg.vision_config.patch_size)
    if side * side != cfg.mm_tokens_per_image or side == 0 or patches % side:
        raise UserError(f"GGUF export: this Gemma 3 model pools {patches} x {patches} patches into "
                        f"{cfg.mm_tokens_per_image} soft tokens, not an even square grid, which is all llama.cpp's "
                        "mmproj can say (one pooling kernel). Use --to merged.")
    return patches // side


def tokenizer_notes(cfg, tokenizer) -> list[str]:
    """What llama.cpp's mtmd needs of the tokenizer that the export cannot write: Idefics3's tile layout looks up
    "\n" and "\n\n" as single tokens (SmolVLM's tokenizer has them; without, llama-cpp-python 0.3.36 aborts)."""
    if not vision_table.FAMILIES[cfg.model_type].gguf.projector == "IDEFICS3":
        return []
    missing = [repr(t) for t in ("\n", "\n\n") if len(tokenizer.encode(t, add_special_tokens=False)) != 1]
    return [f"this tokenizer has no single token for {' and '.join(missing)}, which llama.cpp's mtmd looks up to lay "
            "out Idefics3/SmolVLM image tiles; llama.cpp may refuse or abort on an image with it"] if missing else []


def text_config(cfg):
    """The language model's config as the text GGUF writer reads it (the head's tying is the outer config's)."""
    text = cfg.text_config
    text.tie_word_embeddings = bool(getattr(cfg, "tie_word_embeddings", getattr(text, "tie_word_embeddings", False)))
    # Qwen3-VL's language model adds the vision tower's deepstack features in its first layers: it says how many
    text.num_deepstack_layers = len(getattr(cfg.vision_config, "deepstack_visual_indexes", None) or [])
    return text


def split_state(state: dict, cfg) -> tuple[dict, dict]:
    """transformers' module names -> (language model as a causal LM's ``model.*``/``lm_head``, vision side as the
    checkpoint names gguf-py's tables know: Qwen's ``visual.*``, Gemma 3's ``vision_tower.*`` /
    ``multi_modal_projector.*``, SmolVLM's ``model.vision_model.*`` / ``model.connector.*``)."""
    family = vision_table.FAMILIES[cfg.model_type].gguf
    text, vision = {}, {}
    for key, tensor in state.items():
        if key.startswith(family.vision):
            vision[_checkpoint_name(key, family)] = tensor
        elif key.startswith(family.text):
            text["model." + key.removeprefix(family.text)] = tensor
        else:
            text[key] = tensor
    return text, vision


def _checkpoint_name(key: str, family: VisionFamily) -> str:
    name = key if family.keep_model else key.removeprefix("model.")
    if family.tower and name.startswith(family.tower[0]) and not name.startswith(family.tower[1]):
        name = family.tower[1] + name.removeprefix(family.tower[0])
    return name


def mmproj_tensors(vision_state: dict, cfg) -> dict[str, np.ndarray]:
    """HF vision tower (torch) -> mmproj-named fp32 arrays in llama.cpp's layout."""
    import gguf

    vision = cfg.vision_config
    depth = int(getattr(vision, "depth", None) or vision.num_hidden_layers)
    # the projector's layers (visual.merger.mlp.0 and .2) are looked up by index like blocks: a one-block tower
    # still needs indexes up to 2
    table = gguf.get_tensor_name_map(gguf.MODEL_ARCH.MMPROJ, max(depth, 3))
    family = vision_table.FAMILIES[cfg.model_type].gguf
    out: dict[str, np.ndarray] = {}
    for key, tensor in vision_state.items():
        data = tensor.detach().float().cpu().numpy()
        direct = _qwen3_name(key, vision) if family.deepstack else None
        if direct:
            out[direct] = data
            continue
        for part, piece, tail in _pieces(key, data, split_qkv=not family.deepstack):
            name = table.get_name(part.replace("_weight", ".weight"), try_suffixes=(".weight", ".bias"))
            if name is None:
                raise UserError(f"GGUF export does not know where the vision tensor {key} of this {cfg.model_type} "
                                "model goes in llama.cpp's mmproj; use --to merged.")
            out[name + tail] = piece + _norm_shift(name)
    return out


def _norm_shift(name: str) -> float:
    """Gemma 3's soft-embedding norm scales by (1 + w) (Gemma's RMSNorm); llama.cpp's by the stored weight."""
    return 1.0 if name == "mm.soft_emb_norm.weight" else 0.0


def _qwen3_name(key: str, vision) -> str | None:
    """Qwen3-VL's projector and deepstack mergers, which gguf-py's table does not map: the merger's norm is
    ``v.post_ln``, its two layers ``mm.0`` / ``mm.2`` (as Qwen2-VL's); deepstack merger i (after block
    deepstack_visual_indexes[i]) is ``v.deepstack.<block>.{norm,fc1,fc2}``."""
    import gguf

    parts = key.split(".")
    kind = parts[-1]
    layer = {"norm": "norm", "linear_fc1": "fc1", "linear_fc2": "fc2"}.get(parts[-2])
    if key.startswith("visual.merger.") and layer:
        return {"norm": "v.post_ln", "fc1": "mm.0", "fc2": "mm.2"}[layer] + "." + kind
    if key.startswith("visual.deepstack_merger_list.") and layer:
        block = list(vision.deepstack_visual_indexes)[int(parts[2])]
        tensor = {"norm": gguf.MODEL_TENSOR.V_DS_NORM, "fc1": gguf.MODEL_TENSOR.V_DS_FC1,
                  "fc2": gguf.MODEL_TENSOR.V_DS_FC2}[layer]
        return gguf.TENSOR_NAMES[tensor].format(bid=block) + "." + kind
    return None


def _pieces(key: str, data: np.ndarray, split_qkv: bool) -> list[tuple[str, np.ndarray, str]]:
    """(HF name to look up, array, suffix after the GGUF name) for each tensor one HF tensor becomes."""
    if ".attn.qkv." in key and split_qkv:  # Qwen2/2.5-VL: q, k and v apart (rows: q, k, v); Qwen3-VL keeps attn_qkv
        third = data.shape[0] // 3
        return [(key.replace(".qkv.", f".{p}."), data[i * third:(i + 1) * third], "") for i, p in enumerate("qkv")]
    if key.endswith("patch_embed.proj.weight"):  # (out, in, t=2, h, w) -> one Conv2d kernel per frame, the second
        return [(key, data[:, :, 0], ""), (key, data[:, :, 1], ".1")]  # named v.patch_embd.weight.1 by mtmd
    return [(key, data, "")]


def mmproj_type(quant: str) -> str:
    """llama.cpp's mmproj files are f16 (f32 kept where asked): the vision tower is not block-quantised here."""
    return quant if quant in ("f32", "bf16") else "f16"


def write_mmproj(tensors: dict[str, np.ndarray], cfg, preprocessor: dict, path: Path, quant: str, name: str) -> None:
    import gguf

    family = vision_table.FAMILIES[cfg.model_type].gguf
    vision = cfg.vision_config
    writer = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.MMPROJ])
    writer.add_type(gguf.GGUFType.MMPROJ)
    writer.add_name(name)
    writer.add_file_type(quants.file_type(quant))
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    writer.add_clip_has_vision_encoder(True)
    writer.add_clip_projector_type(getattr(gguf.VisionProjectorType, family.projector))
    writer.add_vision_projection_dim(int(cfg.text_config.hidden_size))
    writer.add_vision_image_size(_image_size(vision))
    writer.add_vision_patch_size(int(vision.patch_size))
    for key, value in _widths(vision).items():
        getattr(writer, key)(value)
    writer.add_vision_image_mean([float(x) for x in preprocessor["image_mean"]])
    writer.add_vision_image_std([float(x) for x in preprocessor["image_std"]])
    limits = image_tokens(cfg, preprocessor)
    if limits:  # llama.cpp's keys for the processor's limits: the file says what the model was trained to see,
        writer.add_vision_min_pixels(limits.pixels[0])  # though 0.3.36's mtmd reads them for other projectors
        writer.add_vision_max_pixels(limits.pixels[1])  # only (the command line carries them: ImageTokens)
    if family.silu:
        writer.add_vision_use_silu(True)
    if family.windows:
        writer.add_vision_n_wa_pattern(wa_pattern(vision))
    if family.siglip:
        _siglip_keys(writer, cfg, preprocessor, family)
    elif family.deepstack:
        _qwen3_keys(writer, cfg)
    else:
        writer.add_vision_attention_layernorm_eps(VISION_EPS)
    for tname, data in tensors.items():
        encoded, raw = quants.encode(data, _tensor_type(tname, family, quant))
        # encode gives ggml_type(quant), a GGMLQuantizationType, or None (its annotation says object)
        assert raw is None or isinstance(raw, gguf.GGMLQuantizationType)
        writer.add_tensor(tname, encoded, raw_dtype=raw)
    archs.write_out(writer)


def _tensor_type(name: str, family: VisionFamily, quant: str) -> str:
    """As llama.cpp's converter writes them: the learned position embeddings (Qwen3-VL, SigLIP) and SigLIP's patch
    embedding (its ``embeddings.*``) in f32; Gemma 3's input projection f16 rather than bf16 (the converter's rule,
    after a llama.cpp issue with it in other types; f32 is kept where asked, which mtmd runs: tested)."""
    if name.startswith("v.position_embd.") or (family.siglip and name.startswith("v.patch_embd.")):
        return "f32"
    return "f16" if name.startswith("mm.input_projection.") and quant == "bf16" else quant


def _siglip_keys(writer, cfg, preprocessor: dict, family: VisionFamily) -> None:
    """A SigLIP tower's: GELU, its norms' epsilon, and the projector's pooling (Gemma 3: the kernel, written when not
    llama.cpp's default 4) or pixel shuffle (Idefics3: scale_factor, and the longest side images are resized to
    before tiling)."""
    writer.add_vision_use_gelu(True)
    writer.add_vision_attention_layernorm_eps(float(getattr(cfg.vision_config, "layer_norm_eps", VISION_EPS)))
    if family.pooling:
        if gemma3_pooling(cfg) != GEMMA3_POOL:
            writer.add_vision_projector_scale_factor(gemma3_pooling(cfg))
        return
    writer.add_vision_projector_scale_factor(int(cfg.scale_factor))
    writer.add_vision_preproc_image_size(int(preprocessor.get("longest_edge") or cfg.vision_config.image_size))


def _image_size(vision) -> int:
    """Qwen3-VL: the side its learned position embeddings cover (sqrt(count) patches); the others: 560, the default
    llama.cpp's converter writes (mtmd resizes by its own pixel limits, not by this)."""
    count = getattr(vision, "num_position_embeddings", None)
    return int(round(count ** 0.5) * vision.patch_size) if count else int(getattr(vision, "image_size", None) or 560)


def _qwen3_keys(writer, cfg) -> None:
    """Qwen3-VL's (and Qwen3.5's, the same tower): GELU MLP, the 2 x 2 merge, the norm epsilon llama.cpp's converter
    takes from the language model, and which blocks feed a deepstack merger (none of Qwen3.5's: every flag false, as
    the converter writes them)."""
    vision = cfg.vision_config
    writer.add_vision_use_gelu(True)
    writer.add_vision_spatial_merge_size(int(vision.spatial_merge_size))
    writer.add_vision_attention_layernorm_eps(float(getattr(cfg.text_config, "rms_norm_eps", VISION_EPS)))
    deep = set(getattr(vision, "deepstack_visual_indexes", None) or [])  # Qwen3.5's config has no such key
    writer.add_vision_is_deepstack_layers([i in deep for i in range(int(vision.depth))])


def _widths(vision) -> dict:
    """Width, MLP width, depth and heads as llama.cpp's converter names them. Qwen2-VL calls the tower's width
    ``embed_dim`` and its output ``hidden_size``; the converter then writes that output width as the MLP's (mtmd reads
    the MLP's true width from its tensors), and so does this, to write the same file."""
    qwen2 = getattr(vision, "embed_dim", None) is not None
    width = vision.embed_dim if qwen2 else vision.hidden_size
    ff = vision.hidden_size if qwen2 else vision.intermediate_size
    depth = getattr(vision, "depth", None) or vision.num_hidden_layers  # SigLIP's names
    heads = getattr(vision, "num_heads", None) or vision.num_attention_heads
    return {"add_vision_embedding_length": int(width), "add_vision_feed_forward_length": int(ff),
            "add_vision_block_count": int(depth), "add_vision_head_count": int(heads)}
