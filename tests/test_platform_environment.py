"""Applying advice to the environment, `auto` resolution with its bf16 self-test, and detection without a device."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from rocktune.doctor.checks import CheckResult
from rocktune.platform import detect, environment
from rocktune.train import autoconf
from rocktune.platform.advise import advise

PLATFORMS = Path(__file__).parent / "data" / "platforms"


def _plat(name: str):
    return detect.load_platform(PLATFORMS / f"{name}.json")


def test_apply_sets_documented_keeps_user_values_and_never_applies_reported():
    env = {"PYTORCH_HIP_ALLOC_CONF": "max_split_size_mb:128"}
    messages = environment.apply_environment(env, platform=_plat("rx7900xt_x2_gfx1100_linux"))
    assert env["TORCH_BLAS_PREFER_HIPBLASLT"] == "0"
    assert env["PYTORCH_HIP_ALLOC_CONF"] == "max_split_size_mb:128"  # the user's value wins
    assert "NCCL_P2P_DISABLE" not in env  # reported: shown only
    assert any(m.startswith("set TORCH_BLAS_PREFER_HIPBLASLT=0 (") for m in messages)
    assert any(m.startswith("kept your PYTORCH_HIP_ALLOC_CONF=max_split_size_mb:128") for m in messages)
    assert any("not applied (reported" in m and "NCCL_P2P_DISABLE" in m for m in messages)


def test_apply_override_for_gfx1031_and_nothing_on_cpu():
    env: dict[str, str] = {}
    environment.apply_environment(env, platform=_plat("rx6700xt_gfx1031"))
    assert env["HSA_OVERRIDE_GFX_VERSION"] == "10.3.0"
    cpu_env: dict[str, str] = {}
    assert environment.apply_environment(cpu_env, platform=_plat("cpu_only")) == [] and cpu_env == {}


def test_env_lines_bash_and_powershell():
    advice = advise(_plat("strix_halo_gfx1151_windows"))
    ps = environment.env_lines(advice, "powershell")
    assert '$env:PYTORCH_HIP_ALLOC_CONF = "garbage_collection_threshold:0.8,max_split_size_mb:512"' in ps
    assert '# $env:HIP_DISABLE_IPC = "1"' in ps
    bash = environment.env_lines(advise(_plat("rtx4090_linux")), "bash")
    assert "export PYTORCH_CUDA_ALLOC_CONF='expandable_segments:True'" in bash


def test_resolve_auto_on_cpu_is_fp32_sdpa():
    choices = autoconf.resolve_auto("cpu", "auto", "auto", platform=_plat("rx7900xt_gfx1100_linux"))
    assert (choices.device, choices.precision, choices.attn_implementation) == ("cpu", "fp32", "sdpa")
    assert not choices.pin_memory and not choices.grad_scaler
    explicit = autoconf.resolve_auto("cpu", "bf16", "eager", platform=_plat("cpu_only"))
    assert (explicit.precision, explicit.attn_implementation) == ("bf16", "eager")  # not auto: passes through


def test_resolve_auto_on_this_machine():
    choices = autoconf.resolve_auto("auto", "auto", "auto")
    if not torch.cuda.is_available():
        assert (choices.device, choices.precision, choices.attn_implementation) == ("cpu", "fp32", "sdpa")
        assert "device auto -> cpu" in choices.messages
    else:  # a GPU: the device, and a precision that passed its self-test on it (each choice said)
        assert choices.device == "cuda" and "device auto -> cuda" in choices.messages
        assert choices.precision in ("bf16", "fp16", "fp32")
        assert any(m.startswith("precision auto -> ") for m in choices.messages)
        assert choices.grad_scaler == (choices.precision == "fp16")


def _fake_checks(monkeypatch, failing: set[str]):
    from rocktune.doctor import checks

    def conversion(device, src, dst, convert=None):
        bad = {src, dst} & failing
        return CheckResult("", "fail" if bad else "pass", "896 of 1990 values differ (896 flushed to zero)")

    def matmul(device, dtype, **_):
        return CheckResult("", "pass", "ok")

    monkeypatch.setattr(checks, "check_conversion", conversion)
    monkeypatch.setattr(checks, "check_matmul", matmul)


def test_failed_bf16_self_test_falls_back_to_fp16_then_fp32(monkeypatch):
    advice = advise(_plat("rx7900xt_gfx1100_linux"))
    _fake_checks(monkeypatch, {"bfloat16"})
    messages: list[str] = []
    assert autoconf._proven_precision("cuda", "bf16", advice, messages) == "fp16"
    assert "precision bf16 failed its self-test" in messages[0] and "flushed to zero" in messages[0]
    _fake_checks(monkeypatch, {"bfloat16", "float16"})
    messages = []
    assert autoconf._proven_precision("cuda", "bf16", advice, messages) == "fp32"
    assert messages[-1].startswith("precision -> fp32")


def test_bf16_self_test_runs_for_real_on_the_cpu_device():
    messages: list[str] = []
    advice = advise(_plat("mi300x_gfx942"))
    assert autoconf._proven_precision("cpu", "bf16", advice, messages) == "bf16" and messages == []


def test_passive_detection_does_not_initialise_a_device():
    plat = detect.detect("passive")
    assert plat.probe == "passive" and plat.python.count(".") == 2
    assert not torch.cuda.is_initialized()
    assert plat.backend == ("rocm" if torch.version.hip else "cuda" if torch.version.cuda else "cpu")
    assert "peft" in plat.libraries and plat.torch == torch.__version__
    json.dumps(plat.to_dict())


def test_kfd_topology_is_decoded(tmp_path, monkeypatch):
    for node, version, cores in [("0", 0, 16), ("1", 90010, 0), ("2", 110501, 0)]:
        d = tmp_path / node / "mem_banks" / "0"
        d.mkdir(parents=True)
        (tmp_path / node / "properties").write_text(f"cpu_cores_count {cores}\ngfx_target_version {version}\n")
        (d / "properties").write_text("heap_type 1\nsize_in_bytes 68702699520\n")
    monkeypatch.setattr(detect, "_KFD_NODES", tmp_path)
    devices = detect._kfd_devices()
    assert [(d.index, d.arch, d.source) for d in devices] == [(0, "gfx90a", "sysfs"), (1, "gfx1151", "sysfs")]
    assert devices[0].vram_bytes == 68702699520


def test_env_snapshot_keeps_runtime_variables_and_drops_secrets():
    env = detect._relevant_env({"HSA_OVERRIDE_GFX_VERSION": "10.3.0", "HOME": "/root", "HIP_API_TOKEN": "x",
                                "PYTORCH_HIP_ALLOC_CONF": "a:1"})
    assert env == {"HSA_OVERRIDE_GFX_VERSION": "10.3.0", "PYTORCH_HIP_ALLOC_CONF": "a:1"}
