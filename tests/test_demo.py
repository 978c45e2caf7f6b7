"""The embedded default: `rocktune demo` must show real learning, offline, on CPU."""

import contextlib
import io
import json

import pytest

from rocktune.cli import main


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """One `rocktune demo --json` run (about 30 s) shared by the tests of what it produced."""
    out = tmp_path_factory.mktemp("demo") / "demo"
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert main(["demo", "--out", str(out), "--json"]) == 0
    return out, json.loads(printed.getvalue().strip().splitlines()[-1])


@pytest.mark.slow
def test_demo_learns_and_prints_json(demo):
    out, fig = demo
    assert set(fig) >= {"eval_loss_before", "eval_loss_after", "exact_match", "run_dir"}
    # The README's figures (eval loss 6.04 -> 0.31, 75% exact match), with a margin for BLAS thread-count noise:
    # a change that makes the demo learn less fails here before the README's claim goes stale.
    assert fig["eval_loss_before"] == pytest.approx(6.04, abs=0.05)
    assert fig["eval_loss_after"] <= 0.31 + 0.05
    assert fig["exact_match"] >= 0.70
    assert (out / "run" / "adapter" / "adapter_model.safetensors").is_file()


@pytest.mark.slow
@pytest.mark.llama_cpp
def test_llama_cpp_answers_the_demos_held_out_prompts_as_transformers_does(demo, monkeypatch):
    """README/docs/export.md: the demo's f16 file and its base GGUF + GGUF LoRA give the transformers PeftModel's
    greedy tokens on all 100 held-out prompts (6 tokens each) in llama.cpp; the q8_0 file on at least 95 (98 here)."""
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (make llama-cpp builds it)")
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out, _ = demo
    run, base = out / "run", out / "base_model"
    default = llama_cpp.llama_cpp.llama_model_default_params

    def no_repack():  # docs/export.md: llama.cpp's repacked CPU path dies on quantised files on some CPUs
        p = default()
        p.use_extra_bufts = False
        return p

    monkeypatch.setattr(llama_cpp.llama_cpp, "llama_model_default_params", no_repack)
    for args in (["--to", "gguf"], ["--to", "gguf", "--quant", "q8_0"], ["--to", "gguf-lora", "--with-base"]):
        assert main(["export", str(run), *args]) == 0
    tok = AutoTokenizer.from_pretrained(base)
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), run / "adapter")
    model.eval()
    prompts = [json.loads(x)["prompt"] for x in (out / "data" / "eval.jsonl").read_text().splitlines()]
    assert len(prompts) == 100

    def hf(ids):
        got: list[int] = []
        with torch.no_grad():
            for _ in range(6):
                got.append(int(model(torch.tensor([ids + got])).logits[0, -1].argmax()))
        return got

    want = [hf(tok(p)["input_ids"]) for p in prompts]
    export = run / "export"
    for name, lora, need in (("model-f16.gguf", None, 100), ("model-q8_0.gguf", None, 95),
                             ("base-f16.gguf", "adapter-f32.gguf", 100)):
        llm = llama_cpp.Llama(model_path=str(export / name), n_ctx=128, verbose=False,
                              lora_path=str(export / lora) if lora else None)
        got = []
        for p in prompts:
            toks: list[int] = []
            for t in llm.generate(tok(p)["input_ids"], temp=0.0, top_k=1, reset=True):
                toks.append(t)
                if len(toks) == 6:
                    break
            got.append(toks)
        same = sum(g == w for g, w in zip(got, want))
        assert same >= need, (name, same)


def test_demo_tokenizer_roundtrips_through_autotokenizer(tiny_model_dir, tokenizer):
    from rocktune.demo.tiny import build_tokenizer

    text = "reverse abc = cba<|im_end|>\nupper é"
    assert tokenizer(text)["input_ids"] == build_tokenizer()(text)["input_ids"]
    assert tokenizer.decode(tokenizer(text)["input_ids"]) == text
