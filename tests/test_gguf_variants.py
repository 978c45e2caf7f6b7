"""Granite 4 and Gemma 4 as GGUF beyond the family matrix's fixture: the shapes the released checkpoints have (Granite
4's hybrids without positions and its dense hybrid; Gemma's own kind of tokenizer, Gemma 4's KV-sharing tail with
twice-wide MLPs and keys as values, and the multimodal Gemma4ForConditionalGeneration whose language model a text run
trains). For each: the export equals llama.cpp's own converter on the same merged directory (tensor for tensor, key
for key, the keys only rocktune writes aside: tests/test_gguf_converter.py), and llama.cpp runs the file with the
merged transformers model's tokenisation and greedy tokens, and the base with the GGUF LoRA with them too."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from rocktune.cli import main
from rocktune.export.arch import ARCHS
from tests.gguf_variants import build_variant, gemma_tokenizer

pytestmark = pytest.mark.llama_cpp
# llama.cpp's logits may differ from transformers' by this share of what the adapter changed them by (both f32)
TOLERANCE = 0.01

GRANITE4_RELEASED = {"position_embedding_type": "nope", "vocab_size": 304}
# id -> (family, config changes, tokenizer or None)
VARIANTS = {
    "granite4-no-rope": ("granite4", GRANITE4_RELEASED, None),
    # llama.cpp sizes a dense model's MLP by feed_forward_length, which the converter writes from intermediate_size
    # and rocktune from the shared MLP's width; they agree where the two are equal
    "granite4-dense": ("granite4", {**GRANITE4_RELEASED, "num_local_experts": 0, "num_experts_per_tok": 0,
                                    "intermediate_size": 64}, None),
    # granite-4.0-micro's shape: attention only (llama.cpp's granite graph), rope on
    "granite4-attention": ("granite4", {"layer_types": ["full_attention"] * 2, "num_local_experts": 0,
                                        "num_experts_per_tok": 0, "intermediate_size": 64}, None),
    "gemma4-tokenizer": ("gemma4", {}, gemma_tokenizer),
    "gemma4-shared-kv": ("gemma4", {"num_hidden_layers": 4, "layer_types": ["sliding_attention", "full_attention"] * 2,
                                    "num_kv_shared_layers": 2, "use_double_wide_mlp": True, "attention_k_eq_v": True,
                                    "num_global_key_value_heads": 1}, gemma_tokenizer),
}
# what the released Granite 4 config.json says (transformers 5 saves linear_attention / full_attention; llama.cpp's
# converter reads only these)
RELEASED_NAMES = {"linear_attention": "mamba", "full_attention": "attention"}


def _multimodal_gemma4(out: Path) -> Path:
    """Gemma 4 as it ships: Gemma4ForConditionalGeneration, a vision tower beside the language model."""
    import torch
    import transformers

    text_dir = build_variant("gemma4", out.with_name("text"), {}, gemma_tokenizer())
    text = json.loads((text_dir / "config.json").read_text())
    vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
              "num_key_value_heads": 2, "head_dim": 16}
    config = transformers.Gemma4Config(text_config=text, vision_config=vision, audio_config=None)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(out)
    transformers.AutoTokenizer.from_pretrained(text_dir).save_pretrained(out)
    return out


def _run(base: Path, out: Path) -> Path:
    """A run with a random LoRA on all-linear, but what llama.cpp multiplies without a LoRA (--to gguf-lora refuses
    an adapter on it: tests/test_families.py::test_gguf_lora)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from rocktune.models.load import lora_targets
    from tests.export_fixtures import make_run

    model = AutoModelForCausalLM.from_pretrained(base)
    targets, params = lora_targets(model, "all-linear")
    skip = ARCHS[AutoConfig.from_pretrained(base).model_type].no_lora
    if skip:  # the adapted Linear modules by their full names, those llama.cpp applies no LoRA to left out
        from peft import LoraConfig, get_peft_model

        peft = get_peft_model(model, LoraConfig(target_modules=targets, target_parameters=params or None))
        targets = [n.removeprefix("base_model.model.") for n, m in peft.named_modules()
                   if hasattr(m, "lora_A") and not n.endswith(skip)]
    make_run(out, base, targets, data_format="messages", **({"target_parameters": params} if params else {}))
    return out


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_the_released_shapes_equal_the_converter_and_run_in_llama_cpp(tmp_path, monkeypatch, variant):
    pytest.importorskip("llama_cpp", reason="not run here (llama-cpp-python not installed)")
    from tests.llama_cpp_converter import convert, converter_source
    from tests.test_export_llama_cpp import use_plain_cpu_buffers
    from tests.test_gguf_converter import assert_same_gguf, read

    use_plain_cpu_buffers(monkeypatch)
    family, changes, tokenizer = VARIANTS[variant]
    base = build_variant(family, tmp_path / "base", changes, tokenizer and tokenizer())
    run = _run(base, tmp_path / "run")
    out = run / "export"
    assert main(["export", str(run), "--to", "merged", "--dtype", "fp32"]) == 0
    config = out / "merged" / "config.json"
    doc = json.loads(config.read_text())
    if doc["model_type"] == "granitemoehybrid":
        doc["layer_types"] = [RELEASED_NAMES[t] for t in doc["layer_types"]]
        config.write_text(json.dumps(doc))
    assert main(["export", str(run), "--to", "gguf", "--quant", "f32"]) == 0
    ours = out / "model-f32.gguf"
    src = converter_source()
    if src is not None:  # the converter's file for the same merged directory
        done = convert(src, out / "merged", tmp_path / "converter.gguf", "f32",
                       read(ours)[0].get("tokenizer.ggml.pre", "default"), doc["model_type"])
        assert done.returncode == 0, done.stderr[-3000:]
        assert assert_same_gguf(ours, tmp_path / "converter.gguf", read(ours)[0]["general.architecture"]) > 0

    assert main(["export", str(base), "--to", "gguf", "--quant", "f32", "--out", str(tmp_path / "base.gguf")]) == 0
    assert main(["export", str(run), "--to", "gguf-lora"]) == 0
    _runs_as_transformers(base, out / "merged", {"model": ours, "base": tmp_path / "base.gguf",
                                                  "lora": out / "adapter-f32.gguf"})


@pytest.mark.slow
def test_gemma4_as_it_ships_gives_its_language_model(tmp_path, monkeypatch, capsys):
    """Gemma4ForConditionalGeneration (the released checkpoints; a text run trains its language model): the
    export's GGUF writer and GGUF-LoRA writer give the language model alone, equal to llama.cpp's converter on the
    merged checkpoint (which writes the text model for it too) and run by llama.cpp as transformers runs the whole
    model on text. `export --to gguf` and `--to gguf-lora` take this route for it (no Gemma 4 mmproj writer yet: the
    vision tower is left out, with a note)."""
    pytest.importorskip("llama_cpp", reason="not run here (llama-cpp-python not installed)")
    import torch
    from transformers import AutoModelForCausalLM

    from rocktune.export import gguf_lora, gguf_model
    from rocktune.export.arch import arch_for
    from tests.llama_cpp_converter import convert, converter_source
    from tests.test_export_llama_cpp import use_plain_cpu_buffers
    from tests.test_gguf_converter import assert_same_gguf

    use_plain_cpu_buffers(monkeypatch)
    base = _multimodal_gemma4(tmp_path / "base")
    run = _run(base, tmp_path / "run")
    assert main(["export", str(run), "--to", "merged", "--dtype", "fp32"]) == 0
    merged_dir = run / "export" / "merged"
    files = {"model": tmp_path / "model.gguf", "base": tmp_path / "base.gguf", "lora": tmp_path / "lora.gguf"}
    # the command routes the multimodal run to the text export (no Gemma 4 mmproj writer), saying so
    capsys.readouterr()
    assert main(["export", str(run), "--to", "gguf", "--quant", "f32", "--out", str(files["model"])]) == 0
    assert "vision tower is left out of the GGUF" in capsys.readouterr().out
    assert main(["export", str(run), "--to", "gguf-lora", "--out", str(files["lora"])]) == 0
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    arch = arch_for(model.config)
    tensors = gguf_model.gguf_tensors(model.state_dict(), model.config, arch)
    gguf_model.write_model_gguf(tensors, model.config, arch, base, files["base"], "f32", "base")
    pairs, _ = gguf_lora.lora_tensors(run / "adapter", model.config, arch)
    assert pairs and all(name.startswith(("blk.", "per_layer")) for name in pairs)
    src = converter_source()
    if src is not None:
        done = convert(src, merged_dir, tmp_path / "converter.gguf", "f32", "default", "gemma4")
        assert done.returncode == 0, done.stderr[-3000:]
        assert assert_same_gguf(files["model"], tmp_path / "converter.gguf", "gemma4") > 0
    _runs_as_transformers(base, merged_dir, files)


def _runs_as_transformers(base: Path, merged_dir: Path, files: dict) -> None:
    """llama.cpp's tokens and greedy continuation of files["model"] equal the merged transformers model's; its
    logits at every prompt position (the tuned file's, the base with the GGUF LoRA's, the base's) equal
    transformers' within TOLERANCE of what the adapter changed."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tests.test_export_llama_cpp import TEXTS, check_tokenizer, hf_greedy, llama, llama_greedy

    tok = AutoTokenizer.from_pretrained(base)
    ids = tok(TEXTS[0])["input_ids"]
    merged = AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32)
    plain = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    llm = llama(files["model"])
    check_tokenizer(llm, tok)
    assert llama_greedy(llm, ids, 16) == hf_greedy(merged, ids, 16)
    with_lora = llama(files["base"], lora=files["lora"])
    # logits at every prompt position: tiny random models often repeat one token greedily, adapter or not
    want, base_want = _hf_logits(merged, ids), _hf_logits(plain, ids)
    for got in (_llama_logits(llm, ids), _llama_logits(with_lora, ids)):
        assert np.abs(got - want).max() < TOLERANCE * np.abs(want - base_want).max()
    assert np.abs(_llama_logits(llama(files["base"]), ids) - base_want).max() < \
        TOLERANCE * np.abs(want - base_want).max()


def _hf_logits(model, ids: list[int]) -> np.ndarray:
    import torch

    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().numpy()


def _llama_logits(llm, ids: list[int]) -> np.ndarray:
    llm.reset()
    llm.eval(ids)
    return np.asarray(llm.scores[:len(ids)], dtype=np.float32)
