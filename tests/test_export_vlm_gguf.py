"""export --to gguf of a task=vlm run: the language model (llama.cpp's qwen2vl, qwen3vl, gemma3 or llama) and the
vision projector (llama.cpp's mmproj: clip arch, v.*/mm.* tensors) are read back with gguf-py's own reader and
compared with the merged weights in llama.cpp's layout, tensor by tensor, and with the metadata keys llama.cpp's
loaders read. Tiny random-init Qwen2.5-VL, Qwen2-VL, Qwen3-VL, Qwen3.5, Gemma 3, SmolVLM and Idefics3 built offline,
with random non-zero LoRA weights on the language model and on vision modules (opt-in LoRA on the tower and
projector), so the mmproj must carry merged weights too. Qwen3.5's two files are also compared with llama.cpp's own
converter's."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from rocktune.cli import main
from tests.export_fixtures import SIGLIP_TARGETS, make_vlm_run

gguf = pytest.importorskip("gguf")

# Qwen3-VL: two deepstack mergers (after blocks 0 and 2) into a 3-layer language model, and rotary sections that
# interleave as llama.cpp's do (the tiny default [2, 3, 3] is refused: test_what_llama_cpp_would_compute_...)
SIGLIP = ("gemma3", "smolvlm", "idefics3")
SHAPES = {"qwen3_vl": {"layers": 3, "vision_depth": 3, "vision": {"deepstack_visual_indexes": [0, 2]},
                       "rope": {"mrope_section": [3, 3, 2]}}}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """family -> (run directory, merged model (fp32), its state dict)."""
    from rocktune.tasks.vlm.demo.tiny_vlm import build_tiny_vlm

    built = {}

    def get(family: str):
        if family not in built:
            root = tmp_path_factory.mktemp(family)
            base = build_tiny_vlm(root / "base", family=family, **SHAPES.get(family, {}))
            targets = {"targets": SIGLIP_TARGETS} if family in SIGLIP else {}
            built[family] = (root / "run", base, make_vlm_run(root / "run", base, **targets))
        return built[family]
    return get


def _fields(reader) -> dict:
    out = {}
    for name, field in reader.fields.items():
        out[name] = field.contents()
    return out


def _read(path: Path) -> tuple[dict, dict]:
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    tensors = {t.name: (t.tensor_type.name, np.array(t.data)) for t in reader.tensors}
    return _fields(reader), tensors


def _expected_mmproj(state: dict, deepstack: list[int] | None = None) -> dict[str, np.ndarray]:
    """The merged vision tower in llama.cpp's layout, spelt out here (not from the exporter's code); Qwen3-VL
    (``deepstack`` given) keeps each block's fused qkv."""
    want = {}
    for key, t in state.items():
        if ".visual." not in "." + key:
            continue
        a = t.float().numpy()
        k = key.removeprefix("model.")
        if k == "visual.patch_embed.proj.weight":
            want["v.patch_embd.weight"], want["v.patch_embd.weight.1"] = a[:, :, 0], a[:, :, 1]
            continue
        if k.startswith("visual.deepstack_merger_list."):
            _, _, j, layer, kind = k.split(".")
            part = {"norm": "norm", "linear_fc1": "fc1", "linear_fc2": "fc2"}[layer]
            want[f"v.deepstack.{deepstack[int(j)]}.{part}.{kind}"] = a
            continue
        if ".attn.qkv." in k and deepstack is None:
            i, kind = k.split(".")[2], k.rsplit(".", 1)[1]
            for j, p in enumerate("qkv"):
                want[f"v.blk.{i}.attn_{p}.{kind}"] = np.split(a, 3)[j]
            continue
        want[_VISION_NAMES(k)] = a
    return want


def _VISION_NAMES(k: str) -> str:  # noqa: N802 - a table written out for the test
    table = {"visual.merger.ln_q": "v.post_ln", "visual.merger.mlp.0": "mm.0", "visual.merger.mlp.2": "mm.2",
             "visual.merger.norm": "v.post_ln", "visual.merger.linear_fc1": "mm.0", "visual.merger.linear_fc2": "mm.2",
             "visual.pos_embed": "v.position_embd", "visual.patch_embed.proj": "v.patch_embd"}
    stem, kind = k.rsplit(".", 1)
    if stem in table:
        return f"{table[stem]}.{kind}"
    _, _, i, *rest = stem.split(".")
    part = {"attn.proj": "attn_out", "norm1": "ln1", "norm2": "ln2", "mlp.fc1": "ffn_up", "mlp.fc2": "ffn_down",
            "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down", "attn.qkv": "attn_qkv",
            "mlp.linear_fc1": "ffn_up", "mlp.linear_fc2": "ffn_down"}[".".join(rest)]
    return f"v.blk.{i}.{part}.{kind}"


def _expected_text(state: dict) -> dict[str, np.ndarray]:
    parts = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
             "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"}
    want = {}
    for key, t in state.items():
        a = t.float().numpy()
        if key == "model.language_model.embed_tokens.weight":
            want["token_embd.weight"] = a
        elif key == "model.language_model.norm.weight":
            want["output_norm.weight"] = a
        elif key.startswith("model.language_model.layers."):
            i, rest = key.split(".")[3], key.split(".", 4)[4]
            stem, kind = rest.rsplit(".", 1)
            want[f"blk.{i}.{parts[stem]}.{kind}"] = a
    return want


def _close(got: np.ndarray, want: np.ndarray, ggml_type: str) -> bool:
    # gguf-py stores ne in reverse; numpy shapes come back in the original row-major order
    if ggml_type == "F16":
        return got.shape == want.shape and np.array_equal(got, want.astype(np.float16))
    return got.shape == want.shape and np.array_equal(got.astype(np.float32), want)


@pytest.mark.parametrize("family,projector", [("qwen2_5_vl", "qwen2.5vl_merger"), ("qwen2_vl", "qwen2vl_merger")])
@pytest.mark.parametrize("quant", ["f32", "f16"])
def test_gguf_and_mmproj_hold_the_merged_weights(runs, family, projector, quant):
    run, base, merged = runs(family)
    out = run / "export" / f"model-{quant}.gguf"
    assert main(["export", str(run), "--to", "gguf", "--quant", quant]) == 0
    state = merged.state_dict()
    meta, tensors = _read(out)
    want = _expected_text(state)
    assert set(tensors) == set(want)  # tied head: no output.weight, as for the text families
    for name, (kind, data) in tensors.items():
        expected_kind = "F32" if data.ndim == 1 or quant == "f32" else "F16"
        assert kind == expected_kind and _close(data, want[name], kind), name
    assert meta["general.architecture"] == "qwen2vl" and meta["general.type"] == "model"
    assert meta["qwen2vl.rope.dimension_sections"] == [2, 3, 3, 0]
    assert meta["qwen2vl.block_count"] == 2 and meta["qwen2vl.embedding_length"] == 128
    assert meta["qwen2vl.attention.head_count_kv"] == 4 and meta["tokenizer.ggml.eos_token_id"] == 256
    assert "<|vision_start|><|image_pad|><|vision_end|>" in meta["tokenizer.chat_template"]
    assert meta["tokenizer.ggml.tokens"][261] == "<|image_pad|>"

    mmproj = out.with_name(f"mmproj-{quant}.gguf")
    meta, tensors = _read(mmproj)
    want = _expected_mmproj(state)
    assert set(tensors) == set(want)
    for name, (kind, data) in tensors.items():
        expected_kind = "F32" if data.ndim == 1 or quant == "f32" else "F16"
        assert kind == expected_kind and _close(data, want[name], kind), name
    vision = merged.config.vision_config
    assert meta["general.architecture"] == "clip" and meta["general.type"] == "mmproj"
    assert meta["clip.projector_type"] == projector and meta["clip.has_vision_encoder"] is True
    assert meta["clip.vision.projection_dim"] == 128 and meta["clip.vision.patch_size"] == 14
    assert meta["clip.vision.block_count"] == 1 and meta["clip.vision.attention.head_count"] == 2
    assert meta["clip.vision.embedding_length"] == (vision.embed_dim if family == "qwen2_vl" else vision.hidden_size)
    assert meta["clip.vision.image_size"] == 560 and meta["clip.vision.attention.layer_norm_epsilon"] == \
        pytest.approx(1e-6)
    assert meta["clip.vision.image_mean"] == pytest.approx([0.48145466, 0.4578275, 0.40821073])
    assert meta["clip.vision.image_std"] == pytest.approx([0.26862954, 0.26130258, 0.27577711])
    if family == "qwen2_5_vl":
        assert meta["clip.use_silu"] is True and meta["clip.vision.n_wa_pattern"] == 0


def test_qwen3_vl_gguf_and_mmproj_hold_the_merged_weights(runs):
    """Qwen3-VL: llama.cpp's qwen3vl language model (deepstack count, interleaved sections) and qwen3vl_merger mmproj
    (fused qkv, patch bias, learned position embeddings kept f32, deepstack mergers named by their block)."""
    run, _, merged = runs("qwen3_vl")
    assert main(["export", str(run), "--to", "gguf"]) == 0
    state = merged.state_dict()
    meta, tensors = _read(run / "export" / "model-f16.gguf")
    want = _expected_text(state)
    assert set(tensors) == set(want)
    assert all(_close(data, want[name], kind) for name, (kind, data) in tensors.items())
    assert meta["general.architecture"] == "qwen3vl" and meta["qwen3vl.n_deepstack_layers"] == 2
    assert meta["qwen3vl.rope.dimension_sections"] == [3, 3, 2, 0]
    meta, tensors = _read(run / "export" / "mmproj-f16.gguf")
    want = _expected_mmproj(state, deepstack=[0, 2])
    assert set(tensors) == set(want)
    for name, (kind, data) in tensors.items():
        expected_kind = "F32" if data.ndim == 1 or name.startswith("v.position_embd") else "F16"
        assert kind == expected_kind and _close(data, want[name], kind), name
    assert meta["clip.projector_type"] == "qwen3vl_merger" and meta["clip.use_gelu"] is True
    assert meta["clip.vision.image_size"] == 128 and meta["clip.vision.spatial_merge_size"] == 2  # sqrt(64) x 16
    assert meta["clip.vision.is_deepstack_layers"] == [True, False, True]
    eps = merged.config.text_config.rms_norm_eps  # the language model's, as llama.cpp's converter writes it
    assert meta["clip.vision.attention.layer_norm_epsilon"] == pytest.approx(eps)


def test_qwen3_5_gguf_and_mmproj_hold_the_merged_weights(runs):
    """Qwen3.5: llama.cpp's qwen35 language model (its recurrent layers, interleaved rope sections) and a qwen3vl_merger
    mmproj of Qwen3-VL's tower without deepstack (fused qkv, learned position embeddings kept f32, every deepstack
    flag false)."""
    run, _, merged = runs("qwen3_5")
    assert main(["export", str(run), "--to", "gguf"]) == 0
    state = merged.state_dict()
    meta, tensors = _read(run / "export" / "model-f16.gguf")
    assert meta["general.architecture"] == "qwen35" and meta["qwen35.attention.recurrent_layers"] == [True, False]
    assert meta["qwen35.rope.dimension_sections"] == [2, 1, 1, 0] and meta["qwen35.block_count"] == 2
    assert "<|vision_start|><|image_pad|><|vision_end|>" in meta["tokenizer.chat_template"]
    assert _close(tensors["blk.1.attn_k.weight"][1], state["model.language_model.layers.1.self_attn.k_proj.weight"]
                  .numpy(), "F16")
    meta, tensors = _read(run / "export" / "mmproj-f16.gguf")
    want = _expected_mmproj(state, deepstack=[])
    assert set(tensors) == set(want) and not any(k.startswith("v.deepstack") for k in tensors)
    for name, (kind, data) in tensors.items():
        expected_kind = "F32" if data.ndim == 1 or name.startswith("v.position_embd") else "F16"
        assert kind == expected_kind and _close(data, want[name], kind), name
    assert meta["clip.projector_type"] == "qwen3vl_merger" and meta["clip.use_gelu"] is True
    assert meta["clip.vision.image_size"] == 128 and meta["clip.vision.spatial_merge_size"] == 2
    assert meta["clip.vision.is_deepstack_layers"] == [False]
    assert meta["clip.vision.attention.layer_norm_epsilon"] == pytest.approx(merged.config.text_config.rms_norm_eps)


# keys only rocktune's mmproj writes: the image-token limits training used, as llama.cpp's pixel keys
MMPROJ_EXTRA = {"clip.vision.image_min_pixels", "clip.vision.image_max_pixels"}


@pytest.fixture(scope="module")
def moe_run(tmp_path_factory) -> Path:
    """A Qwen3.5-MoE run trained 3 steps by rocktune: its all-linear adapts the expert stacks too (PEFT's
    target_parameters, which make_vlm_run's target list does not reach), so the merge changes them."""
    from rocktune.config import config_from_dict
    from rocktune.tasks import train
    from rocktune.tasks.vlm.demo.tiny_vlm import build_tiny_vlm
    from rocktune.tasks.vlm.demo.vision_task import write_colour_task
    from tests.test_vlm_train import vlm_config

    root = tmp_path_factory.mktemp("qwen3_5_moe")
    base = build_tiny_vlm(root / "base", family="qwen3_5_moe")
    data = write_colour_task(root / "colours", n_train=16, n_eval=2, seed=0)
    train(config_from_dict(vlm_config(base, data, root / "run", max_steps=3)), quiet=True)
    return root / "run"


# family -> (its language model's model_type, llama.cpp's architecture, the text file's tensors)
CONVERTED = {"qwen3_5": ("qwen3_5_text", "qwen35", 27), "qwen3_5_moe": ("qwen3_5_moe_text", "qwen35moe", 37)}


@pytest.mark.llama_cpp
@pytest.mark.parametrize("quant", ["f32", "f16"])
@pytest.mark.parametrize("family", list(CONVERTED))
def test_qwen3_5_files_equal_llama_cpp_s_converter(runs, request, family, quant):
    """llama.cpp's convert_hf_to_gguf.py on the merged directory (its Qwen3_5TextModel / Qwen3_5MoeTextModel for the
    language model, its Qwen3VLVisionModel with --mmproj for the eyes): every tensor and key equal to ours; our mmproj
    adds the pixel limits only. Qwen3.5-MoE's run adapted its expert stacks, which the merge moved."""
    import subprocess
    import sys

    from safetensors.torch import load_file

    from tests import llama_cpp_converter
    from tests.test_gguf_converter import assert_same_gguf, read

    src = llama_cpp_converter.converter_source()
    if src is None:
        pytest.skip("no llama.cpp source tree (set ROCKTUNE_LLAMA_CPP_SRC; tests/llama_cpp_converter.py says how)")
    run = runs(family)[0] if family == "qwen3_5" else request.getfixturevalue("moe_run")
    merged, out = run / "export" / "merged", run / "export"
    if not merged.is_dir():
        assert main(["export", str(run), "--to", "merged", "--dtype", "fp32"]) == 0
    if family == "qwen3_5_moe":
        stack = "model.language_model.layers.0.mlp.experts.0.gate_proj.weight"  # saved one expert at a time
        before = load_file(run.parent / "base" / "model.safetensors")[stack]
        assert float((load_file(merged / "model.safetensors")[stack] - before).abs().max()) > 0
    assert main(["export", str(run), "--to", "gguf", "--quant", quant, "--overwrite"]) == 0
    text_type, arch, count = CONVERTED[family]
    ours = out / f"model-{quant}.gguf"
    theirs = run.parent / f"converter-{quant}.gguf"
    done = llama_cpp_converter.convert(src, merged, theirs, quant, read(ours)[0]["tokenizer.ggml.pre"], text_type)
    assert done.returncode == 0, done.stderr[-3000:]
    assert assert_same_gguf(ours, theirs, arch) == count  # the keys test_gguf_converter.py allows, no others
    theirs = run.parent / f"converter-mmproj-{quant}.gguf"
    argv = [sys.executable, llama_cpp_converter.__file__, str(src), "-", str(merged), "--outtype", quant, "--outfile",
            str(theirs), "--mmproj"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    kv, tensors = read(out / f"mmproj-{quant}.gguf")
    want_kv, want_tensors = read(theirs)
    assert set(kv) - set(want_kv) == MMPROJ_EXTRA and not set(want_kv) - set(kv)
    assert {k: kv[k] for k in want_kv} == want_kv
    assert set(tensors) == set(want_tensors) and len(tensors) == 22
    for name, t in want_tensors.items():
        got = tensors[name]
        assert (got.tensor_type, list(got.shape), got.data.tobytes()) == \
            (t.tensor_type, list(t.shape), t.data.tobytes()), name


def test_out_names_both_files_and_nothing_is_left_when_refused(runs, tmp_path):
    run, _, _ = runs("qwen2_5_vl")
    out = tmp_path / "eyes.gguf"
    assert main(["export", str(run), "--to", "gguf", "--quant", "q8_0", "--out", str(out)]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["eyes.gguf", "mmproj-eyes.gguf"]
    _, tensors = _read(tmp_path / "mmproj-eyes.gguf")
    assert {kind for kind, _ in tensors.values()} == {"F16", "F32"}  # the projector stays f16 beside a q8_0 model
    assert main(["export", str(run), "--to", "gguf", "--out", str(out)]) == 2  # both exist: refused, untouched


def test_what_llama_cpp_would_compute_differently_is_refused(runs, tmp_path):
    """Qwen3-VL shapes llama.cpp computes otherwise (rotary pairs it leaves unrotated, deepstack into the last layer),
    Qwen3.5's rotary pairs it places by another position, a family llama.cpp's mmproj does not know, and Qwen2.5-VL
    towers whose windows llama.cpp would draw otherwise:
    refused with the reason, before any weight is loaded."""
    from transformers import AutoConfig

    from rocktune.tasks.vlm.demo.tiny_vlm import build_tiny_vlm
    from rocktune.errors import UserError
    from rocktune.tasks.vlm.export import gguf_vision

    qwen3 = build_tiny_vlm(tmp_path / "qwen3", family="qwen3_vl")  # mrope_section [2, 3, 3] over 8 pairs
    with pytest.raises(UserError, match=r"sections \[2, 3, 3\] leave pairs \[6\] to a position llama.cpp"):
        gguf_vision.check(AutoConfig.from_pretrained(qwen3))
    cfg = AutoConfig.from_pretrained(qwen3)
    cfg.vision_config.deepstack_visual_indexes = [0, 0]
    with pytest.raises(UserError, match="feeds 2 deepstack layers into a language model of 2"):
        gguf_vision.check(cfg)
    _, base, _ = runs("qwen2_5_vl")
    cfg = AutoConfig.from_pretrained(base)
    assert gguf_vision.wa_pattern(cfg.vision_config) == 0  # all blocks full
    cfg.vision_config.depth, cfg.vision_config.fullatt_block_indexes = 4, [1, 3]
    with pytest.raises(UserError, match="windows of 56 pixels; llama.cpp's are fixed at 112"):
        gguf_vision.check(cfg)
    cfg.vision_config.window_size, cfg.vision_config.fullatt_block_indexes = 112, [0, 3]
    with pytest.raises(UserError, match=r"full-attention blocks \[0, 3\] are not every n-th block"):
        gguf_vision.check(cfg)
    cfg.vision_config.fullatt_block_indexes = [1, 3]
    assert gguf_vision.check(cfg).projector == "QWEN25VL"
    cfg.model_type = "paligemma"
    with pytest.raises(UserError, match="cannot see"):
        gguf_vision.check(cfg)
    _, qwen35, _ = runs("qwen3_5")
    cfg = AutoConfig.from_pretrained(qwen35)
    assert gguf_vision.check(cfg).projector == "QWEN3VL"  # sections [2, 1, 1] over 4 pairs: time, height, width, time
    # pair 3 goes by time in transformers, by llama.cpp's fourth position (time's section covers pair 0 only): on an
    # image, llama.cpp's logits then differ by 0.019 instead of 0.0013 (measured with the tiny 4-layer Qwen3.5)
    cfg.text_config.rope_parameters["mrope_section"] = [1, 1, 2]
    with pytest.raises(UserError, match=r"sections \[1, 1, 2\] over its 4 rotated pairs place pairs \[3\] by another"):
        gguf_vision.check(cfg)
    _, gemma, _ = runs("gemma3")
    cfg = AutoConfig.from_pretrained(gemma)
    cfg.mm_tokens_per_image = 3  # 4 x 4 patches into 3 tokens: no one pooling kernel
    with pytest.raises(UserError, match="not an even square grid"):
        gguf_vision.check(cfg)


def test_ollama_gets_both_files_and_a_modelfile_naming_both(runs):
    """Ollama (server/create.go at fb30760) files a GGUF whose general.type is mmproj as the model's projector layer
    and runs it with llama.cpp's --mmproj; several FROM lines add files to one model."""
    run, _, _ = runs("qwen2_5_vl")
    assert main(["export", str(run), "--to", "ollama"]) == 0
    folder = run / "export" / "ollama"
    assert sorted(p.name for p in folder.iterdir()) == ["Modelfile", "mmproj.gguf", "model.gguf"]
    text = (folder / "Modelfile").read_text()
    assert text.startswith("FROM ./model.gguf\nFROM ./mmproj.gguf\nTEMPLATE \"\"\"")
    assert "<|im_start|>" in text and 'PARAMETER stop "<|im_end|>"' in text
    meta, tensors = _read(folder / "mmproj.gguf")
    assert meta["general.type"] == "mmproj" and meta["general.architecture"] == "clip"
    assert "v.patch_embd.weight.1" in tensors


def test_gguf_lora_is_the_language_model_s_and_the_base_keeps_its_eyes(tmp_path):
    """--to gguf-lora: the language model's LoRA (llama.cpp's names), --with-base the base model and its mmproj; an
    adapter with LoRA on the vision tower is refused (llama.cpp applies a LoRA to the language model only)."""
    from rocktune.tasks.vlm.demo.tiny_vlm import build_tiny_vlm
    from tests.export_fixtures import VLM_LM_TARGETS

    base = build_tiny_vlm(tmp_path / "base", family="qwen2_vl")
    make_vlm_run(tmp_path / "run", base, VLM_LM_TARGETS)
    assert main(["export", str(tmp_path / "run"), "--to", "gguf-lora", "--with-base"]) == 0
    out = tmp_path / "run" / "export"
    assert sorted(p.name for p in out.iterdir()) == ["adapter-f32.gguf", "base-f16.gguf", "mmproj-base-f16.gguf"]
    meta, tensors = _read(out / "adapter-f32.gguf")
    assert meta["general.architecture"] == "qwen2vl" and meta["general.type"] == "adapter"
    assert sorted(tensors) == sorted(f"blk.{i}.{t}.weight.lora_{ab}" for i in range(2)
                                     for t in ("attn_q", "attn_v", "ffn_down") for ab in "ab")
    make_vlm_run(tmp_path / "eyes", base)
    assert main(["export", str(tmp_path / "eyes"), "--to", "gguf-lora"]) == 2
    assert not (tmp_path / "eyes" / "export").exists()


def _expected_siglip(state: dict) -> dict[str, np.ndarray]:
    """A SigLIP tower and its projector in llama.cpp's names, spelt out here: Gemma 3's soft-embedding norm as 1 + w."""
    blocks = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
              "self_attn.out_proj": "attn_out", "layer_norm1": "ln1", "layer_norm2": "ln2", "mlp.fc1": "ffn_up",
              "mlp.fc2": "ffn_down"}
    whole = {"embeddings.patch_embedding": "v.patch_embd", "embeddings.position_embedding": "v.position_embd",
             "post_layernorm": "v.post_ln", "multi_modal_projector.mm_input_projection": "mm.input_projection",
             "multi_modal_projector.mm_soft_emb_norm": "mm.soft_emb_norm",
             "connector.modality_projection.proj": "mm.model.fc"}
    want = {}
    for key, t in state.items():
        if not key.startswith(("model.vision_tower.", "model.vision_model.", "model.multi_modal_projector.",
                               "model.connector.")):
            continue
        a = t.float().numpy() + (1.0 if "soft_emb_norm" in key else 0.0)
        stem, kind = key.replace("_weight", ".weight").rsplit(".", 1)
        stem = stem.split(".", 2)[2] if stem.split(".")[1] in ("vision_tower", "vision_model") else stem[6:]
        if stem.startswith("encoder.layers."):
            _, _, i, rest = stem.split(".", 3)
            want[f"v.blk.{i}.{blocks[rest]}.{kind}"] = a
        else:
            want[f"{whole[stem]}.{kind}"] = a
    return want


@pytest.mark.parametrize("family", SIGLIP)
def test_siglip_families_gguf_and_mmproj_hold_the_merged_weights(runs, family, capsys):
    """Gemma 3 (llama.cpp's gemma3 language model, gemma3 projector) and SmolVLM/Idefics3 (llama, idefics3): the
    mmproj holds the merged SigLIP tower and projector (embeddings kept f32, as llama.cpp's converter keeps them) and
    the keys mtmd reads for the pooling / pixel shuffle."""
    run, _, merged = runs(family)
    assert main(["export", str(run), "--to", "gguf"]) == 0
    gemma = family == "gemma3"  # the tiny byte-level tokenizer has no "\n\n" token, which mtmd's tiles look up
    assert ("no single token for '\\n\\n'" in capsys.readouterr().out) is not gemma
    state = merged.state_dict()
    meta, tensors = _read(run / "export" / "model-f16.gguf")
    text = "model.language_model." if gemma else "model.text_model."
    assert meta["general.architecture"] == ("gemma3" if gemma else "llama") and meta["general.type"] == "model"
    assert _close(tensors["token_embd.weight"][1], state[text + "embed_tokens.weight"].numpy(), "F16")
    assert _close(tensors["blk.1.ffn_down.weight"][1], state[text + "layers.1.mlp.down_proj.weight"].numpy(), "F16")
    norm = state[text + "norm.weight"].numpy() + (1.0 if gemma else 0.0)  # Gemma's RMSNorm scales by 1 + w
    assert _close(tensors["output_norm.weight"][1], norm, "F32")
    meta, tensors = _read(run / "export" / "mmproj-f16.gguf")
    want = _expected_siglip(state)
    assert set(tensors) == set(want)
    for name, (kind, data) in tensors.items():
        expected_kind = "F32" if data.ndim == 1 or name.startswith(("v.patch_embd", "v.position_embd")) else "F16"
        assert kind == expected_kind and _close(data, want[name], kind), name
    assert meta["general.architecture"] == "clip" and meta["general.type"] == "mmproj"
    assert meta["clip.projector_type"] == ("gemma3" if gemma else "idefics3") and meta["clip.use_gelu"] is True
    assert meta["clip.vision.image_size"] == 32 and meta["clip.vision.patch_size"] == 8
    assert meta["clip.vision.block_count"] == 1 and meta["clip.vision.attention.head_count"] == 2
    assert meta["clip.vision.embedding_length"] == 32 and meta["clip.vision.projection_dim"] == 128
    assert meta["clip.vision.attention.layer_norm_epsilon"] == pytest.approx(1e-6)
    # Gemma 3: 4 x 4 patches pooled 2 x 2 into 4 tokens (mtmd's default kernel is 4); Idefics3: pixel shuffle by 2
    # of 32-pixel tiles cut from images resized to at most 64 pixels a side
    assert meta["clip.vision.projector.scale_factor"] == 2
    assert meta.get("clip.vision.preproc_image_size") == (None if gemma else 64)
    if gemma:  # bf16 asked: Gemma 3's input projection f16, as llama.cpp's converter writes it
        assert main(["export", str(run), "--to", "gguf", "--quant", "bf16"]) == 0
        _, tensors = _read(run / "export" / "mmproj-bf16.gguf")
        assert tensors["mm.input_projection.weight"][0] == "F16" and tensors["v.blk.0.attn_q.weight"][0] == "BF16"


def test_siglip_families_to_ollama_and_gguf_lora(runs, tmp_path):
    """--to ollama: both files and a Modelfile (Gemma's turns); --to gguf-lora: the language model's LoRA under
    llama.cpp's gemma3 / llama names (an adapter on the tower is refused)."""
    from rocktune.tasks.vlm.demo.tiny_vlm import build_tiny_vlm
    from tests.export_fixtures import SIGLIP_LM_TARGETS

    run, _, _ = runs("gemma3")
    assert main(["export", str(run), "--to", "ollama"]) == 0
    folder = run / "export" / "ollama"
    assert sorted(p.name for p in folder.iterdir()) == ["Modelfile", "mmproj.gguf", "model.gguf"]
    text = (folder / "Modelfile").read_text()
    assert text.startswith("FROM ./model.gguf\nFROM ./mmproj.gguf\n") and "<start_of_turn>" in text
    assert _read(folder / "mmproj.gguf")[0]["clip.projector_type"] == "gemma3"
    for family, arch in (("smolvlm", "llama"), ("gemma3", "gemma3")):
        base = build_tiny_vlm(tmp_path / family / "base", family=family)
        make_vlm_run(tmp_path / family / "run", base, SIGLIP_LM_TARGETS)
        assert main(["export", str(tmp_path / family / "run"), "--to", "gguf-lora"]) == 0
        meta, tensors = _read(tmp_path / family / "run" / "export" / "adapter-f32.gguf")
        assert meta["general.architecture"] == arch and meta["general.type"] == "adapter"
        assert sorted(tensors) == sorted(f"blk.{i}.{t}.weight.lora_{ab}" for i in range(2)
                                         for t in ("attn_q", "attn_v", "ffn_down") for ab in "ab")
    assert main(["export", str(runs("smolvlm")[0]), "--to", "gguf-lora"]) == 2  # LoRA on the tower and connector


def _then(stdout: str) -> list[str]:
    """The printed next command (``note: then: ...``), split as a shell splits it, without the server's remark."""
    import shlex

    lines = [line for line in stdout.splitlines() if line.startswith("note: then: ")]
    assert len(lines) == 1, stdout
    return shlex.split(lines[0].removeprefix("note: then: ").split(" (or llama-server")[0])


def _flag(argv: list[str], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv else None


def _with_data(run: Path, **data) -> None:
    import yaml

    for where in (run / "adapter" / "rocktune_config.yaml", run / "config.yaml"):
        cfg = yaml.safe_load(where.read_text())
        cfg["data"] = data
        where.write_text(yaml.safe_dump(cfg))


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen2_vl", "qwen3_vl", "qwen3_5"])
def test_the_image_token_limits_go_in_the_mmproj_and_the_printed_command(runs, family, capsys):
    """llama.cpp's mtmd resizes Qwen images between limits of its own (8 to 4096 tokens) and reads none from the
    mmproj for these projectors: the printed command carries the processor's (4 to 16 tokens of the tiny models),
    and the mmproj carries them as llama.cpp's pixel keys."""
    run, _, merged = runs(family)
    capsys.readouterr()
    assert main(["export", str(run), "--to", "gguf", "--quant", "f32", "--overwrite"]) == 0
    argv = _then(capsys.readouterr().out)
    out = run / "export"
    side = 32 if family in ("qwen3_vl", "qwen3_5") else 28
    assert argv[:5] == ["llama-mtmd-cli", "-m", str(out / "model-f32.gguf"), "--mmproj", str(out / "mmproj-f32.gguf")]
    assert (_flag(argv, "--image-min-tokens"), _flag(argv, "--image-max-tokens"), _flag(argv, "--lora")) == \
        ("4", "16", None)
    meta, _ = _read(out / "mmproj-f32.gguf")
    assert (meta["clip.vision.image_min_pixels"], meta["clip.vision.image_max_pixels"]) == (4 * side**2, 16 * side**2)
    assert merged.config.vision_config.spatial_merge_size == 2


def test_the_run_s_pixel_limits_win_and_limits_between_tokens_are_said(tmp_path, capsys):
    """data.min_pixels / data.max_pixels are what training resized by: the export takes them, not the base's
    preprocessor_config.json; limits that are not whole 28 x 28 tokens are rounded so that mtmd resizes the same
    images (min up, max down) and a note says what cannot be exact."""
    from rocktune.tasks.vlm.demo.tiny_vlm import build_tiny_vlm

    base = build_tiny_vlm(tmp_path / "base")
    make_vlm_run(tmp_path / "run", base)
    _with_data(tmp_path / "run", min_pixels=784 * 2, max_pixels=784 * 9)
    assert main(["export", str(tmp_path / "run"), "--to", "gguf", "--quant", "f32"]) == 0
    argv = _then(capsys.readouterr().out)
    assert (_flag(argv, "--image-min-tokens"), _flag(argv, "--image-max-tokens")) == ("2", "9")
    _with_data(tmp_path / "run", min_pixels=784 * 2 + 1, max_pixels=784 * 9 - 1)
    assert main(["export", str(tmp_path / "run"), "--to", "gguf", "--quant", "f32", "--overwrite"]) == 0
    printed = capsys.readouterr().out
    assert (_flag(_then(printed), "--image-min-tokens"), _flag(_then(printed), "--image-max-tokens")) == ("3", "8")
    assert "min_pixels/max_pixels 1569/7055 are not whole image tokens of 784 pixels" in printed
    meta, _ = _read(tmp_path / "run" / "export" / "mmproj-f32.gguf")
    assert (meta["clip.vision.image_min_pixels"], meta["clip.vision.image_max_pixels"]) == (1569, 7055)


def test_the_printed_gguf_lora_command_applies_the_lora(tmp_path, capsys):
    """gguf-lora --with-base printed `llama-mtmd-cli -m base-f16.gguf --mmproj ...`, the untrained base: the command
    names the LoRA (and the run's image-token limits); without --with-base, placeholders for the base's files."""
    from rocktune.tasks.vlm.demo.tiny_vlm import build_tiny_vlm
    from tests.export_fixtures import VLM_LM_TARGETS

    base = build_tiny_vlm(tmp_path / "base")
    make_vlm_run(tmp_path / "run", base, VLM_LM_TARGETS)
    _with_data(tmp_path / "run", max_pixels=784 * 9)
    out = tmp_path / "run" / "export"
    assert main(["export", str(tmp_path / "run"), "--to", "gguf-lora", "--with-base"]) == 0
    argv = _then(capsys.readouterr().out)
    assert argv[0] == "llama-mtmd-cli" and _flag(argv, "-m") == str(out / "base-f16.gguf")
    assert _flag(argv, "--lora") == str(out / "adapter-f32.gguf")
    assert _flag(argv, "--mmproj") == str(out / "mmproj-base-f16.gguf")
    assert (_flag(argv, "--image-min-tokens"), _flag(argv, "--image-max-tokens")) == ("4", "9")
    meta, _ = _read(out / "mmproj-base-f16.gguf")  # the base's mmproj as the run trained it to see
    assert meta["clip.vision.image_max_pixels"] == 784 * 9
    assert main(["export", str(tmp_path / "run"), "--to", "gguf-lora", "--overwrite"]) == 0
    printed = capsys.readouterr().out
    argv = _then(printed)
    assert (_flag(argv, "-m"), _flag(argv, "--lora"), _flag(argv, "--mmproj")) == \
        ("BASE.gguf", str(out / "adapter-f32.gguf"), "MMPROJ-BASE.gguf")
    assert f"the base {base} and its mmproj as GGUF (--with-base writes them)" in printed


def test_siglip_families_print_no_image_token_flags(runs, capsys):
    """Gemma 3's processor has one size (no limits to carry): no flags, no pixel keys."""
    run, _, _ = runs("gemma3")
    capsys.readouterr()
    assert main(["export", str(run), "--to", "gguf", "--quant", "f32", "--overwrite"]) == 0
    argv = _then(capsys.readouterr().out)
    assert argv[0] == "llama-mtmd-cli" and "--image-min-tokens" not in argv and "--lora" not in argv
    meta, _ = _read(run / "export" / "mmproj-f32.gguf")
    assert "clip.vision.image_min_pixels" not in meta


def test_ollama_says_its_fixed_image_token_minimum(runs, capsys):
    """Ollama starts Qwen-VL models with --image-min-tokens 1024 and a Modelfile has no parameter for it: the note
    says so and gives the llama-server command with the trained limits."""
    run, _, _ = runs("qwen2_5_vl")
    capsys.readouterr()
    assert main(["export", str(run), "--to", "ollama", "--overwrite"]) == 0
    printed = capsys.readouterr().out
    assert "Ollama runs Qwen-VL models with at least 1024 image tokens" in printed
    assert "--image-min-tokens 4 --image-max-tokens 16" in printed
    assert "then: ollama create" in printed
