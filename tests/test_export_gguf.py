"""--to gguf / gguf-lora / ollama, read back with gguf-py's GGUFReader (llama.cpp itself: test_export_llama_cpp.py)."""

from __future__ import annotations

import numpy as np
import pytest

from rocktune.cli import main
from rocktune.export import ollama_templates
from tests.export_fixtures import build_model, make_run

gguf = pytest.importorskip("gguf", reason="the gguf package (pip install 'rocktune[gguf]') writes GGUF files")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf-bases")
    return {arch: build_model(root / arch, arch, tied=arch != "llama") for arch in ("qwen2", "llama", "qwen3")}


def fields(reader) -> dict:
    return {name: f.contents() for name, f in reader.fields.items() if not name.startswith("GGUF.")}


@pytest.mark.parametrize("arch", ["qwen2", "llama", "qwen3"])
def test_gguf_metadata_names_and_shapes(models, tmp_path, arch):
    from transformers import AutoConfig, AutoTokenizer

    run = tmp_path / "run"
    make_run(run, models[arch], "all-linear")
    assert main(["export", str(run), "--to", "gguf", "--quant", "f32"]) == 0
    reader = gguf.GGUFReader(run / "export" / "model-f32.gguf")
    kv = fields(reader)
    cfg = AutoConfig.from_pretrained(models[arch])
    tok = AutoTokenizer.from_pretrained(models[arch])
    assert kv["general.architecture"] == arch and kv["general.type"] == "model"
    assert kv[f"{arch}.block_count"] == 2 and kv[f"{arch}.embedding_length"] == 64
    assert kv[f"{arch}.attention.head_count"] == 4 and kv[f"{arch}.attention.head_count_kv"] == 2
    assert kv[f"{arch}.attention.key_length"] == (32 if arch == "qwen3" else 16)
    assert kv[f"{arch}.feed_forward_length"] == 128 and kv[f"{arch}.context_length"] == 512
    assert kv["tokenizer.ggml.model"] == "gpt2"
    assert kv["tokenizer.ggml.pre"] == ("llama-bpe" if arch == "llama" else "qwen2")
    tokens = kv["tokenizer.ggml.tokens"]
    assert len(tokens) == cfg.vocab_size and tokens[: len(tok)] == tok.convert_ids_to_tokens(list(range(len(tok))))
    assert len(kv["tokenizer.ggml.merges"]) > 50
    assert kv["tokenizer.ggml.eos_token_id"] == tok.eos_token_id
    assert kv["tokenizer.ggml.add_bos_token"] == (arch == "llama")
    assert kv["tokenizer.chat_template"] == tok.chat_template
    names = {t.name: tuple(int(x) for x in t.shape) for t in reader.tensors}
    assert names["token_embd.weight"] == (64, cfg.vocab_size)  # GGUF lists ne[0] (the row length) first
    assert names["blk.1.ffn_down.weight"] == (128, 64)
    assert ("output.weight" in names) == (arch == "llama")  # tied heads reuse token_embd
    if arch == "qwen2":
        assert "blk.0.attn_q.bias" in names
    if arch == "qwen3":
        assert names["blk.0.attn_q.weight"] == (64, 128) and "blk.0.attn_k_norm.weight" in names
    assert len(names) == len([k for k in _merged_state(run) if not (k == "lm_head.weight" and arch != "llama")])


def _merged_state(run):
    from rocktune.export.merge import merged_model
    from rocktune.export.source import resolve

    return merged_model(resolve(str(run)), "fp32")[0].state_dict()


def test_gguf_values_are_the_merged_weights(models, tmp_path):
    """Values, not only shapes: llama's q rows are interleaved for llama.cpp's rotary layout, the rest verbatim."""
    from rocktune.export.arch import _interleave

    run = tmp_path / "run"
    make_run(run, models["llama"], "all-linear")
    assert main(["export", str(run), "--to", "gguf", "--quant", "f32"]) == 0
    tensors = {t.name: np.asarray(t.data) for t in gguf.GGUFReader(run / "export" / "model-f32.gguf").tensors}
    state = _merged_state(run)
    q = state["model.layers.0.self_attn.q_proj.weight"].numpy()
    np.testing.assert_array_equal(tensors["blk.0.attn_q.weight"], _interleave(q, 4))
    assert not np.array_equal(tensors["blk.0.attn_q.weight"], q)
    np.testing.assert_array_equal(tensors["blk.1.ffn_up.weight"], state["model.layers.1.mlp.up_proj.weight"].numpy())


@pytest.mark.parametrize("quant,ggml", [("f16", "F16"), ("bf16", "BF16"), ("q8_0", "Q8_0"), ("q4_0", "Q4_0")])
def test_gguf_quant_types(models, tmp_path, quant, ggml):
    run = tmp_path / "run"
    make_run(run, models["qwen2"], ["q_proj"])
    assert main(["export", str(run), "--to", "gguf", "--quant", quant]) == 0
    reader = gguf.GGUFReader(run / "export" / f"model-{quant}.gguf")
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    assert types["blk.0.attn_q.weight"] == ggml and types["blk.0.attn_norm.weight"] == "F32"
    if quant == "q8_0":  # dequantised values stay within Q8_0's error of the fp32 weights
        t = next(t for t in reader.tensors if t.name == "blk.0.ffn_up.weight")
        got = gguf.quants.dequantize(t.data, t.tensor_type).reshape(128, 64)
        want = _merged_state(run)["model.layers.0.mlp.up_proj.weight"].numpy()
        assert np.abs(got - want).max() < np.abs(want).max() / 100


def test_gguf_lora_names_alpha_and_scale_folding(models, tmp_path):
    """rsLoRA scales by alpha/sqrt(r), llama.cpp by alpha/r: the ratio is folded into lora_b so B·A·scale matches."""
    from safetensors.torch import load_file

    run = tmp_path / "run"
    make_run(run, models["llama"], ["q_proj", "down_proj"], r=4, use_rslora=True)
    assert main(["export", str(run), "--to", "gguf-lora"]) == 0
    reader = gguf.GGUFReader(run / "export" / "adapter-f32.gguf")
    kv = fields(reader)
    assert kv["general.type"] == "adapter" and kv["adapter.type"] == "lora" and kv["general.architecture"] == "llama"
    assert kv["adapter.lora.alpha"] == 8.0
    t = {x.name: np.asarray(x.data) for x in reader.tensors}
    assert sorted(t) == ["blk.0.attn_q.weight.lora_a", "blk.0.attn_q.weight.lora_b", "blk.0.ffn_down.weight.lora_a",
                         "blk.0.ffn_down.weight.lora_b", "blk.1.attn_q.weight.lora_a", "blk.1.attn_q.weight.lora_b",
                         "blk.1.ffn_down.weight.lora_a", "blk.1.ffn_down.weight.lora_b"]
    peft = load_file(run / "adapter" / "adapter_model.safetensors")
    a = peft["base_model.model.model.layers.1.mlp.down_proj.lora_A.weight"].numpy()
    b = peft["base_model.model.model.layers.1.mlp.down_proj.lora_B.weight"].numpy()
    delta_peft = (b @ a) * 8.0 / np.sqrt(4)
    delta_gguf = (t["blk.1.ffn_down.weight.lora_b"] @ t["blk.1.ffn_down.weight.lora_a"]) * 8.0 / 4
    np.testing.assert_allclose(delta_gguf, delta_peft, rtol=1e-5, atol=1e-6)


def test_ollama_bundle(models, tmp_path):
    run = tmp_path / "run"
    make_run(run, models["qwen2"], ["q_proj"], data_format="messages")
    assert main(["export", str(run), "--to", "ollama", "--quant", "q8_0"]) == 0
    bundle = run / "export" / "ollama"
    text = (bundle / "Modelfile").read_text()
    assert text.startswith("FROM ./model.gguf\n")
    # the tiny model's ChatML has no tools: its TEMPLATE is ChatML without tool blocks
    assert f'TEMPLATE """{ollama_templates.CHATML_PLAIN}"""' in text and 'PARAMETER stop "<|im_end|>"' in text
    assert "PARAMETER temperature 0" in text
    assert fields(gguf.GGUFReader(bundle / "model.gguf"))["general.file_type"] == 7  # MOSTLY_Q8_0
    # a run trained on raw prompt/completion text is prompted raw, whatever the tokenizer's template
    raw = tmp_path / "raw"
    make_run(raw, models["qwen2"], ["q_proj"], data_format="prompt_completion")
    assert main(["export", str(raw), "--to", "ollama"]) == 0
    assert 'TEMPLATE """{{ .Prompt }}"""' in (raw / "export" / "ollama" / "Modelfile").read_text()


def test_unmodified_base_converts_without_adapter(models, tmp_path):
    out = tmp_path / "base.gguf"
    assert main(["export", str(models["qwen3"]), "--to", "gguf", "--out", str(out)]) == 0
    kv = fields(gguf.GGUFReader(out))
    assert kv["general.architecture"] == "qwen3" and kv["general.file_type"] == 1  # MOSTLY_F16, the default


def test_sentencepiece_vocabulary_metadata(tmp_path):
    pytest.importorskip("sentencepiece", reason="sentencepiece reads tokenizer.model (rocktune[gguf])")
    from tests.export_fixtures import build_spm_llama

    base = build_spm_llama(tmp_path / "base", added=("<|im_end|>",))
    assert main(["export", str(base), "--to", "gguf", "--out", str(tmp_path / "m.gguf")]) == 0
    kv = fields(gguf.GGUFReader(tmp_path / "m.gguf"))
    assert kv["tokenizer.ggml.model"] == "llama" and kv["tokenizer.ggml.add_bos_token"] is True
    assert len(kv["tokenizer.ggml.tokens"]) == len(kv["tokenizer.ggml.scores"]) == 405
    assert kv["tokenizer.ggml.tokens"][400:402] == ["<|im_end|>", "[PAD401]"]
    assert list(kv["tokenizer.ggml.token_type"][400:402]) == [gguf.TokenType.CONTROL, gguf.TokenType.UNUSED]
    assert kv["tokenizer.ggml.tokens"][:3] == ["<unk>", "<s>", "</s>"] and "<0x0A>" in kv["tokenizer.ggml.tokens"]
    assert kv["tokenizer.ggml.bos_token_id"] == 1 and kv["tokenizer.ggml.eos_token_id"] == 2
    assert "tokenizer.ggml.add_space_prefix" not in kv  # llama.cpp's default: a space before the text
    plain = build_spm_llama(tmp_path / "plain", space_prefix=False)  # Gemma-style: no space put before the text
    assert main(["export", str(plain), "--to", "gguf", "--out", str(tmp_path / "p.gguf")]) == 0
    assert fields(gguf.GGUFReader(tmp_path / "p.gguf"))["tokenizer.ggml.add_space_prefix"] is False


def test_gemma4_tokenizer_metadata(tmp_path):
    """Gemma 4's tokenizer.json (BPE with byte fallback over "\u2581"-spaced text) as llama.cpp's gemma4 tokenizer: the
    tokens in id order, byte tokens as bytes, special tokens as controls but the ones its chat parser reads as text,
    the merges, no space before the text, BOS added, padding rows as unused tokens (llama.cpp itself:
    tests/test_gguf_variants.py)."""
    import json

    from tests.gguf_variants import build_variant, gemma_tokenizer

    tok = gemma_tokenizer()
    base = build_variant("gemma4", tmp_path / "base", {"vocab_size": len(tok) + 2}, tok)
    assert main(["export", str(base), "--to", "gguf", "--quant", "f32", "--out", str(tmp_path / "m.gguf")]) == 0
    kv = fields(gguf.GGUFReader(tmp_path / "m.gguf"))
    assert kv["tokenizer.ggml.model"] == "gemma4" and "tokenizer.ggml.pre" not in kv
    by_id = sorted(tok.get_vocab().items(), key=lambda item: item[1])
    assert kv["tokenizer.ggml.tokens"] == [t for t, _ in by_id] + [f"[PAD{len(tok)}]", f"[PAD{len(tok) + 1}]"]
    types = dict(zip(kv["tokenizer.ggml.tokens"], kv["tokenizer.ggml.token_type"], strict=True))
    assert (types["<0x41>"], types["<bos>"], types["<turn|>"]) == (gguf.TokenType.BYTE, gguf.TokenType.CONTROL,
                                                                   gguf.TokenType.CONTROL)
    assert types["<|channel>"] == gguf.TokenType.USER_DEFINED  # read as text by llama.cpp's Gemma 4 chat parser
    assert types["e"] == gguf.TokenType.NORMAL and types[f"[PAD{len(tok)}]"] == gguf.TokenType.UNUSED
    shipped = json.loads((base / "tokenizer.json").read_text())["model"]["merges"]
    assert kv["tokenizer.ggml.merges"] == [m if isinstance(m, str) else " ".join(m) for m in shipped]
    assert kv["tokenizer.ggml.add_space_prefix"] is False and kv["tokenizer.ggml.add_bos_token"] is True
    assert kv["tokenizer.ggml.bos_token_id"] == tok.bos_token_id


def test_modelfile_keeps_the_templates_default_system_prompt(models):
    from transformers import AutoTokenizer

    from rocktune.export.ollama import modelfile

    tok = AutoTokenizer.from_pretrained(models["qwen2"])
    tok.chat_template = ("{% if messages[0]['role'] != 'system' %}<|im_start|>system\nYou are Tiny.<|im_end|>\n"
                         "{% endif %}" + tok.chat_template)
    text, notes = modelfile("model.gguf", "chat", tok, None)
    assert 'SYSTEM "You are Tiny."' in text and not notes
    tok.chat_template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}{% endfor %}"
    text, notes = modelfile("model.gguf", "chat", tok, None)
    assert "TEMPLATE" not in text and "not one rocktune translates" in notes[0]
