"""The real consumer: llama.cpp (through llama-cpp-python, `make llama-cpp`) loads our GGUF files, tokenises like
transformers and continues a prompt greedily with the same tokens as the transformers / PEFT model."""

from __future__ import annotations

from pathlib import Path

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


def printed_llama_cli(stdout: str) -> tuple[Path, Path | None]:
    """The export's ``then: llama-cli ...`` line as a shell splits it: (-m, --lora); any other flag must only name
    the input (-p)."""
    import shlex

    lines = [line for line in stdout.splitlines() if line.startswith("note: then: llama-cli ")]
    assert len(lines) == 1, stdout
    argv = shlex.split(lines[0].removeprefix("note: then: ").split(" (or llama-server")[0])[1:]
    flags = dict(zip(argv[::2], argv[1::2]))
    assert len(argv) % 2 == 0 and set(flags) <= {"-m", "--lora", "-p"}, argv
    return Path(flags["-m"]), Path(flags["--lora"]) if "--lora" in flags else None


@pytest.mark.parametrize("to", [["gguf"], ["gguf-lora", "--with-base"]])
def test_llama_cpp_runs_the_printed_command_as_the_trained_model(tmp_path, capsys, to):
    """What the export prints to run next, parsed and given to llama.cpp, continues as the trained model (the merged
    file, or the base with the LoRA), not as the base."""
    from transformers import AutoTokenizer

    base = build_model(tmp_path / "base", "qwen2", tied=True)
    model = make_run(tmp_path / "run", base, "all-linear")
    ids = AutoTokenizer.from_pretrained(base)(TEXTS[0])["input_ids"]
    tuned = hf_greedy(model, ids, 16)
    with model.disable_adapter():
        assert hf_greedy(model, ids, 16) != tuned
    capsys.readouterr()
    assert main(["export", str(tmp_path / "run"), "--to", *to]) == 0
    path, lora = printed_llama_cli(capsys.readouterr().out)
    out = tmp_path / "run" / "export"
    assert (path, lora) == ((out / "model-f16.gguf", None) if to == ["gguf"] else
                            (out / "base-f16.gguf", out / "adapter-f32.gguf"))
    assert llama_greedy(llama(path, lora=lora), ids, 16) == tuned


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


def _llama_logits(path, ids: list[int]) -> np.ndarray:
    llm = llama(path)
    llm.eval(ids)
    return np.asarray(llm.scores[: len(ids)]).copy()


def test_llama_cpp_quantised_files_stay_near_the_f16_file(tmp_path):
    """q8_0 (gguf-py's quantiser) and q4_k_m (llama.cpp's) against the f16 export run by llama.cpp itself: the
    quantisation error in units of the f16 logits' spread, and well below what the fine-tune changed. Measured here
    (tiny Qwen2, hidden 256): rms error 0.036 (q8_0) and 0.29 (q4_k_m) of the f16 logits' standard deviation; the
    LoRA moved the logits by 1.20 on average, q4_k_m's mean error was 0.36. A file with a wrong layout or a lost
    merge is at 1 and above on the first measure."""
    from transformers import AutoTokenizer

    base = build_model(tmp_path / "base", "qwen2", hidden=256)
    model = make_run(tmp_path / "run", base, "all-linear")
    ids = AutoTokenizer.from_pretrained(base)(TEXTS[0])["input_ids"]
    with torch.no_grad():
        tuned = model(torch.tensor([ids])).logits[0].numpy()
        with model.disable_adapter():
            plain = model(torch.tensor([ids])).logits[0].numpy()
    lora_effect = float(np.abs(tuned - plain).mean())
    got = {}
    for quant in ("f16", "q8_0", "q4_k_m"):
        assert main(["export", str(tmp_path / "run"), "--to", "gguf", "--quant", quant]) == 0
        got[quant] = _llama_logits(tmp_path / "run" / "export" / f"model-{quant}.gguf", ids)
    ref = got["f16"]
    assert np.abs(ref - tuned).max() < 0.05  # the reference itself: f16 weights and llama.cpp's f16 KV cache
    for quant, rms_bound, top1 in (("q8_0", 0.06, 0.9), ("q4_k_m", 0.4, 0.5)):
        err = got[quant] - ref
        assert float(np.sqrt((err**2).mean())) < rms_bound * float(ref.std()), quant
        assert float(np.abs(err).mean()) < 0.5 * lora_effect, quant  # the fine-tune survives quantisation
        assert (got[quant].argmax(-1) == ref.argmax(-1)).mean() >= top1, quant


LOAD_WITH_DEFAULTS = """
import sys, llama_cpp
llm = llama_cpp.Llama(model_path=sys.argv[1], n_ctx=256, verbose=False)
out = []
for tok in llm.generate([int(x) for x in sys.argv[2].split(",")], temp=0.0, top_k=1, reset=True):
    out.append(tok)
    if len(out) == 8:
        break
print(",".join(map(str, out)))
"""


@pytest.mark.parametrize("quant", ["f16", "q4_k_m"])
def test_llama_cpp_with_its_default_loader_settings(tmp_path, quant):
    """Every other test here turns llama.cpp's extra CPU buffer types off. With its defaults, in a child process (a
    crash must not take pytest down): the same greedy tokens, or, where the repacked CPU path dies on this CPU, an
    expected failure that says so — docs/export.md tells users the setting that avoids it."""
    import signal
    import subprocess
    import sys
    from pathlib import Path

    from transformers import AutoTokenizer

    base = build_model(tmp_path / "base", "qwen2", hidden=256)
    model = make_run(tmp_path / "run", base, "all-linear")
    ids = AutoTokenizer.from_pretrained(base)(TEXTS[0])["input_ids"]
    assert main(["export", str(tmp_path / "run"), "--to", "gguf", "--quant", quant]) == 0
    path = tmp_path / "run" / "export" / f"model-{quant}.gguf"
    proc = subprocess.run([sys.executable, "-c", LOAD_WITH_DEFAULTS, str(path), ",".join(map(str, ids))],
                          capture_output=True, text=True, timeout=300)
    if proc.returncode == 0:
        assert [int(x) for x in proc.stdout.strip().split(",")] == llama_greedy(llama(path), ids, 8)
        if quant == "f16":
            assert llama_greedy(llama(path), ids, 8) == hf_greedy(model, ids, 8)
        return
    doc = (Path(__file__).parents[1] / "docs" / "export.md").read_text(encoding="utf-8")
    assert quant != "f16", proc.stderr[-2000:]  # unquantised files are never repacked
    assert proc.returncode in (-signal.SIGILL, -signal.SIGSEGV), (proc.returncode, proc.stderr[-2000:])
    assert "use_extra_bufts" in doc and "--no-repack" in doc
    pytest.xfail(f"llama.cpp's default loader dies on this CPU with {signal.Signals(-proc.returncode).name} on a "
                 f"{quant} file (its repacked CPU buffers); docs/export.md says how to turn them off")


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
