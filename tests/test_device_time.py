"""The bench's device-side metrics on the CPU: every GPU code path fed with fakes (CUDA events, a profiler, torch's own
FunctionEvent objects carrying kernel names seen on an H200 and on ROCm), so that none meets a GPU for the first
time on the GPU."""

from __future__ import annotations

import pytest
from torch.autograd.profiler_util import FunctionEvent

from rocktune.bench import child, device_time, measure, stats
from rocktune.bench.device_time import DeviceClock, Kernel, classify, kernels_of, summary

# kernel names from the first H200 run's profile.txt, Inductor and rocBLAS
NVJET = "nvjet_sm90_tst_128x256_64x4_1x2_h_bz_coopA_NNN"
FLASH = "void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<Flash_bwd_kernel_traits<64, 128>>"
POINTWISE = "void at::native::vectorized_elementwise_kernel<8, at::native::BinaryFunctor<c10::BFloat16>>"


@pytest.mark.parametrize("name, within, cls", [
    (NVJET, ("aten::linear", "aten::mm"), "matmul"),
    ("Cijk_Alik_Bljk_BBS_BH_MT128x128x32_MI32x32x8x1", ("aten::mm",), "matmul"),  # rocBLAS / Tensile
    ("triton_tem_fused_mm_0", ("CompiledFunction",), "matmul"),  # Inductor's matmul template
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", (), "matmul"),
    (FLASH, ("torch_attn::_varlen_attn_backward",), "attention"),
    ("fmha_cutlassF_bf16_aligned_64x64_rf_sm80", (), "attention"),
    (POINTWISE, ("aten::mul",), "elementwise"),
    ("triton_poi_fused__to_copy_add_mul_0", ("CompiledFunction",), "elementwise"),
    ("_rms_norm_forward_kernel", (), "elementwise"),  # Liger's
    (NVJET, ("LinearCrossEntropy", "aten::mm"), "loss"),  # the head's matmul is the loss's work
    ("triton_red_fused_logsumexp_0", ("LinearCrossEntropy",), "loss"),
    ("void multi_tensor_apply_kernel<FusedAdamMathFunctor>", ("Optimizer.step#AdamW.step", "aten::_fused_adamw_"),
     "optimizer"),
])
def test_kernel_classes(name, within, cls):
    assert classify(Kernel(name, 1.0, within)) == cls


def _event(i, name, parent=None, kernels=()):
    e = FunctionEvent(id=i, name=name, thread=0, start_us=i, end_us=i + 1)
    if parent is not None:
        e.set_cpu_parent(parent)
    for k, us in kernels:
        e.append_kernel(k, 0, us)
    return e


def fake_profile_events():
    """One step as torch's profiler reports it: ops with their launched kernels and their CPU parents."""
    step = _event(0, "ProfilerStep#1")
    loss = _event(1, "LinearCrossEntropy", step)
    adamw = _event(2, "Optimizer.step#AdamW.step", step)
    return [step, loss, adamw,
            _event(3, "aten::mm", step, [(NVJET, 600.0), (NVJET, 200.0)]),
            _event(4, "torch_attn::_varlen_attn", step, [(FLASH, 100.0)]),
            _event(5, "aten::mul", step, [(POINTWISE, 50.0)]),
            _event(6, "aten::mm", loss, [(NVJET, 30.0)]),
            _event(7, "aten::logsumexp", loss, [("reduce_kernel<512, 1>", 10.0)]),
            _event(8, "aten::_fused_adamw_", adamw, [("multi_tensor_apply_kernel", 10.0)])]


def test_a_profiles_kernels_counted_and_summed_per_class():
    kernels = kernels_of(fake_profile_events())
    assert len(kernels) == 7 and kernels[0].within == ("ProfilerStep#1", "aten::mm")
    s = summary(kernels, span_s=0.0012)
    assert s["kernels"] == 7 and s["kernel_s"] == pytest.approx(0.001)
    assert s["busy_share"] == pytest.approx(0.001 / 0.0012, abs=1e-4)
    c = s["classes"]
    assert (c["matmul"]["s"], c["attention"]["s"], c["elementwise"]["s"], c["loss"]["s"], c["optimizer"]["s"]) == \
        pytest.approx((0.0008, 0.0001, 0.00005, 0.00004, 0.00001))
    assert c["matmul"]["kernels"] == 2 and c["matmul"]["share"] == pytest.approx(0.8)
    assert s["top_kernels"][0] == {"name": NVJET, "class": "matmul", "calls": 2, "s": 0.0008}
    assert {"name": NVJET, "class": "loss", "calls": 1, "s": 0.00003} in s["top_kernels"]
    assert summary([], None)["busy_share"] is None


class FakeCuda:
    """torch.cuda's Event/synchronize, on a clock the test moves: each step takes 0.5 s on the device."""

    def __init__(self):
        self.now_ms, self.synced = 0.0, 0

    def synchronize(self):
        self.synced += 1

    def Event(self, enable_timing=False):  # noqa: N802 -- torch.cuda's name
        cuda = self

        class Event:
            def record(self):
                self.at = cuda.now_ms

            def elapsed_time(self, other):
                return other.at - self.at

        assert enable_timing
        return Event()


class FakeProfiler:
    def __init__(self):
        self.entered = self.exited = False

    def __enter__(self):
        self.entered = True
        return self

    def __exit__(self, *exc):
        self.exited = True

    def events(self):
        return fake_profile_events()


def test_device_clock_spans_every_step_and_profiles_the_sampled_one():
    cuda, prof = FakeCuda(), FakeProfiler()
    clock = DeviceClock(sample=4, cuda=cuda, profile=lambda: prof)
    for step in range(1, 5):
        cuda.now_ms += 1000.0 if step == 1 else 500.0 + (200.0 if step == 4 else 0.0)
        clock.step_done(step)
        assert prof.entered == (step >= 3) and prof.exited == (step == 4)
    report = clock.report(measured=[2, 3])
    assert report["step_span_s"] == {"2": 0.5, "3": 0.5, "4": 0.7} and report["median_span_s"] == 0.5
    assert report["sampled_step"] == 4 and report["kernels"] == 7
    assert report["span_s"] == 0.7 and report["busy_share"] == pytest.approx(0.001 / 0.7, abs=1e-4)
    assert cuda.synced >= 2  # the sampled step starts and ends on an idle device


def test_the_bench_child_adds_a_profiled_step_on_a_gpu_only():
    raw = {"training": {"max_steps": 10}}
    clock = child.device_clock({"device": "cuda", "name": "rocktune"}, raw, cuda=FakeCuda(), profile=FakeProfiler)
    assert raw["training"]["max_steps"] == 11 and clock.sample == 11
    for spec in ({"device": "cpu", "name": "rocktune"}, {"device": "cuda", "name": "parity-rocktune"},
                 {"device": "cuda", "name": "rocktune-x2", "nproc": 2}):
        raw = {"training": {"max_steps": 10}}
        assert child.device_clock(spec, raw) is None and raw["training"]["max_steps"] == 10


def test_speed_figures_leave_out_the_profiled_step_and_carry_forwards():
    steps = [{"step": i, "loss": 1.0, "tokens": 100, "step_s": 1.0 if i < 4 else 9.0, "forwards": 2,
              "profiled": i == 4} for i in range(1, 5)]
    s = stats.summarise_steps(steps, warmup=1)
    assert s["measured_steps"] == 2 and s["step_s"] == 1.0 and s["forwards_per_step_median"] == 2
    assert "device_wait_fraction" not in s


def test_memory_probe_reports_the_largest_step_peak(monkeypatch):
    """The loop restarts the device's peak counters as each step starts: the run's peak is the largest of them."""
    import torch

    peaks = iter([(30, 40), (50, 60), (20, 25)])
    now = {}

    def read(i):
        return lambda: now["v"][i]

    monkeypatch.setattr(torch.cuda, "max_memory_allocated", read(0))
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", read(1))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    probe = measure.MemoryProbe("cuda")
    probe.loaded = {"rss_bytes": 1, "device_allocated_bytes": 5}
    for step in (1, 2, 3):
        now["v"] = next(peaks)
        probe.step_done(step)
    report = probe.report()
    assert report["device_peak_allocated_bytes"] == 50 and report["device_peak_reserved_bytes"] == 60
    assert report["device_step_peak_allocated_bytes"] == [30, 50, 20]


def test_classes_are_the_issues():
    assert device_time.CLASSES == ("matmul", "attention", "loss", "optimizer", "elementwise")


def test_profile_step_takes_the_device_span_from_cuda_events():
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(
        "profile_step", Path(__file__).parents[1] / "benchmarks" / "profile_step.py")
    profile_step = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(profile_step)
    cuda = FakeCuda()

    def step():
        cuda.now_ms += 250.0

    assert profile_step.device_span(step, cuda) == 0.25 and cuda.synced == 2


def test_a_bench_child_runs_the_profiled_step_and_leaves_it_out(tiny_model_dir, task_files, tmp_path, monkeypatch):
    """The child's GPU wiring on the CPU: the real train() of the tiny model, the device clock given fakes."""
    clocks = []

    def fake_clock(spec, raw):
        raw["training"]["max_steps"] += 1
        clocks.append(DeviceClock(sample=raw["training"]["max_steps"], cuda=FakeCuda(), profile=FakeProfiler))
        return clocks[-1]

    monkeypatch.setattr(child, "device_clock", fake_clock)
    spec = {"name": "rocktune", "kind": "rocktune", "device": "cpu", "steps": 3, "warmup": 1, "settings": {},
            "model_dir": str(tiny_model_dir), "data_file": str(task_files[0]), "cache_dir": str(tmp_path / "c"),
            "run_dir": str(tmp_path / "run"), "threads": 1,
            "common": {"lora_r": 4, "lora_alpha": 8, "max_length": 64, "micro_batch_size": 2, "grad_accum": 2,
                       "lr": 1e-3, "warmup_steps": 1, "scheduler": "cosine", "seed": 0}}
    steps, resolved = child.run_rocktune(spec, measure.MemoryProbe("cpu"))
    assert [s["step"] for s in steps] == [1, 2, 3, 4] and [s["profiled"] for s in steps] == [False] * 3 + [True]
    timing = resolved["device_time"]
    assert timing["sampled_step"] == 4 and timing["kernels"] == 7 and set(timing["step_span_s"]) == {"2", "3", "4"}
    assert stats.summarise_steps(steps, warmup=1)["measured_steps"] == 2  # steps 2 and 3: not the profiled one


def test_the_bench_table_prints_the_device_account():
    from rocktune.bench.render import device_line

    d = {"sampled_step": 11, **summary(kernels_of(fake_profile_events()), span_s=0.0012)}
    assert device_line("rocktune", d) == ("device, rocktune (profiled step 11): busy 83% of 0.001 s, 7 kernels; "
                                          "matmul 80%, attention 10%, loss 4%, optimizer 1%, elementwise 5%")
