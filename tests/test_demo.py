"""The embedded default: `rocktune demo` must show real learning, offline, on CPU."""

import contextlib
import io
import json
import os
import subprocess
import sys

import pytest

from rocktune.cli import main


# The README's figures as bounds every CPU meets with margin. Measured with benchmarks/cpu_variants.py demo over the
# instruction sets torch's CPU kernels can be told to use and 1, 2 and 4 threads (docs/benchmarks.md "The demo on
# every CPU"): eval loss before SPREAD_BEFORE, after SPREAD_AFTER, held-out exact match 100% in every variant.
LOSS_BEFORE = (5.99, 0.05)  # one forward of the random-init model: rounding moves it in the 4th digit
MAX_LOSS_AFTER = 0.10
MIN_EXACT = 0.95  # per skill as well: a skill that stops generalising fails by name
# A second instruction set and thread count in CI: AVX2 kernels of ATen, oneDNN and MKL (what a CPU without AVX-512
# runs; CI's machines have AVX-512, some AMX too), one thread. ATen's scalar "default" kernels are measured by
# benchmarks/cpu_variants.py but train about 5x slower: too slow for every CI run.
AVX2_KERNELS = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2",
                "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """One `rocktune demo --json` run (about 30 s) shared by the tests of what it produced."""
    out = tmp_path_factory.mktemp("demo") / "demo"
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert main(["demo", "--out", str(out), "--json"]) == 0
    return out, json.loads(printed.getvalue().strip().splitlines()[-1])


def assert_readme_figures(fig: dict) -> None:
    assert set(fig) >= {"eval_loss_before", "eval_loss_after", "exact_match", "exact_match_by_skill", "run_dir"}
    assert fig["eval_loss_before"] == pytest.approx(LOSS_BEFORE[0], abs=LOSS_BEFORE[1])
    assert fig["eval_loss_after"] <= MAX_LOSS_AFTER, fig
    assert fig["exact_match"] >= MIN_EXACT, fig
    assert set(fig["exact_match_by_skill"]) == {"upper", "shift", "digits"}
    assert min(fig["exact_match_by_skill"].values()) >= MIN_EXACT, fig


@pytest.mark.slow
@pytest.mark.torches
def test_demo_learns_and_prints_json(demo):
    out, fig = demo
    assert_readme_figures(fig)
    assert (out / "run" / "adapter" / "adapter_model.safetensors").is_file()


@pytest.mark.long
@pytest.mark.slow
def test_demo_figures_hold_under_avx2_kernels_and_one_thread(tmp_path):
    """Issue 35: the same bounds with other matmul and vector kernels (and another thread count) than this CPU picks
    by itself, as another CI machine would have them; read at start-up, so in a child process."""
    proc = subprocess.run([sys.executable, "-m", "rocktune", "demo", "--json", "--out", str(tmp_path / "demo")],
                          env={**os.environ, **AVX2_KERNELS}, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_readme_figures(json.loads(proc.stdout.strip().splitlines()[-1]))


@pytest.mark.slow
@pytest.mark.llama_cpp
def test_llama_cpp_answers_the_demos_held_out_prompts_as_transformers_does(demo, monkeypatch):
    """README/docs/export.md: the demo's f16 file and its base GGUF + GGUF LoRA give the transformers PeftModel's
    greedy tokens on all 100 held-out prompts (6 tokens each) in llama.cpp; the q8_0 file on at least 95 (100 on the
    AMD EPYC here; 98 on the earlier demo)."""
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (make llama-cpp builds it)")
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tests.test_export_llama_cpp import hf_greedy, llama, llama_greedy, use_plain_cpu_buffers

    use_plain_cpu_buffers(monkeypatch)  # docs/export.md: the repacked CPU path dies on quantised files on some CPUs
    out, _ = demo
    run, base = out / "run", out / "base_model"
    for args in (["--to", "gguf"], ["--to", "gguf", "--quant", "q8_0"], ["--to", "gguf-lora", "--with-base"]):
        assert main(["export", str(run), *args]) == 0
    tok = AutoTokenizer.from_pretrained(base)
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), run / "adapter")
    model.eval()
    rows = (out / "data" / "eval.jsonl").read_text().splitlines()
    prompts = [tok(json.loads(x)["prompt"])["input_ids"] for x in rows]
    assert len(prompts) == 100
    want = [hf_greedy(model, ids, 6) for ids in prompts]
    export = run / "export"
    for name, lora, need in (("model-f16.gguf", None, 100), ("model-q8_0.gguf", None, 95),
                             ("base-f16.gguf", "adapter-f32.gguf", 100)):
        llm = llama(export / name, lora=export / lora if lora else None)
        same = sum(llama_greedy(llm, ids, 6) == w for ids, w in zip(prompts, want))
        assert same >= need, (name, same)


def test_demo_tokenizer_roundtrips_through_autotokenizer(tiny_model_dir, tokenizer):
    from rocktune.demo.tiny import build_tokenizer

    text = "reverse abc = cba<|im_end|>\nupper é"
    assert tokenizer(text)["input_ids"] == build_tokenizer()(text)["input_ids"]
    assert tokenizer.decode(tokenizer(text)["input_ids"]) == text


def test_demo_table_shows_exact_match_per_skill(capsys):
    """`make demo` prints the table (not JSON): each skill's held-out rate is a row, so a failing skill shows."""
    from rocktune.demo.run import _print_summary, by_skill

    samples = [{"prompt": "upper abcd =", "expected": " ABCD", "output": " ABCD"},
               {"prompt": "digits abcd =", "expected": " 0123", "output": " 0123"},
               {"prompt": "digits bcde =", "expected": " 1234", "output": " 1243"}]
    fig = {"eval_loss_before": 5.99, "eval_loss_after": 0.01, "exact_match": 2 / 3, "train_seconds": 1.0, "steps": 2,
           "exact_match_by_skill": by_skill(samples), "run_dir": "r", "report": None}
    assert fig["exact_match_by_skill"] == {"digits": 0.5, "upper": 1.0}
    _print_summary(fig, samples)
    out = capsys.readouterr().out
    assert "digits" in out and "50%" in out and "100%" in out and "67%" in out


@pytest.mark.slow  # three 40-step runs of the demo: about 30 s on 2 cores
def test_the_demo_learns_alike_with_every_optimizer(tmp_path):
    """Issue 43: fused AdamW (the GPU's default) once left the fused LoRA path with the first step's adapter: eval
    loss 5.99 -> 4.06 -> 4.14 where foreach gave 5.99 -> 3.02 -> 2.22. Every optimizer the config accepts must learn
    the demo alike: eval losses at steps 20 and 40 within 3% of torch's single-tensor AdamW."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("optimizer_parity", Path(__file__).parents[1] / "benchmarks" /
                                                  "optimizer_parity.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    from tests.test_training_matrix import OPTIMIZERS

    assert set(bench.optimizers()) == set(OPTIMIZERS)
    curves = bench.curves(tmp_path, 40)
    ref = curves["adamw_torch"]
    assert ref[0] == pytest.approx(LOSS_BEFORE[0], abs=LOSS_BEFORE[1]) and ref[-1] < 2.6, curves
    for opt, curve in curves.items():
        assert curve == pytest.approx(ref, rel=0.03), (opt, curves)
