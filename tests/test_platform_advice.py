"""Advice on simulated platforms: each gets what the knowledge base's sources call for."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rocktune.platform.advise import advise
from rocktune.platform.detect import Platform, load_platform

PLATFORMS = Path(__file__).parent / "data" / "platforms"


def _advice(name: str, **changes):
    data = json.loads((PLATFORMS / f"{name}.json").read_text())
    data.update(changes)
    return advise(Platform.from_dict(data))


def _env(advice, confidence="documented") -> dict[str, str]:
    return {e.name: e.value for e in advice.env if e.confidence == confidence}


def _ids(advice, level=None) -> set[str]:
    return {f.id for f in advice.findings if level is None or f.level == level}


def test_mi50_torch241_rocm60_is_the_known_good_build():
    a = _advice("mi50_gfx906_torch241_rocm60")
    assert (a.defaults.precision, a.defaults.attn_implementation, a.defaults.compile) == ("fp32", "sdpa", False)
    assert _env(a)["TORCH_BLAS_PREFER_HIPBLASLT"] == "0"
    assert "HSA_OVERRIDE_GFX_VERSION" not in _env(a)
    assert "gfx906-torch25-faults" not in _ids(a)
    assert "gfx906-known-good" in _ids(a, "info")
    assert "override-native-redundant" in _ids(a, "info")  # the seed's 9.0.6 is its own ISA
    assert "expandable-noop-rocm" in _ids(a, "warning")  # the seed's expandable_segments does nothing there
    assert "torchao-old-torch" in _ids(a, "error")  # torch.int1 arrives in 2.6


def test_mi50_torch251_rocm62_reports_memory_access_faults():
    a = _advice("mi50_gfx906_torch251_rocm62")
    fault = next(f for f in a.findings if f.id == "gfx906-torch25-faults")
    assert fault.level == "error" and fault.confidence == "reported"
    assert "2.4.1+rocm6.0 works" in fault.message and "2.4.1" in fault.fix
    assert a.defaults.precision == "fp32"


def test_mi50_wrong_override_is_an_error_and_rocm64_has_no_rocblas():
    a = _advice("mi50_gfx906_torch241_rocm60", env={"HSA_OVERRIDE_GFX_VERSION": "10.3.0"})
    assert "override-wrong-isa" in _ids(a, "error")
    b = _advice("mi50_gfx906_torch251_rocm62", torch="2.7.1+rocm6.4", rocm="6.4", hip="6.4.43482")
    assert "gfx906-rocblas-64" in _ids(b, "error")


def test_mi300x_gfx942():
    a = _advice("mi300x_gfx942")
    assert (a.defaults.precision, a.defaults.compile, a.defaults.pin_memory) == ("bf16", True, True)
    assert "TORCH_BLAS_PREFER_HIPBLASLT" not in _env(a)  # hipBLASLt is right here
    assert _env(a)["PYTORCH_HIP_ALLOC_CONF"].startswith("garbage_collection_threshold:0.8")
    assert "sdpa-experimental" not in _ids(a)  # AOTriton is official on gfx942
    # its bitsandbytes 0.49.0 gave NaNs in 4-bit on AMD (unsloth#7535), and bitsandbytes has no ROCm 6.3 library
    assert not _ids(a, "error") and _ids(a, "warning") == {"bnb-old-rocm", "bnb-arch-unsupported"}


def test_one_rx7900xt_gfx1100_linux():
    a = _advice("rx7900xt_gfx1100_linux")
    assert a.defaults.precision == "bf16" and not a.defaults.grad_scaler
    assert _env(a)["TORCH_BLAS_PREFER_HIPBLASLT"] == "0"
    assert "TORCH_ROCM_AOTRITON_ENABLE_EXPERIMENTAL" not in _env(a)  # opt-in only: NaNs were reported
    assert {"sdpa-experimental", "rdna3-fp16-scaler-nan"} <= _ids(a, "info")
    assert not {i for i in _ids(a) if i.startswith("multi-gpu")}


def test_two_rx7900xt_gfx1100_linux_multi_gpu_and_seed_env():
    a = _advice("rx7900xt_x2_gfx1100_linux")
    assert "multi-gpu-iommu" in _ids(a, "warning")
    assert {"multi-gpu-ddp", "multi-gpu-radeon-pcie"} <= _ids(a, "info")
    assert _env(a, "reported") == {"NCCL_P2P_DISABLE": "1"}  # shown, never applied
    assert {"no-memory-caching", "serialize-kernel", "expandable-noop-rocm"} <= _ids(a, "warning")
    with_pt = _advice("rx7900xt_x2_gfx1100_linux", iommu="pt")
    assert "multi-gpu-iommu" not in _ids(with_pt)


def test_rx6700xt_gfx1031_gets_the_documented_override():
    a = _advice("rx6700xt_gfx1031")
    assert _env(a)["HSA_OVERRIDE_GFX_VERSION"] == "10.3.0"
    assert (a.defaults.precision, a.defaults.compile) == ("fp32", False)
    assert "gfx1030-h2d-nan" in _ids(a, "warning")
    assert "build-lacks-arch" not in _ids(a)  # the override makes the wheel's gfx1030 kernels apply
    on_windows = _advice("rx6700xt_gfx1031", os="windows", python="3.12.3")
    assert "HSA_OVERRIDE_GFX_VERSION" not in _env(on_windows)  # it does nothing on Windows
    assert "override-windows-sibling" in _ids(on_windows, "error")


def test_strix_halo_gfx1151_windows():
    a = _advice("strix_halo_gfx1151_windows")
    d = a.defaults
    assert (d.precision, d.compile, d.num_workers, d.pin_memory) == ("bf16", False, 0, False)
    assert "HSA_OVERRIDE_GFX_VERSION" not in _env(a) and "HSA_OVERRIDE_GFX_VERSION" not in _env(a, "reported")
    assert _env(a, "reported") == {"HIP_DISABLE_IPC": "1"}
    assert {"override-windows-noop", "apu-memory"} <= _ids(a, "warning")
    assert {"strix-override-reported", "sdpa-experimental", "windows-rocm"} <= _ids(a, "info")
    assert "strix-windows-h2d-crash" not in _ids(a)
    preview = _advice("strix_halo_gfx1151_windows", torch="2.7.0a0+rocm6.4.4", rocm="6.4.4", hip="6.4.50101")
    assert "strix-windows-h2d-crash" in _ids(preview, "error")
    py313 = _advice("strix_halo_gfx1151_windows", python="3.13.1")
    assert {"windows-rocm-python", "rocm-python-313"} <= _ids(py313, "warning")


def test_rtx4090_linux():
    a = _advice("rtx4090_linux")
    assert (a.defaults.precision, a.defaults.compile, a.defaults.pin_memory) == ("bf16", True, True)
    assert _env(a) == {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}  # torch < 2.12 ignores the new name
    assert _env(_advice("rtx4090_linux", torch="2.12.0+cu130")) == {"PYTORCH_ALLOC_CONF": "expandable_segments:True"}
    assert not a.findings


def test_cpu_only():
    a = _advice("cpu_only")
    assert (a.defaults.precision, a.defaults.attn_implementation, a.defaults.pin_memory) == ("fp32", "sdpa", False)
    assert a.env == [] and _ids(a) == {"cpu-only"}


def test_volta_is_fp16_with_a_scaler_and_unknown_arch_is_fp32():
    volta = _advice("rtx4090_linux", devices=[{"index": 0, "name": "Tesla V100", "arch": "sm_70"}])
    assert volta.defaults.precision == "fp16" and volta.defaults.grad_scaler
    odd = _advice("mi300x_gfx942", devices=[{"index": 0, "name": "?", "arch": "gfx9999"}])
    assert odd.defaults.precision == "fp32" and "unknown-arch" in _ids(odd, "warning")


def test_build_without_kernels_for_the_arch_is_an_error():
    a = _advice("mi300x_gfx942", build_archs=["gfx90a"])
    assert "build-lacks-arch" in _ids(a, "error")
    ada_on_ampere_cubins = _advice("rtx4090_linux", build_archs=["sm_80", "sm_86"])
    assert "cuda-build-lacks-arch" not in _ids(ada_on_ampere_cubins)  # sm_86 cubins run on sm_89


SIMULATED = sorted(PLATFORMS.glob("*.json"))


def test_there_are_simulated_platforms():
    assert len(SIMULATED) >= 9  # an empty folder would make the round-trip test below pass on nothing


@pytest.mark.parametrize("path", SIMULATED, ids=lambda p: p.stem)
def test_every_simulated_platform_round_trips_through_json(path):
    plat = load_platform(path)
    assert Platform.from_dict(json.loads(json.dumps(plat.to_dict()))) == plat
    assert json.loads(json.dumps(advise(plat).to_dict()))["defaults"]["precision"] in ("fp32", "bf16", "fp16")


@pytest.mark.parametrize("bad", [{}, {"os": "linux"}, {"os": "linux", "python": "3.12", "backend": "metal"}])
def test_bad_snapshots_are_user_errors(bad):
    from rocktune.errors import UserError

    with pytest.raises(UserError):
        Platform.from_dict(bad)


@pytest.mark.parametrize("name,device,want", [("mi50_gfx906_torch251_rocm62", "cuda", "fp32"),
                                               ("mi300x_gfx942", "cuda:0", "bf16"), ("rtx4090_linux", "cuda", "bf16"),
                                               ("mi300x_gfx942", "cpu", "fp32")])
def test_generate_takes_its_precision_from_the_platform_policy(name, device, want, monkeypatch):
    """rocktune generate's dtype: the knowledge base's policy (fp32 on gfx906), never is_bf16_supported()."""
    import torch

    from rocktune.platform.advise import device_precision

    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)  # what ROCm says on every device
    plat = Platform.from_dict(json.loads((PLATFORMS / f"{name}.json").read_text()))
    assert device_precision(device, plat) == want
