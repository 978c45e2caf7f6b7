"""The newer commands hold the same line on bad input as ``train``: one paragraph naming the thing, exit status 2,
no traceback, nothing written. One table per class of bad input (issue 27); each case asserts the exit status, a
word of the message naming the file or option, no "Traceback" and no new path."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from rocktune.cli import main
from tests.export_fixtures import build_model, make_run


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> tuple[Path, Path]:
    """A tiny base and a run trained on it, never modified: each case copies what it spoils."""
    root = tmp_path_factory.mktemp("badinput")
    base = build_model(root / "base", "qwen2")
    make_run(root / "run", base, ["q_proj", "v_proj"])
    return base, root / "run"


def tree(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")} if root.exists() else set()


def refused(capsys, argv: list[str], watch: Path) -> str:
    """Run the command in-process: exit 2, one paragraph (no traceback), nothing created under ``watch``."""
    before = tree(watch)
    assert main(argv) == 2
    captured = capsys.readouterr()
    text = captured.out + captured.err
    assert "Traceback" not in text
    assert tree(watch) == before, sorted(tree(watch) - before)
    return " ".join(text.split())


# --- 1. damaged adapter files given to export or generate -------------------------------------------------------

def _empty_weights(adapter: Path) -> str:
    (adapter / "adapter_model.safetensors").write_bytes(b"")
    return "adapter_model.safetensors"


def _truncated_weights(adapter: Path) -> str:
    f = adapter / "adapter_model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    return "adapter_model.safetensors"


def _missing_weights(adapter: Path) -> str:
    (adapter / "adapter_model.safetensors").unlink()
    return "adapter_model.safetensors"


def _empty_config(adapter: Path) -> str:
    (adapter / "adapter_config.json").write_bytes(b"")
    return "adapter_config.json"


def _config_not_json(adapter: Path) -> str:
    (adapter / "adapter_config.json").write_text("{'r': 8,")
    return "adapter_config.json"


def _config_not_object(adapter: Path) -> str:
    (adapter / "adapter_config.json").write_text("[1, 2, 3]")
    return "adapter_config.json"


def _config_bad_fields(adapter: Path) -> str:
    cfg = json.loads((adapter / "adapter_config.json").read_text())
    (adapter / "adapter_config.json").write_text(json.dumps({**cfg, "r": "eight", "target_modules": 5}))
    return "adapter_config.json"


def _wrong_shape(adapter: Path) -> str:
    from safetensors.torch import load_file, save_file

    f = adapter / "adapter_model.safetensors"
    tensors = load_file(f)
    key = next(k for k in tensors if "lora_A" in k)
    tensors[key] = tensors[key][:, :-3].contiguous()
    save_file(tensors, f)
    return "lora_A"


ADAPTER_DAMAGE = {"empty_weights": _empty_weights, "truncated_weights": _truncated_weights,
                  "missing_weights": _missing_weights, "empty_config": _empty_config,
                  "config_not_json": _config_not_json, "config_not_an_object": _config_not_object,
                  "config_with_wrong_fields": _config_bad_fields, "wrong_shape_tensor": _wrong_shape}
COMMANDS = {"export": ["export", "{run}", "--to", "merged"], "generate": ["generate", "{run}", "--prompt", "hi"]}


@pytest.mark.parametrize("command", list(COMMANDS))
@pytest.mark.parametrize("damage", list(ADAPTER_DAMAGE))
def test_damaged_adapter_is_one_paragraph_naming_the_file(pristine, tmp_path, capsys, damage, command):
    run = tmp_path / "run"
    shutil.copytree(pristine[1], run)
    named = ADAPTER_DAMAGE[damage](run / "adapter")
    err = refused(capsys, [a.format(run=run) for a in COMMANDS[command]], tmp_path)
    assert named in err


# --- 2. an export destination that cannot be created -----------------------------------------------------------

def _parent_is_a_file(tmp: Path) -> Path:
    (tmp / "blocker").write_text("x")
    return tmp / "blocker" / "merged"


def _grandparent_is_a_file(tmp: Path) -> Path:
    (tmp / "blocker").write_text("x")
    return tmp / "blocker" / "deeper" / "merged"


def _read_only_parent(tmp: Path) -> Path:
    (tmp / "ro").mkdir()
    (tmp / "ro").chmod(0o500)
    return tmp / "ro" / "merged"


DESTINATIONS = {"parent_is_a_file": _parent_is_a_file, "grandparent_is_a_file": _grandparent_is_a_file,
                "read_only_parent": _read_only_parent}


@pytest.mark.parametrize("to", ["merged", "gguf", "gguf-lora"])
@pytest.mark.parametrize("where", list(DESTINATIONS))
def test_unwritable_destination_refused_before_loading(pristine, tmp_path, capsys, monkeypatch, where, to):
    import os

    from rocktune.export import merge

    if where == "read_only_parent" and os.geteuid() == 0:
        pytest.skip("root writes into read-only folders")
    out = DESTINATIONS[where](tmp_path)
    # nothing may be loaded before the destination is known to be writable
    monkeypatch.setattr(merge, "merged_model", lambda *a, **k: pytest.fail("merged before checking --out"))
    monkeypatch.setattr(merge, "load_base_fp32", lambda *a, **k: pytest.fail("loaded before checking --out"))
    err = refused(capsys, ["export", str(pristine[1]), "--to", to, "--out", str(out)], tmp_path)
    assert str(out.parent.name) in err and "--out" in err
