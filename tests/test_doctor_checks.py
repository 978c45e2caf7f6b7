"""Each self-test runs for real on the CPU and fails when its operation is faulty."""

from __future__ import annotations

import pytest
import torch

from rocktune.doctor import checks as c
from rocktune.doctor import model_checks as m
from rocktune.doctor import perf as p
from rocktune.doctor.registry import FAULTS, parse_faults, plan, run_one


CPU_CHECKS = [(name, fn) for name, fn in plan("cpu", perf=False)
              if not name.startswith("lora")]  # lora: covered (with its peft import) by the end-to-end doctor test


def test_the_cpu_plan_holds_the_checks():
    names = {name for name, _ in CPU_CHECKS}
    assert {"transfer[pageable]", "matmul[float32]", "convert[float32->bfloat16]", "allocator"} <= names


@pytest.mark.parametrize("name, fn", CPU_CHECKS, ids=[name for name, _ in CPU_CHECKS])
def test_real_cpu_checks_pass(name, fn):
    result = run_one(name, fn)
    assert result.status in ("pass", "skip"), result.detail
    if name.startswith(("transfer[pinned", "allocator")):
        assert result.status == "skip"  # no pinned memory or device allocator without a GPU


@pytest.mark.parametrize("kind", ["zero", "perturb"])
def test_transfer_catches_corrupting_copies(kind):
    r = c.check_transfer("cpu", pinned=False, non_blocking=False, copy=FAULTS["transfer"][kind])
    assert r.status == "fail" and r.error > 0
    if kind == "zero":
        assert "became zero" in r.detail and r.error == 1.0
    else:
        assert r.error < 1e-3  # one element per copy: found all the same


def test_transfer_catches_a_zeroed_chunk_in_one_dtype_only():
    def bad(t, device, non_blocking):
        out = c.default_copy(t, device, non_blocking)
        if out.dtype == torch.bfloat16 and out.numel() > 4096:
            out[4096:] = 0  # the tail of a large bf16 copy lost
        return out

    r = c.check_transfer("cpu", False, True, copy=bad)
    assert r.status == "fail" and "bfloat16" in r.detail


@pytest.mark.parametrize(("src", "dst"), [("float32", "bfloat16"), ("bfloat16", "float32"), ("float32", "float16"),
                                          ("float16", "bfloat16")])
def test_conversion_catches_flush_to_zero(src, dst):
    assert c.check_conversion("cpu", src, dst).status == "pass"
    r = c.check_conversion("cpu", src, dst, convert=FAULTS["convert"]["ftz"])
    assert r.status == "fail" and "flushed to zero" in r.detail and r.error > 0.1


def test_conversion_catches_truncation_instead_of_rounding():
    def truncate(t, dtype):  # bf16 by chopping the low 16 bits: wrong in the last bit for about half the values
        if dtype != torch.bfloat16:
            return t.to(dtype)
        bits = t.float().view(torch.int32) & ~0xFFFF
        return bits.view(torch.float32).to(dtype)

    r = c.check_conversion("cpu", "float32", "bfloat16", convert=truncate)
    assert r.status == "fail" and 0.2 < r.error < 0.8


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_matmul_catches_an_off_result(dtype):
    ok = c.check_matmul("cpu", dtype)
    assert ok.status == "pass" and ok.error < ok.tolerance / 4  # real headroom, not a lucky pass
    off = c.check_matmul("cpu", dtype, matmul=FAULTS["matmul"]["off"])
    assert off.status == "fail" and off.error == pytest.approx(0.05, rel=0.1)
    nan = c.check_matmul("cpu", dtype, matmul=lambda a, b: (a @ b).index_fill(0, torch.tensor([3]), float("nan")))
    assert nan.status == "fail" and "non-finite" in nan.detail


def test_sdpa_against_fp64_reference_and_unavailable_backend_skips():
    assert m.check_sdpa("cpu", "MATH", "float32").status == "pass"
    wrong = m.check_sdpa("cpu", "MATH", "float32", attention=lambda q, k, v, b: torch.nn.functional.
                         scaled_dot_product_attention(q, k, v, is_causal=False))  # mask forgotten
    assert wrong.status == "fail"

    def unavailable(q, k, v, backend):
        raise RuntimeError("No available kernel. Aborting execution.")

    assert m.check_sdpa("cpu", "FLASH_ATTENTION", "float16", attention=unavailable).status == "skip"


def test_gpu_only_checks_skip_on_cpu_with_reason():
    assert "GPU" in c.check_transfer("cpu", True, False).detail
    assert m.check_allocator("cpu").status == "skip"
    assert m.check_lora("cpu", "bfloat16").status == "skip"
    assert p.perf_copy("cpu", "h2d", False).status == "skip"


def test_perf_numbers_are_measured():
    r = p.perf_matmul("cpu", "float32", n=128, reps=2)
    assert r.status == "pass" and r.metrics["tflops"] > 0 and r.metrics["seconds"] > 0
    copy = p.perf_copy("cpu", "host", False, mib=4, reps=2)
    assert copy.metrics["bytes"] == 4 * 2**20 and copy.metrics["gb_per_s"] > 0


def test_a_raising_check_is_a_failed_check():
    def boom():
        raise RuntimeError("HIP error: invalid device function\nmore")

    r = run_one("x", boom)
    assert (r.name, r.status) == ("x", "fail") and "invalid device function" in r.detail


def test_parse_faults():
    f = parse_faults("transfer=zero;crash=sdpa[MATH,float32]")
    assert f["transfer"] is FAULTS["transfer"]["zero"] and f["crash"] == "sdpa[MATH,float32]"
    assert parse_faults(None) == {}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA or ROCm device")
def test_device_checks_pass_on_the_gpu():
    for name, fn in plan("cuda", perf=False):
        result = run_one(name, fn)
        assert result.status in ("pass", "skip"), (name, result.detail)
