"""One merged model per run directory (issue 55, point 8): ``--to ollama`` after ``--to gguf`` (and the reverse, and
the same target again) reuses the GGUF written from the same adapter, base and settings, without merging and without
a second copy on the disk; a changed adapter merges again, and a GGUF a link shares is never rewritten in place."""

from __future__ import annotations

import shutil

import pytest

from rocktune.cli import main
from rocktune.export import merge, reuse
from tests.export_fixtures import build_model, make_run


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return build_model(tmp_path_factory.mktemp("reuse") / "base", "qwen2")


@pytest.fixture
def merges(monkeypatch):
    calls: list[str] = []
    real = merge.merged_model

    def counted(src, dtype):
        calls.append(str(src.adapter))
        return real(src, dtype)

    monkeypatch.setattr(merge, "merged_model", counted)
    return calls


def export(run, *args) -> int:
    return main(["export", str(run), *args])


def test_ollama_after_gguf_reuses_the_file_and_writes_what_a_fresh_export_writes(base, tmp_path, merges, capsys):
    run = tmp_path / "demo" / "run"
    make_run(run, base, "all-linear", data_format="messages")
    fresh = tmp_path / "elsewhere" / "demo" / "run"  # the same run (and name) elsewhere: nothing there to reuse
    shutil.copytree(run, fresh)

    assert export(run, "--to", "gguf") == 0 and len(merges) == 1
    gguf = run / "export" / "model-f16.gguf"
    assert reuse.recorded(gguf) == reuse.digest(reuse_source(run), {"gguf": "f16", "name": run.parent.name})
    capsys.readouterr()
    assert export(run, "--to", "ollama") == 0
    out = capsys.readouterr().out
    assert len(merges) == 1, "the ollama export merged again"
    bundle = run / "export" / "ollama"
    assert (bundle / "model.gguf").stat().st_ino == gguf.stat().st_ino  # one copy on the disk
    assert f"reused {gguf} (same adapter, base and settings: no merge); hard-linked" in out

    assert export(fresh, "--to", "ollama") == 0 and len(merges) == 2
    made = fresh / "export" / "ollama"
    assert (bundle / "Modelfile").read_text() == (made / "Modelfile").read_text()
    assert (bundle / "model.gguf").read_bytes() == (made / "model.gguf").read_bytes()


def test_the_same_export_again_is_kept_and_a_changed_adapter_merges_again(base, tmp_path, merges, capsys):
    run = tmp_path / "run"
    make_run(run, base, ["q_proj", "v_proj"], data_format="messages")
    bundle = run / "export" / "ollama"
    assert export(run, "--to", "ollama") == 0 and len(merges) == 1
    first = (bundle / "model.gguf").stat()
    capsys.readouterr()

    assert export(run, "--to", "ollama") == 0 and len(merges) == 1  # no --overwrite needed: nothing changes
    assert f"kept (up to date) {bundle}" in capsys.readouterr().out
    again = (bundle / "model.gguf").stat()
    assert (again.st_ino, again.st_mtime_ns) == (first.st_ino, first.st_mtime_ns)
    assert export(run, "--to", "gguf") == 0 and len(merges) == 1  # the reverse direction reuses too
    gguf = run / "export" / "model-f16.gguf"
    assert gguf.stat().st_ino == first.st_ino

    make_run(run, base, ["q_proj", "v_proj"], data_format="messages", seed=7)  # trained again: another adapter
    capsys.readouterr()
    assert export(run, "--to", "ollama") == 2  # not up to date, and an existing output needs --overwrite
    assert "already exists; pass --overwrite" in capsys.readouterr().err
    assert export(run, "--to", "ollama", "--overwrite") == 0 and len(merges) == 2
    new = bundle / "model.gguf"
    assert new.stat().st_ino != first.st_ino
    assert reuse.recorded(new) != reuse.recorded(gguf)  # the old GGUF kept its bytes: written anew, never in place
    assert export(run, "--to", "gguf", "--overwrite") == 0 and len(merges) == 2  # the new one, reused
    assert gguf.stat().st_ino == new.stat().st_ino


def test_another_quant_or_name_is_another_gguf(base, tmp_path, merges, capsys):
    run = tmp_path / "run"
    make_run(run, base, ["q_proj"])
    assert export(run, "--to", "gguf") == 0 and len(merges) == 1
    assert export(run, "--to", "gguf", "--quant", "q8_0") == 0 and len(merges) == 2
    renamed = tmp_path / "other"
    shutil.copytree(run, renamed)
    # another run name is another GGUF (its general.name): the copied f16 file is neither up to date nor reused
    capsys.readouterr()
    assert export(renamed, "--to", "gguf") == 2 and len(merges) == 2
    assert "already exists; pass --overwrite" in capsys.readouterr().err
    assert export(renamed, "--to", "gguf", "--overwrite") == 0 and len(merges) == 3


def reuse_source(run):
    from rocktune.export.source import resolve

    return resolve(str(run))


def test_gguf_after_an_fp32_merge_loads_it_instead_of_merging(base, tmp_path, merges, capsys):
    run = tmp_path / "demo" / "run"
    make_run(run, base, ["q_proj", "down_proj"])
    fresh = tmp_path / "elsewhere" / "demo" / "run"
    shutil.copytree(run, fresh)
    assert export(run, "--to", "merged", "--dtype", "fp32") == 0 and len(merges) == 1
    capsys.readouterr()
    assert export(run, "--to", "merged", "--dtype", "fp32") == 0 and len(merges) == 1
    assert f"kept (up to date) {run / 'export' / 'merged'}" in capsys.readouterr().out
    assert export(run, "--to", "gguf") == 0 and len(merges) == 1  # loaded from export/merged
    assert "(merged in fp32 from this adapter and base: no merge)" in capsys.readouterr().err
    assert export(fresh, "--to", "gguf") == 0 and len(merges) == 2
    assert (run / "export" / "model-f16.gguf").read_bytes() == (fresh / "export" / "model-f16.gguf").read_bytes()
    assert export(run, "--to", "merged", "--dtype", "bf16", "--out", str(tmp_path / "bf16")) == 0
    assert len(merges) == 3  # another dtype is another merge
