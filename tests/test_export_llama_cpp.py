"""The real consumer: llama.cpp (through llama-cpp-python, `make llama-cpp`) loads our GGUF files, tokenises like
transformers and continues a prompt greedily with the same tokens as the transformers / PEFT model."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rocktune.cli import main
from tests.export_fixtures import build_model, make_run

llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (make llama-cpp builds it)")
pytestmark = pytest.mark.llama_cpp
TEXTS = ["upper abcd = Hello world 12345!", "  indented\n\ttab café 東京 (a+b)*c", "It's 2024, isn't it?"]


@pytest.fixture(autouse=True)
def plain_cpu_buffers(monkeypatch):
    use_plain_cpu_buffers(monkeypatch)


def use_plain_cpu_buffers(monkeypatch) -> None:
    """llama.cpp's repacked CPU buffers (AMX here) crash on tiny quantised models in llama-cpp-python 0.3.36, also
    on files llama.cpp quantised itself; the plain CPU path runs the same graph, so load with that."""
    low = llama_cpp.llama_cpp
    default = low.llama_model_default_params

    def params():
        p = default()
        p.use_extra_bufts = False
        return p

    monkeypatch.setattr(low, "llama_model_default_params", params)


def llama(path, lora=None):
    return llama_cpp.Llama(model_path=str(path), n_ctx=256, verbose=False, lora_path=str(lora) if lora else None,
                           logits_all=True)


def llama_greedy(llm, ids: list[int], n: int) -> list[int]:
    out = []
    for tok in llm.generate(ids, temp=0.0, top_k=1, reset=True):
        out.append(tok)
        if len(out) == n:
            break
    return out


def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    out: list[int] = []
    with torch.no_grad():
        for _ in range(n):
            out.append(int(model(torch.tensor([ids + out])).logits[0, -1].argmax()))
    return out


def check_tokenizer(llm, tok) -> None:
    for text in TEXTS:
        want = tok(text)["input_ids"]
        add_bos = bool(tok.bos_token_id is not None and want[:1] == [tok.bos_token_id])
        assert llm.tokenize(text.encode(), add_bos=add_bos, special=False) == want, text


@pytest.mark.parametrize("arch,tied", [("qwen2", True), ("llama", False), ("llama", True), ("qwen3", True)])
def test_llama_cpp_greedy_equals_transformers(tmp_path, arch, tied):
    from transformers import AutoTokenizer

    base = build_model(tmp_path / "base", arch, tied=tied)
    model = make_run(tmp_path / "run", base, "all-linear")
    tok = AutoTokenizer.from_pretrained(base)
    ids = tok(TEXTS[0])["input_ids"]
    want = hf_greedy(model, ids, 16)
    for quant in ("f32", "f16"):
        assert main(["export", str(tmp_path / "run"), "--to", "gguf", "--quant", quant]) == 0
        llm = llama(tmp_path / "run" / "export" / f"model-{quant}.gguf")
        check_tokenizer(llm, tok)
        assert llama_greedy(llm, ids, 16) == want, quant


def test_llama_cpp_base_plus_gguf_lora_equals_peft(tmp_path):
    from transformers import AutoTokenizer

    for arch in ("qwen2", "llama"):
        base = build_model(tmp_path / arch, arch, tied=arch == "qwen2")
        model = make_run(tmp_path / f"run-{arch}", base, "all-linear", use_rslora=arch == "llama")
        assert main(["export", str(tmp_path / f"run-{arch}"), "--to", "gguf-lora", "--with-base"]) == 0
        out = tmp_path / f"run-{arch}" / "export"
        ids = AutoTokenizer.from_pretrained(base)(TEXTS[0])["input_ids"]
        tuned = hf_greedy(model, ids, 16)
        with model.disable_adapter():
            plain = hf_greedy(model, ids, 16)
        assert tuned != plain
        assert llama_greedy(llama(out / "base-f16.gguf", lora=out / "adapter-f32.gguf"), ids, 16) == tuned, arch
        assert llama_greedy(llama(out / "base-f16.gguf"), ids, 16) == plain, arch


def test_llama_cpp_demo_tokenizer_without_merges(tmp_path):
    """rocktune's demo tokenizer has no merges at all; llama.cpp still needs the key and must not merge."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rocktune.demo.tiny import build_tiny_model

    base = build_tiny_model(tmp_path / "demo", seed=0, hidden=64, layers=2, heads=4, kv_heads=2)
    assert main(["export", str(base), "--to", "gguf", "--quant", "f32", "--out", str(tmp_path / "d.gguf")]) == 0
    tok = AutoTokenizer.from_pretrained(base)
    llm = llama(tmp_path / "d.gguf")
    check_tokenizer(llm, tok)
    ids = tok("reverse abcd =")["input_ids"]
    assert llama_greedy(llm, ids, 8) == hf_greedy(AutoModelForCausalLM.from_pretrained(base), ids, 8)


def test_llama_cpp_llama3_rope_scaling(tmp_path):
    from transformers import AutoTokenizer

    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64}
    base = build_model(tmp_path / "base", "llama", tied=False, rope=rope)
    model = make_run(tmp_path / "run", base, ["q_proj", "o_proj"])
    assert main(["export", str(tmp_path / "run"), "--to", "gguf", "--quant", "f32"]) == 0
    ids = AutoTokenizer.from_pretrained(base)(" ".join(TEXTS) * 2)["input_ids"]
    llm = llama(tmp_path / "run" / "export" / "model-f32.gguf")
    llm.eval(ids)
    with torch.no_grad():
        want = model(torch.tensor([ids])).logits[0].numpy()
    got = np.asarray(llm.scores[: len(ids)])
    assert np.abs(got - want).max() < 0.02  # llama.cpp keeps its KV cache in f16
    assert llama_greedy(llm, ids, 12) == hf_greedy(model, ids, 12)


def test_llama_cpp_quantised_files(tmp_path):
    """q8_0 (gguf-py) stays within quantisation error of the fp32 logits; q4_k_m (llama.cpp's quantiser) loads."""
    from transformers import AutoTokenizer

    base = build_model(tmp_path / "base", "qwen2", hidden=256)
    model = make_run(tmp_path / "run", base, "all-linear")
    ids = AutoTokenizer.from_pretrained(base)(TEXTS[0])["input_ids"]
    with torch.no_grad():
        want = model(torch.tensor([ids])).logits[0].numpy()
    for quant, bound in (("q8_0", 0.1), ("q4_k_m", 1.0)):
        assert main(["export", str(tmp_path / "run"), "--to", "gguf", "--quant", quant]) == 0
        llm = llama(tmp_path / "run" / "export" / f"model-{quant}.gguf")
        llm.eval(ids)
        got = np.asarray(llm.scores[: len(ids)])
        assert np.abs(got - want).max() < bound * np.abs(want).max(), quant
        assert (got.argmax(-1) == want.argmax(-1)).mean() >= (0.9 if quant == "q8_0" else 0.5), quant


@pytest.mark.parametrize("space_prefix", [True, False])
def test_llama_cpp_sentencepiece_tokenizer(tmp_path, space_prefix):
    """Llama 2 / Mistral-style vocabularies go through tokenizer.model (scores, byte tokens) as llama.cpp's 'llama';
    one that puts no space before the text (Gemma's) is tokenised without one too."""
    spm = pytest.importorskip("sentencepiece", reason="sentencepiece reads tokenizer.model (rocktune[gguf])")
    from transformers import AutoTokenizer

    from tests.export_fixtures import build_spm_llama

    base = build_spm_llama(tmp_path / "base", space_prefix=space_prefix)
    model = make_run(tmp_path / "run", base, "all-linear")
    assert main(["export", str(tmp_path / "run"), "--to", "gguf", "--quant", "f32"]) == 0
    llm = llama(tmp_path / "run" / "export" / "model-f32.gguf")
    sp = spm.SentencePieceProcessor(model_file=str(base / "tokenizer.model"))
    for text in TEXTS:  # SentencePiece itself is the reference (transformers 5 differs on leading double spaces)
        assert llm.tokenize(text.encode(), add_bos=False, special=False) == sp.encode(text), text
    ids = [1] + sp.encode(TEXTS[0])
    if space_prefix:  # transformers 5's LlamaTokenizer puts a space first whatever tokenizer.model says
        assert AutoTokenizer.from_pretrained(base)(TEXTS[0])["input_ids"] == ids
    assert llama_greedy(llm, ids, 16) == hf_greedy(model, ids, 16)
