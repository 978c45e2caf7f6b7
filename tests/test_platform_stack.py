"""Which libraries work beside which torch (knowledge.yaml `stacks`): the installer's constraints, and the refusal
that `doctor` and `train` give, fed made-up versions here; `make test-torches` runs this file in each torch's venv,
where the stack is real."""

from __future__ import annotations

import subprocess
import sys

import pytest

from rocktune.platform import knowledge, stack

pytestmark = pytest.mark.torches


def test_every_stack_entry_is_sourced_and_either_refuses_or_says_why_it_pins():
    entries = knowledge.load()["stacks"]
    assert entries
    for entry in entries:
        assert entry["source"] and entry["confidence"] == "documented", entry["torch"]
        assert entry.get("refuse") or not entry.get("pins") or entry.get("why"), entry["torch"]


@pytest.mark.parametrize("torch_version", ["2.4.1", "2.4.1+rocm6.0", "2.5.1+cu121", "2.6.0", "2.11.0+cu130",
                                           "2.13.0+cpu", "3.0.0"])
def test_every_torch_from_the_lowest_claimed_on_has_a_stack(torch_version):
    found = stack.stack_for(torch_version)
    assert found is not None and not found.get("refuse")


def test_an_old_torch_gets_transformers_4_as_a_constraint_and_a_new_one_nothing():
    assert "transformers>=4.56,<5" in stack.constraints("2.4.1+rocm6.0")
    assert stack.constraints("2.11.0+cu130") == []
    assert stack.constraints("2.13.0+cpu") == []


def test_transformers_5_beside_torch_2_4_is_refused_with_the_reason_and_the_versions_that_work():
    found = stack.problems("2.4.1+rocm6.0", {"transformers": "5.24.0", "peft": "0.21.2"})
    assert [p.id for p in found] == ["stack-mismatch"]
    assert "transformers 5.24.0" in found[0].message and "PyTorch was not found" in found[0].message
    assert "transformers>=4.56,<5" in found[0].fix and "make install" in found[0].fix


@pytest.mark.parametrize("torch_version,libraries", [
    ("2.4.1", {"transformers": "4.57.6"}),
    ("2.5.1+rocm6.2", {"transformers": "4.56.2"}),
    ("2.11.0+cu130", {"transformers": "5.17.0"}),
    ("2.13.0+cpu", {"transformers": "5.24.0"}),
])
def test_a_stack_that_works_is_not_refused(torch_version, libraries):
    assert stack.problems(torch_version, libraries) == []


@pytest.mark.parametrize("torch_version", ["2.3.1", "2.1.2+rocm5.6", "1.13.1"])
def test_a_torch_below_the_lowest_claimed_is_refused_naming_the_supported_ones(torch_version):
    (found,) = stack.problems(torch_version, {"transformers": "4.57.6"})
    assert found.id == "torch-unsupported" and f"torch {torch_version} is not supported" in found.message
    assert "2.4 or later" in found.message and "2.4.1" in found.fix and ">=2.6" in found.fix


def test_the_refusal_is_one_user_error_before_anything_is_imported(monkeypatch):
    from rocktune.errors import UserError

    versions = {"torch": "2.4.1", "transformers": "5.24.0"}
    monkeypatch.setattr(stack, "installed_version", versions.get)
    with pytest.raises(UserError, match=r"rocktune train: torch 2\.4\.1 with transformers 5\.24\.0: .*>=4\.56,<5"):
        stack.refuse_unsupported("train")
    versions["transformers"] = "4.57.6"
    stack.refuse_unsupported("train")


def test_train_and_doctor_refuse_through_the_cli(monkeypatch, capsys):
    from rocktune.cli import main

    versions = {"torch": "2.3.1"}
    monkeypatch.setattr(stack, "installed_version", versions.get)
    for argv in (["train", "-c", "nowhere.yaml"], ["doctor", "--no-device"]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert f"rocktune {argv[0]}: torch 2.3.1 is not supported" in " ".join(err.split()), err


def test_the_installed_stack_here_passes_and_its_constraints_are_what_the_installer_prints():
    """Real, in whichever venv runs this (the pinned torch in `make test`, each extra torch in `make
    test-torches`): what pip installed is accepted, and the module run as the Makefile runs it agrees."""
    assert stack.check_installed() == []
    out = subprocess.run([sys.executable, "-m", "rocktune.platform.stack", "--constraints"], capture_output=True,
                         text=True, check=True).stdout.split()
    assert out == stack.constraints(stack.installed_version("torch"))


def test_a_simulated_report_lists_the_refusal_among_its_findings():
    """`rocktune doctor --simulate` judges someone else's report: the MI50's 2.4.1 with transformers 5 is an error
    there; with transformers 4 (as its report has) it is not."""
    from dataclasses import replace
    from pathlib import Path

    from rocktune.platform.advise import advise
    from rocktune.platform.detect import load_platform

    plat = load_platform(Path(__file__).parent / "data" / "platforms" / "mi50_gfx906_torch241_rocm60.json")
    assert not [f for f in advise(plat).findings if f.id.startswith("stack")]
    broken = replace(plat, libraries={**plat.libraries, "transformers": "5.24.0"})
    (found,) = [f for f in advise(broken).findings if f.id == "stack-mismatch"]
    assert found.level == "error" and "transformers>=4.56,<5" in found.fix


def test_compile_is_refused_with_its_reason_below_2_6_only():
    assert "sdpa_mask_older_torch" in stack.compile_refusal("2.4.1+rocm6.0")
    assert stack.compile_refusal("2.11.0+cu130") is None and stack.compile_refusal("2.13.0+cpu") is None


def test_a_run_on_a_torch_that_cannot_compile_trains_eager_and_says_why(tiny_model_dir, task_files, tmp_path,
                                                                        monkeypatch):
    from rocktune.config import config_from_dict
    from rocktune.tasks import train
    from rocktune.tasks.causal import build
    from tests.conftest import tiny_run_config

    monkeypatch.setattr(build, "compile_refusal", lambda: "a stated reason")
    cfg = tiny_run_config(tiny_model_dir, *task_files, tmp_path / "out", max_steps=2, compile=True)
    result = train(config_from_dict(cfg), quiet=True)
    info = (tmp_path / "out" / "run_info.json").read_text()
    assert "torch.compile off: a stated reason" in info and len(result.losses) == 2


def test_wan_lora_is_refused_on_torch_2_4_only_and_train_says_why(tmp_path, monkeypatch, capsys):
    assert "enable_gqa" in stack.task_refusal("2.4.1+rocm6.0", "video-lora")
    assert stack.task_refusal("2.4.1", "image-lora") and stack.task_refusal("2.4.1", "sft") is None
    assert stack.task_refusal("2.11.0+cu130", "video-lora") is None
    from rocktune.cli import main

    versions = {"torch": "2.4.1", "transformers": "4.57.6"}
    monkeypatch.setattr(stack, "installed_version", versions.get)
    for name in ("wan", "clips"):
        (tmp_path / name).mkdir()
    args = ["train", "task=video-lora", f"model.name_or_path={tmp_path / 'wan'}",
            f"data.train_file={tmp_path / 'clips'}", f"output.dir={tmp_path / 'out'}"]
    assert main(args) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "task video-lora with torch 2.4.1" in err and "enable_gqa" in err
    assert not (tmp_path / "out").exists()


def test_the_installer_step_stops_on_a_torch_below_the_lowest_claimed(monkeypatch, capsys):
    """What `make install` runs before installing rocktune: pins printed for 2.4, a stop with the reason for 2.3."""
    versions = {"torch": "2.4.1+rocm6.0"}
    monkeypatch.setattr(stack, "installed_version", versions.get)
    assert stack.main(["--constraints"]) == 0 and capsys.readouterr().out.split() == ["transformers>=4.56,<5"]
    versions["torch"] = "2.3.1"
    assert stack.main(["--constraints"]) == 1
    assert "torch 2.3.1 is not supported" in capsys.readouterr().err
