"""Bad input to export/generate: one clear paragraph, exit status 2, nothing half-written left behind."""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rocktune.cli import main
from tests.export_fixtures import build_model, make_run


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return build_model(tmp_path_factory.mktemp("err") / "base", "qwen2")


@pytest.fixture
def run(base, tmp_path):
    make_run(tmp_path / "run", base, ["q_proj", "v_proj"])
    return tmp_path / "run"


def fails(capsys, *argv) -> str:
    assert main(list(argv)) == 2
    return " ".join(capsys.readouterr().err.split())


def test_run_without_adapter(tmp_path, capsys):
    (tmp_path / "config.yaml").write_text("model: {}\n")
    assert "holds no adapter" in fails(capsys, "export", str(tmp_path), "--to", "merged")
    assert "does not exist" in fails(capsys, "export", str(tmp_path / "nope"), "--to", "gguf")


def test_missing_and_mismatched_base(base, run, tmp_path, capsys):
    err = fails(capsys, "export", str(run), "--to", "merged", "--base", str(tmp_path / "gone"))
    assert "does not exist" in err and "--base" in err
    other = build_model(tmp_path / "wide", "qwen2", hidden=128)
    err = fails(capsys, "export", str(run), "--to", "merged", "--base", str(other))
    assert "does not fit" in err and "q_proj" in err and "Linear 128->128" in err
    # the run's recorded base moved away: the message says to pass --base
    moved = tmp_path / "moved"
    shutil.copytree(run.parent / "run", moved)
    cfg = moved / "adapter" / "rocktune_config.yaml"
    cfg.write_text(cfg.read_text().replace(str(base), str(tmp_path / "elsewhere")))
    assert "pass --base" in fails(capsys, "export", str(moved), "--to", "gguf")
    assert not (run / "export").exists()


def test_existing_output_refused_unless_overwrite(run, capsys):
    out = run / "export" / "model-f16.gguf"
    out.parent.mkdir()
    out.write_bytes(b"keep me")
    assert "already exists" in fails(capsys, "export", str(run), "--to", "gguf")
    assert out.read_bytes() == b"keep me"
    assert main(["export", str(run), "--to", "gguf", "--overwrite"]) == 0
    assert out.read_bytes()[:4] == b"GGUF"


def test_unsupported_architecture_and_quant(run, tmp_path, capsys):
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = tmp_path / "gpt2"
    GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=300)).save_pretrained(gpt2)
    assert "does not support the gpt2 architecture" in fails(capsys, "export", str(gpt2), "--to", "gguf")
    assert "q3_x is not supported" in fails(capsys, "export", str(run), "--to", "gguf", "--quant", "q3_x")
    err = fails(capsys, "export", str(run), "--to", "gguf", "--quant", "q4_k_m")
    assert "blocks of 256" in err and "(64)" in err and "q8_0" in err
    assert "f32 (default) or f16" in fails(capsys, "export", str(run), "--to", "gguf-lora", "--quant", "q8_0")
    assert not (run / "export").exists() or not any((run / "export").iterdir())


def test_gguf_lora_refuses_what_it_cannot_carry(base, tmp_path, capsys):
    make_run(tmp_path / "head", base, ["q_proj"], modules_to_save=["lm_head"])
    assert "full trained copies" in fails(capsys, "export", str(tmp_path / "head"), "--to", "gguf-lora")
    make_run(tmp_path / "dora", base, ["q_proj"], use_dora=True)
    assert "DoRA" in fails(capsys, "export", str(tmp_path / "dora"), "--to", "gguf-lora")


@pytest.mark.parametrize("to", ["gguf", "gguf-short", "gguf-lora-short", "ollama-short", "merged",
                                "merged-safetensors"])
def test_full_disk_leaves_nothing(run, monkeypatch, capsys, to):
    def no_space(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    def short_write(*args, **kwargs):  # what numpy's tofile, gguf-py's writer, raises on a full disk: no errno
        raise OSError("49152 requested and 36624 written")

    if to.startswith(("gguf", "ollama")):
        import gguf

        monkeypatch.setattr(gguf.GGUFWriter, "write_tensors_to_file", short_write if "short" in to else no_space)
        to = to.removesuffix("-short")
    elif to == "merged":
        from transformers import PreTrainedTokenizerBase

        monkeypatch.setattr(PreTrainedTokenizerBase, "save_pretrained", no_space)
    else:  # safetensors raises its own error type, with the OS message in it
        import transformers.modeling_utils
        from safetensors import SafetensorError

        def torn(*args, **kwargs):
            raise SafetensorError(
                "Error while serializing: IoError(Os { code: 28, message: \"No space left on device\" })")

        monkeypatch.setattr(transformers.modeling_utils, "safe_save_file", torn)
        to = "merged"
    err = fails(capsys, "export", str(run), "--to", to)
    assert f"the disk holding {run / 'export'} is full (" in err and "MiB free when the write failed)" in err
    assert "requested" not in err and "could not write" not in err
    assert [p.name for p in (run / "export").iterdir()] == []


def test_generate_input_errors(run, tmp_path, capsys):
    assert "give one of" in fails(capsys, "generate", str(run), "--chat", "--prompt", "hi")
    bad = tmp_path / "p.jsonl"
    bad.write_text(json.dumps({"question": "hi"}) + "\n")
    assert "p.jsonl:1" in fails(capsys, "generate", str(run), "--file", str(bad))


def test_overwrite_never_replaces_an_unrelated_directory(run, tmp_path, capsys):
    mine = tmp_path / "my-models"
    mine.mkdir()
    (mine / "notes.txt").write_text("precious")
    assert "not an earlier export" in fails(capsys, "export", str(run), "--to", "merged", "--out", str(mine),
                                            "--overwrite")
    assert "is a directory" in fails(capsys, "export", str(run), "--to", "gguf", "--out", str(mine), "--overwrite")
    assert (mine / "notes.txt").read_text() == "precious"
    # an earlier export is replaced; the adapter directory given directly exports beside it, not into it
    assert main(["export", str(run / "adapter"), "--to", "merged"]) == 0
    assert main(["export", str(run), "--to", "merged", "--overwrite"]) == 0
    assert (run / "export" / "merged" / "config.json").is_file() and not (run / "adapter" / "export").exists()


# An export killed while it writes the GGUF: write_model_gguf is replaced by a stall that reports where the tokenizer
# was staged, so the parent's SIGKILL lands at a known point, after the staging and before any output.
KILLED_EXPORT = """
import sys, time
from pathlib import Path
from rocktune.cli import main
from rocktune.export import gguf_model

def stalled(tensors, cfg, arch, tokenizer_dir, *rest):
    Path(sys.argv[2]).write_text(str(tokenizer_dir))
    time.sleep(600)

gguf_model.write_model_gguf = stalled
main(["export", sys.argv[1], "--to", "gguf"])
"""


@pytest.mark.skipif(sys.platform == "win32", reason="SIGKILL")
def test_killed_gguf_export_leaves_nothing_in_the_system_temp_folder(run, tmp_path, capsys, monkeypatch):
    system_tmp, staged_at = tmp_path / "system-tmp", tmp_path / "staged-at"
    system_tmp.mkdir()
    env = dict(os.environ, TMPDIR=str(system_tmp), TEMP=str(system_tmp), TMP=str(system_tmp))
    proc = subprocess.Popen([sys.executable, "-c", KILLED_EXPORT, str(run), str(staged_at)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 300
        while not staged_at.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert staged_at.exists(), proc.stderr.read().decode()[-2000:] if proc.poll() is not None else "timed out"
    finally:
        proc.kill()
        proc.wait()
        proc.stderr.close()
    staged = Path(staged_at.read_text())
    assert staged == run / "export" / ".model-f16.gguf.scratch" and (staged / "tokenizer.json").is_file()
    # the bug was a tmpXXXX tokenizer directory here; what SIGKILL can leave is only the killed process's private
    # folder (rocktune/tempdir.py), which the next export or generate sweeps
    left = list(system_tmp.iterdir())
    assert [p.name.startswith(f"rocktune-tmp-{proc.pid}-") for p in left] == [True] * len(left), left
    assert not [p for p in system_tmp.rglob("tokenizer*")]
    assert [p.name for p in (run / "export").iterdir()] == [".model-f16.gguf.scratch"]  # dot-named, beside its output
    # the next export to the same target clears what the killed one left, beside the output and in the temp folder
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(system_tmp))
    assert main(["export", str(run), "--to", "gguf"]) == 0
    capsys.readouterr()
    assert [p.name for p in (run / "export").iterdir()] == ["model-f16.gguf"]
    assert list(system_tmp.iterdir()) == []
