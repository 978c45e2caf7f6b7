"""The real consumer of a task=vlm GGUF export: llama.cpp's multimodal library (mtmd, through llama-cpp-python) loads
the language model and its mmproj, reads an image with its own preprocessing and vision graph, and computes, along
transformers' greedy continuation, the logits of the merged transformers model (within TOL, and the same greedy token
wherever the two best are not within 2 x TOL; EPS_READ_AS says the one difference that is llama.cpp's own). Two
different images must give logits far apart, so the match is not the text alone.

llama.cpp is run as the export's printed ``then:`` command says (its -m, --lora, --mmproj and image-token flags,
parsed and given to the bindings): that command must make transformers' image-token count at every image size the
processor trained with, and answer as the trained model, not as the base."""

from __future__ import annotations

import ctypes
import re
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

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


@dataclass(frozen=True)
class Command:
    """What a printed llama-mtmd-cli command asks of llama.cpp: files and image-token limits (-1: mtmd's own)."""
    model: Path
    mmproj: Path
    lora: Path | None = None
    min_tokens: int = -1
    max_tokens: int = -1


def printed_command(stdout: str) -> Command:
    """The export's ``then:`` line, split as a shell splits it; every flag that changes what llama.cpp computes is
    taken, and any other must be one that only names the input (--image, -p)."""
    lines = [line for line in stdout.splitlines() if line.startswith("note: then: llama-mtmd-cli ")]
    assert len(lines) == 1, stdout
    argv = shlex.split(lines[0].removeprefix("note: then: ").split(" (or llama-server")[0])[1:]
    flags = dict(zip(argv[::2], argv[1::2]))
    assert len(argv) % 2 == 0 and set(flags) <= {"-m", "--mmproj", "--lora", "--image-min-tokens",
                                                  "--image-max-tokens", "--image", "-p"}, argv
    lora = flags.get("--lora")
    return Command(Path(flags["-m"]), Path(flags["--mmproj"]), Path(lora) if lora else None,
                   int(flags.get("--image-min-tokens", -1)), int(flags.get("--image-max-tokens", -1)))


def mtmd_logits(run: Command, text: str, image: Path, tokens: list[int]) -> tuple[np.ndarray, int]:
    """``text`` (with mtmd's media marker where the image goes), evaluated by llama.cpp as ``run`` says with the
    image, then ``tokens`` one by one; returns the logits before each token (len(tokens), vocab) and the number of
    image tokens mtmd made."""
    import llama_cpp.mtmd_cpp as mtmd

    # f32 KV cache and no flash attention (f16 inside, on the CPU): an f32 export is then computed in f32 throughout
    llm = llama_cpp.Llama(model_path=str(run.model), n_ctx=512, n_batch=512, verbose=False, flash_attn=False,
                          type_k=F32, type_v=F32, lora_path=str(run.lora) if run.lora else None)
    params = mtmd.mtmd_context_params_default()
    params.use_gpu, params.n_threads, params.print_timings = False, 1, False
    params.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED
    # what llama-mtmd-cli's --image-min-tokens / --image-max-tokens set (-1: the limits mtmd reads or assumes)
    params.image_min_tokens, params.image_max_tokens = run.min_tokens, run.max_tokens
    ctx = mtmd.mtmd_init_from_file(str(run.mmproj).encode(), llm.model, params)
    assert ctx, f"llama.cpp could not load {run.mmproj}"
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


def hf_greedy(model, run: Path, image: Path, n: int) -> tuple[np.ndarray, str, int]:
    """The merged model's greedy continuation of the same chat turn, encoded as rocktune generate --image does
    (the run's pixel limits), the prompt with mtmd's marker for the image, and the image tokens the processor made."""
    from rocktune.tasks.vlm.data.images import resolve as image_ref
    from rocktune.tasks.vlm.data.vision import encode_prompt
    from rocktune.tasks.vlm.data.vision_batch import collate
    from rocktune.export.source import resolve
    from rocktune.tasks.vlm.export.vision_generate import load
    from rocktune.tasks.vlm.vision.model import model_inputs

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
    image_id = getattr(model.config, "image_token_id", None) or model.config.image_token_index
    text = re.sub(IMAGE_SPANS.get(model.config.model_type, QWEN_SPAN), "<IMAGE>", tok.decode(example.input_ids),
                  flags=re.S)
    return logits, text, list(example.input_ids).count(image_id)


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
         # Qwen3.5: Qwen3-VL's tower without deepstack before four layers, Gated DeltaNet and full attention in turn
         # (with two, two noise images' logits differ by 0.38 only: too little to tell the image from the text)
         "qwen3_5": ({"layers": 4}, (128, 128)), "qwen3_5_moe": ({"layers": 4}, (128, 128)),
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
def test_llama_cpp_sees_the_image_as_transformers_does(tmp_path, case, capsys):
    from rocktune.tasks.vlm.demo.tiny_vlm import build_tiny_vlm

    shape, size = CASES[case]
    family = case.split("-")[0]
    base = build_tiny_vlm(tmp_path / "base", family=family, **shape)
    if family in TILES:
        _with_double_newline(base)
    merged = make_vlm_run(tmp_path / "run", base, **({"targets": SIGLIP_TARGETS} if family in CASES_SIGLIP else {}))
    capsys.readouterr()
    assert main(["export", str(tmp_path / "run"), "--to", "gguf", "--quant", "f32"]) == 0
    command = printed_command(capsys.readouterr().out)
    out = tmp_path / "run" / "export"
    assert (command.model, command.mmproj, command.lora) == (out / "model-f32.gguf", out / "mmproj-f32.gguf", None)
    seen = []
    for image in _images(tmp_path, size):
        match = _compare(merged, tmp_path / "run", command, image, case)
        assert match.image_tokens == _image_tokens(merged.config, size)  # the processor keeps these sizes as they are
        seen.append(match.first)
    with_text_norm_eps(merged, None)
    print(f"{case}: max |image 0 - image 1| = {np.abs(seen[0] - seen[1]).max():.3f}")
    # the image decides the logits, far beyond the tolerance (tiny Gemma 3, two noise images: 0.85)
    assert np.abs(seen[0] - seen[1]).max() > 50 * TOL


# The processor's limits at 4 to 64 tokens an image (Qwen2/2.5-VL: 28 x 28 pixels a token, Qwen3-VL 32 x 32). mtmd's
# own limits (8 to 4096 in llama-cpp-python 0.3.36) enlarge a 56 x 56 image to 9 tokens and keep a large one at its
# size; the printed flags must give the processor's: (width, height) -> the tokens transformers makes, asserted
# before llama.cpp is compared with it. One token's square enlarged to the minimum, the user's 56 x 56, a 64-token
# image kept, and one shrunk to the maximum with its aspect ratio.
SIZES = {"qwen2_5_vl": {(28, 28): 4, (56, 56): 4, (224, 224): 64, (448, 448): 64},
         "qwen2_vl": {(28, 28): 4, (56, 56): 4, (224, 224): 64, (448, 448): 64},
         "qwen3_vl": {(32, 32): 4, (56, 56): 4, (256, 256): 64, (512, 512): 64},
         "qwen3_5": {(32, 32): 4, (56, 56): 4, (256, 256): 64, (512, 512): 64}}
# Shrunk to 9 x 6 tokens, an aspect ratio the image does not have: transformers stretches it, mtmd (PAD_CEIL for
# Qwen's projectors) scales it to fit and pads the rest black, so only the count can agree (docs/export.md)
STRETCHED = ((448, 336), 54)


@pytest.mark.parametrize("family", list(SIZES))
def test_the_printed_command_makes_the_processor_s_image_tokens_at_every_size(tmp_path, family, capsys):
    """The user's report: llama.cpp made 9 image tokens of a 56 x 56 image where the processor makes 4, and the
    exported model then agreed with transformers on half the held-out images. The export's printed command carries
    the run's limits (mtmd reads none from the mmproj for Qwen), and with them llama.cpp makes transformers' count
    and logits at small, large and shrunk images."""
    from rocktune.tasks.vlm.demo.tiny_vlm import build_tiny_vlm

    base = build_tiny_vlm(tmp_path / "base", family=family, max_image_tokens=64, **CASES[family][0])
    merged = make_vlm_run(tmp_path / "run", base)
    capsys.readouterr()
    assert main(["export", str(tmp_path / "run"), "--to", "gguf", "--quant", "f32"]) == 0
    command = printed_command(capsys.readouterr().out)
    assert (command.min_tokens, command.max_tokens) == (4, 64)
    firsts = []
    for (width, height), count in SIZES[family].items():
        image = _images(tmp_path, (width, height))[0]
        match = _compare(merged, tmp_path / "run", command, image, f"{family} {width}x{height}")
        assert match.image_tokens == count
        firsts.append(match.first)
    with_text_norm_eps(merged, None)
    assert np.abs(firsts[0] - firsts[-1]).max() > 50 * TOL  # the image decides the logits
    size, count = STRETCHED
    image = _images(tmp_path, size)[0]
    _, text, made = hf_greedy(merged, tmp_path / "run", image, 1)
    assert made == count and mtmd_logits(command, text, image, [0])[1] == count


class Match(NamedTuple):
    """A comparison's outcome: transformers' first logits, llama.cpp's along transformers' greedy ``tokens`` (at the
    norm epsilon it matched), the prompt given to llama.cpp and the image tokens both made."""
    first: np.ndarray
    got: np.ndarray
    tokens: list[int]
    text: str
    image_tokens: int


def _compare(merged, run: Path, command: Command, image: Path, case: str, tol: float = TOL) -> Match:
    """llama.cpp's logits (as ``command`` runs it) against the merged model's along its greedy path."""
    diffs, match = {}, None
    for eps in EPS_READ_AS:
        with_text_norm_eps(merged, eps)
        want, text, count = hf_greedy(merged, run, image, N)
        tokens = [int(t) for t in want.argmax(1)]  # transformers' greedy path, fed to llama.cpp step by step
        got, n_image = mtmd_logits(command, text, image, tokens)
        assert n_image == count, (case, image.name, "llama.cpp's image tokens", n_image, "transformers'", count)
        diffs[eps] = float(np.abs(got - want).max())
        if diffs[eps] < tol:
            clear = [i for i, w in enumerate(want) if np.diff(np.sort(w)[-2:])[0] > 2 * tol]  # no near-tie
            assert len(clear) >= N // 2 and [int(np.argmax(got[i])) for i in clear] == [tokens[i] for i in clear]
            match = Match(want[0], got, tokens, text, count)
    print(f"{case} {image.name}: {count} image tokens, max |llama.cpp - transformers| by text norm epsilon {diffs}")
    assert min(diffs.values()) < tol and match is not None, (case, image.name)
    return match


def _image_tokens(config, size: tuple[int, int]) -> int:
    """The image tokens transformers makes of an image of ``size`` the processor does not resize: Qwen's one per 28
    (Qwen3-VL: 32) pixels square; Gemma 3's fixed count; Idefics3's per 32-pixel tile and the global view."""
    if config.model_type == "gemma3":
        return config.mm_tokens_per_image
    if config.model_type in TILES:
        return (size[0] // 32 * size[1] // 32 + 1) * 4
    side = 32 if config.model_type in ("qwen3_vl", "qwen3_5", "qwen3_5_moe") else 28
    return size[0] * size[1] // side**2


@pytest.mark.parametrize("family", ["qwen2_5_vl", "gemma3", "smolvlm"])
def test_llama_cpp_base_with_the_gguf_lora_and_the_base_mmproj_sees_as_the_merged_model(tmp_path, family):
    """--to gguf-lora on a language-model LoRA: llama.cpp's base + --lora + the base's mmproj computes the merged
    model's logits on an image prompt."""
    from rocktune.tasks.vlm.demo.tiny_vlm import build_tiny_vlm
    from tests.export_fixtures import SIGLIP_LM_TARGETS, VLM_LM_TARGETS

    base = build_tiny_vlm(tmp_path / "base", family=family)
    if family in TILES:
        _with_double_newline(base)
    merged = make_vlm_run(tmp_path / "run", base, SIGLIP_LM_TARGETS if family in CASES_SIGLIP else VLM_LM_TARGETS)
    assert main(["export", str(tmp_path / "run"), "--to", "gguf-lora"]) == 0
    assert main(["export", str(base), "--to", "gguf", "--quant", "f32", "--out", str(tmp_path / "base.gguf")]) == 0
    tokens = (4, 16) if family == "qwen2_5_vl" else (-1, -1)  # the processor's limits (the next test: as printed)
    command = Command(tmp_path / "base.gguf", tmp_path / "mmproj-base.gguf",
                      tmp_path / "run" / "export" / "adapter-f32.gguf", *tokens)
    for image in _images(tmp_path, CASES[family][1]):
        _compare(merged, tmp_path / "run", command, image, f"{family} base + LoRA")
    with_text_norm_eps(merged, None)


# the base written by --with-base is f16: its logits are within this of the fp32 merged model's (measured: see
# docs/export.md), and the greedy tokens must be the merged model's wherever the two best are apart by twice this
F16_TOL = 0.05


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen2_vl", "qwen3_vl", "qwen3_5"])
def test_the_printed_gguf_lora_command_answers_as_the_trained_model(tmp_path, family, capsys):
    """The user's report: `export --to gguf-lora --with-base` printed llama-mtmd-cli -m base-f16.gguf --mmproj ...
    without --lora, which runs the untrained base. The printed command, parsed and run in llama.cpp, must give the
    merged model's answer (its greedy tokens, its logits), and the same command without its --lora the base's,
    which differs."""
    from rocktune.tasks.vlm.demo.tiny_vlm import build_tiny_vlm
    from tests.export_fixtures import VLM_LM_TARGETS

    base = build_tiny_vlm(tmp_path / "base", family=family, **CASES[family][0])
    merged = make_vlm_run(tmp_path / "run", base, VLM_LM_TARGETS)
    capsys.readouterr()
    assert main(["export", str(tmp_path / "run"), "--to", "gguf-lora", "--with-base"]) == 0
    command = printed_command(capsys.readouterr().out)
    out = tmp_path / "run" / "export"
    assert (command.model, command.lora, command.mmproj) == \
        (out / "base-f16.gguf", out / "adapter-f32.gguf", out / "mmproj-base-f16.gguf")
    image = _images(tmp_path, CASES[family][1])[0]
    tuned = _compare(merged, tmp_path / "run", command, image, f"{family} printed", F16_TOL)
    without = Command(command.model, command.mmproj, None, command.min_tokens, command.max_tokens)
    untrained, _ = mtmd_logits(without, tuned.text, image, tuned.tokens)
    with_text_norm_eps(merged, None)
    print(f"{family}: max |printed - without --lora| = {np.abs(tuned.got - untrained).max():.3f}")
    assert [int(t) for t in untrained.argmax(1)] != tuned.tokens  # the base answers otherwise
    assert np.abs(tuned.got - untrained).max() > 50 * TOL
