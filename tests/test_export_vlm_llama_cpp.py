"""The real consumer of a task=vlm GGUF export: llama.cpp's multimodal library (mtmd, through llama-cpp-python) loads
the language model and its mmproj, reads an image with its own preprocessing and vision graph, and computes, along
transformers' greedy continuation, the logits of the merged transformers model (within TOL, and the same greedy token
wherever the two best are not within 2 x TOL; EPS_READ_AS says the one difference that is llama.cpp's own). Two
different images must give logits far apart, so the match is not the text alone."""

from __future__ import annotations

import ctypes
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from rocktune.cli import main
from tests.export_fixtures import SIGLIP_TARGETS, make_vlm_run

llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (make llama-cpp builds it)")
pytest.importorskip("llama_cpp.mtmd_cpp", reason="this llama-cpp-python has no mtmd bindings (0.3.36 has them)")
pytestmark = pytest.mark.llama_cpp
PROMPT = "What colour is it?"
N = 8
TOL = 0.01  # measured: at most 0.0047, from the image (a text prompt alone agrees to 2e-6)
# llama-cpp-python 0.3.36's llama.cpp loads the qwen2vl language model's RMSNorm epsilon as 0 (its print_info says
# f_norm_rms_eps = 0.0e+00) although the file carries the config's value (1e-5 here), and then differs from
# transformers by up to 0.05 on these prompts; with transformers' language-model norms at epsilon 0, a text prompt
# agrees to 2e-6. The reference is therefore computed both ways, and llama.cpp must match one of them (a fixed
# llama.cpp: the file's). docs/export.md has the numbers.
EPS_READ_AS = (None, 0.0)
F32 = 0  # ggml's type id
# what mtmd writes itself around an image's embeddings, replaced by its marker in transformers' prompt: Qwen's
# begin/end, Gemma 3's (its "\n\n" around them are text), Idefics3's tiles and global view from the first
# <fake_token_around_image> (after the "\n\n" before the global view) to the last
QWEN_SPAN = r"<\|vision_start\|>(<\|image_pad\|>)*<\|vision_end\|>"
TILES_SPAN = r"<fake_token_around_image>.*<fake_token_around_image>"
IMAGE_SPANS = {"gemma3": r"<start_of_image>(<image_soft_token>)*<end_of_image>", "smolvlm": TILES_SPAN,
               "idefics3": TILES_SPAN}


def mtmd_logits(model_path: Path, mmproj: Path, text: str, image: Path, tokens: list[int],
                lora: Path | None = None) -> tuple[np.ndarray, int]:
    """``text`` (with mtmd's media marker where the image goes), evaluated by llama.cpp with the image, then
    ``tokens`` one by one; returns the logits before each token (len(tokens), vocab) and the number of image tokens
    mtmd made."""
    import llama_cpp.mtmd_cpp as mtmd

    # f32 KV cache and no flash attention (f16 inside, on the CPU): an f32 export is then computed in f32 throughout
    llm = llama_cpp.Llama(model_path=str(model_path), n_ctx=512, n_batch=512, verbose=False, flash_attn=False,
                          type_k=F32, type_v=F32, lora_path=str(lora) if lora else None)
    params = mtmd.mtmd_context_params_default()
    params.use_gpu, params.n_threads, params.print_timings = False, 1, False
    params.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED
    ctx = mtmd.mtmd_init_from_file(str(mmproj).encode(), llm.model, params)
    assert ctx, f"llama.cpp could not load {mmproj}"
    bitmap = mtmd.mtmd_helper_bitmap_init_from_file(ctx, str(image).encode(), False)
    chunks = mtmd.mtmd_input_chunks_init()
    try:
        raw = text.replace("<IMAGE>", mtmd.mtmd_default_marker().decode()).encode()
        inp = mtmd.mtmd_input_text()
        inp.text, inp.text_len, inp.add_special, inp.parse_special = raw, len(raw), False, True
        assert mtmd.mtmd_tokenize(ctx, chunks, ctypes.byref(inp), (mtmd.mtmd_bitmap_p_ctypes * 1)(bitmap), 1) == 0
        n_image = sum(mtmd.mtmd_input_chunk_get_n_tokens(mtmd.mtmd_input_chunks_get(chunks, i))
                      for i in range(mtmd.mtmd_input_chunks_size(chunks))
                      if mtmd.mtmd_input_chunk_get_type(mtmd.mtmd_input_chunks_get(chunks, i))
                      == mtmd.MTMD_INPUT_CHUNK_TYPE_IMAGE)
        n_past = llama_cpp.llama_pos(0)
        assert mtmd.mtmd_helper_eval_chunks(ctx, llm._ctx.ctx, chunks, 0, 0, 512, True, ctypes.byref(n_past)) == 0
        return _continue(llm, n_past.value, tokens), n_image
    finally:
        mtmd.mtmd_input_chunks_free(chunks)
        mtmd.mtmd_bitmap_free(bitmap)
        mtmd.mtmd_free(ctx)


def _continue(llm, pos: int, tokens: list[int]) -> np.ndarray:
    """The logits before each of ``tokens``, fed one by one. Explicit positions: after an image, Qwen's 3-D positions
    (mtmd's n_past) are not the count of tokens."""
    rows = []
    for token in tokens:
        logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm._ctx.ctx, -1), shape=(llm.n_vocab(),))
        rows.append(logits.copy())
        batch = llama_cpp.llama_batch_init(1, 0, 1)
        batch.n_tokens, batch.token[0], batch.pos[0], batch.n_seq_id[0] = 1, token, pos, 1
        batch.seq_id[0][0], batch.logits[0] = 0, True
        try:
            assert llama_cpp.llama_decode(llm._ctx.ctx, batch) == 0
        finally:
            llama_cpp.llama_batch_free(batch)
        pos += 1
    return np.stack(rows)


def with_text_norm_eps(model, eps: float | None) -> None:
    """Set the language model's RMSNorm epsilon (None: the config's)."""
    for name, module in model.named_modules():
        if ("language_model" in name or "text_model" in name) and hasattr(module, "variance_epsilon"):
            module.variance_epsilon = model.config.text_config.rms_norm_eps if eps is None else eps


def hf_greedy(model, run: Path, image: Path, n: int) -> tuple[np.ndarray, str]:
    """The merged model's greedy continuation of the same chat turn, encoded as rocktune generate --image does."""
    from rocktune.data.images import resolve as image_ref
    from rocktune.data.vision import encode_prompt
    from rocktune.data.vision_batch import collate
    from rocktune.export.source import resolve
    from rocktune.export.vision_generate import load
    from rocktune.vision_model import model_inputs

    _, tok, vision = load(resolve(str(run)), "cpu")
    parts = [{"type": "image"}, {"type": "text", "text": PROMPT}]
    example = encode_prompt([{"role": "user", "content": parts}], [image_ref(str(image), image.parent, "image")],
                            tok, vision, "prompt")
    inputs = model_inputs(model, collate([example], tok.pad_token_id, vision))
    model.generation_config.eos_token_id = None  # n tokens, whatever they are
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0,
                             output_logits=True, return_dict_in_generate=True)
    logits = torch.stack(out.logits)[:, 0].numpy()
    return logits, re.sub(IMAGE_SPANS.get(model.config.model_type, QWEN_SPAN), "<IMAGE>", tok.decode(example.input_ids),
                          flags=re.S)


def _images(folder: Path, size: tuple[int, int]) -> list[Path]:
    paths = []
    for seed in (0, 1):
        pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
        paths.append(folder / f"noise-{seed}.png")
        Image.fromarray(pixels).save(paths[-1])
    return paths


# Qwen2.5-VL twice: all blocks full (mtmd's n_wa_pattern 0) and one 112-pixel-window block before a full one, on an
# image two windows wide (llama.cpp's windows must be transformers')
# (the tiny model's shape, the image's (width, height)); Qwen3-VL: two deepstack mergers into three layers, rotary
# sections that interleave as llama.cpp's do (export/arch.py), one token per 32 x 32 pixels
CASES = {"qwen2_5_vl": ({}, (112, 112)),
         "qwen2_5_vl-windows": ({"vision_depth": 2, "vision": {"fullatt_block_indexes": [1], "window_size": 112},
                                 "max_image_tokens": 32}, (224, 112)),
         "qwen2_vl": ({}, (112, 112)),
         "qwen3_vl": ({"layers": 3, "vision_depth": 3, "vision": {"deepstack_visual_indexes": [0, 2]},
                       "rope": {"mrope_section": [3, 3, 2]}}, (128, 128)),
         # Gemma 3: 4 x 4 patches pooled into 4 soft tokens; SmolVLM / Idefics3: 2 x 2 tiles of 32 pixels and the
         # global view, 4 tokens each
         "gemma3": ({}, (32, 32)), "smolvlm": ({}, (64, 64)), "idefics3": ({}, (64, 64))}
TILES = ("smolvlm", "idefics3")
CASES_SIGLIP = ("gemma3", *TILES)


def _with_double_newline(base: Path) -> None:
    """mtmd's Idefics3 layout looks up "\n\n" (before the global view) as one token of the vocabulary, as SmolVLM's
    tokenizer has it; the tiny byte-level tokenizer gets it added (without it mtmd aborts on a null token)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(base)
    tok.add_tokens(["\n\n"])
    tok.save_pretrained(base)


@pytest.mark.parametrize("case", list(CASES))
def test_llama_cpp_sees_the_image_as_transformers_does(tmp_path, case):
    from rocktune.demo.tiny_vlm import build_tiny_vlm

    shape, size = CASES[case]
    family = case.split("-")[0]
    base = build_tiny_vlm(tmp_path / "base", family=family, **shape)
    if family in TILES:
        _with_double_newline(base)
    merged = make_vlm_run(tmp_path / "run", base, **({"targets": SIGLIP_TARGETS} if family in CASES_SIGLIP else {}))
    assert main(["export", str(tmp_path / "run"), "--to", "gguf", "--quant", "f32"]) == 0
    out = tmp_path / "run" / "export"
    seen = [_compare(merged, tmp_path / "run", (out / "model-f32.gguf", out / "mmproj-f32.gguf", None), image, case)
            for image in _images(tmp_path, size)]
    with_text_norm_eps(merged, None)
    print(f"{case}: max |image 0 - image 1| = {np.abs(seen[0] - seen[1]).max():.3f}")
    # the image decides the logits, far beyond the tolerance (tiny Gemma 3, two noise images: 0.85)
    assert np.abs(seen[0] - seen[1]).max() > 50 * TOL


def _compare(merged, run: Path, files: tuple, image: Path, case: str) -> np.ndarray:
    """llama.cpp's logits (model, mmproj, LoRA or None) against the merged model's along its greedy path; returns
    transformers' first logits."""
    diffs, first = {}, None
    for eps in EPS_READ_AS:
        with_text_norm_eps(merged, eps)
        want, text = hf_greedy(merged, run, image, N)
        tokens = [int(t) for t in want.argmax(1)]  # transformers' greedy path, fed to llama.cpp step by step
        got, n_image = mtmd_logits(files[0], files[1], text, image, tokens, files[2])
        assert n_image == _image_tokens(merged.config, Image.open(image).size)
        diffs[eps] = float(np.abs(got - want).max())
        if diffs[eps] < TOL:
            clear = [i for i, w in enumerate(want) if np.diff(np.sort(w)[-2:])[0] > 2 * TOL]  # no near-tie
            assert len(clear) >= N // 2 and [int(np.argmax(got[i])) for i in clear] == [tokens[i] for i in clear]
            first = want[0]
    print(f"{case} {image.name}: max |llama.cpp - transformers| by text norm epsilon {diffs}")
    assert min(diffs.values()) < TOL, (case, image.name)
    return first


def _image_tokens(config, size: tuple[int, int]) -> int:
    """The image tokens transformers makes of an image of ``size``: Qwen's one per 28 (Qwen3-VL: 32) pixels square;
    Gemma 3's fixed count; Idefics3's per 32-pixel tile and the global view."""
    if config.model_type == "gemma3":
        return config.mm_tokens_per_image
    if config.model_type in TILES:
        return (size[0] // 32 * size[1] // 32 + 1) * 4
    side = 32 if config.model_type == "qwen3_vl" else 28
    return size[0] * size[1] // side**2


@pytest.mark.parametrize("family", ["qwen2_5_vl", "gemma3", "smolvlm"])
def test_llama_cpp_base_with_the_gguf_lora_and_the_base_mmproj_sees_as_the_merged_model(tmp_path, family):
    """--to gguf-lora on a language-model LoRA: llama.cpp's base + --lora + the base's mmproj computes the merged
    model's logits on an image prompt."""
    from rocktune.demo.tiny_vlm import build_tiny_vlm
    from tests.export_fixtures import SIGLIP_LM_TARGETS, VLM_LM_TARGETS

    base = build_tiny_vlm(tmp_path / "base", family=family)
    if family in TILES:
        _with_double_newline(base)
    merged = make_vlm_run(tmp_path / "run", base, SIGLIP_LM_TARGETS if family in CASES_SIGLIP else VLM_LM_TARGETS)
    assert main(["export", str(tmp_path / "run"), "--to", "gguf-lora"]) == 0
    assert main(["export", str(base), "--to", "gguf", "--quant", "f32", "--out", str(tmp_path / "base.gguf")]) == 0
    files = (tmp_path / "base.gguf", tmp_path / "mmproj-base.gguf", tmp_path / "run" / "export" / "adapter-f32.gguf")
    for image in _images(tmp_path, CASES[family][1]):
        _compare(merged, tmp_path / "run", files, image, f"{family} base + LoRA")
    with_text_norm_eps(merged, None)
