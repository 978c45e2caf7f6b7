"""The recurrent layers' kernel choice (rocktune.kernels.recurrent): a kernel is used only where its self-test against
transformers' torch reference passes on the device; the tiny Qwen3.5 (Gated DeltaNet) and Granite 4 (Mamba2) are
put on the reference path otherwise, and the run log, the doctor and the tripwire say which and why.

There is no GPU here and flash-linear-attention, causal-conv1d and mamba-ssm are GPU code: the CPU tests feed
stand-ins through the same code path (``settle``'s ``stand_ins``): transformers' own torch functions (right), other
correct formulations of the same math (right, other rounding) and perturbed ones (wrong)."""

from __future__ import annotations

import importlib.util
import re

import pytest
import torch

from rocktune.kernels import recurrent
from rocktune.kernels.recurrent_cases import CASES, Dims
from rocktune.kernels.recurrent_selftest import TOLERANCE, self_test
from tests.family_fixtures import BY_NAME, build_family

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "Qwen3_5TextConfig"):
    pytest.skip(f"transformers {transformers.__version__} has no Qwen3.5, and picks its recurrent kernels per layer "
                "at import (transformers 5 resolves them per modeling module, which rocktune reads)",
                allow_module_level=True)

from transformers.models.granitemoehybrid import modeling_granitemoehybrid as granite  # noqa: E402
from transformers.models.qwen3_5 import modeling_qwen3_5 as qwen  # noqa: E402

# transformers' kernel name -> (the modeling module, the global its layer forward calls)
GLOBALS = {"chunk_gated_delta_rule": (qwen, "torch_chunk_gated_delta_rule"),
           "fused_recurrent_gated_delta_rule": (qwen, "torch_recurrent_gated_delta_rule"),
           "causal_conv1d_fn": (qwen, "causal_conv1d_fn"), "causal_conv1d_update": (qwen, "causal_conv1d_update"),
           "mamba_chunk_scan_combined": (granite, "mamba2_chunk_scan"),
           "selective_state_update": (granite, "mamba2_selective_state_update")}
SMALL = Dims(k_dim=16, v_dim=16, heads=4, head_dim=8, state=16, chunk=16, length=37)


@pytest.fixture(autouse=True)
def _transformers_own_kernels_after():
    yield
    recurrent.restore()


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("recurrent")
    return {name: build_family(BY_NAME[name], root / name) for name in ("qwen3.5", "granite4")}


def _load(path):
    from rocktune.models.load import load_model

    return load_model(str(path), "fp32", "sdpa", False, "cpu").eval()


def _torch_fn(name: str):
    module, attr = GLOBALS[name]
    return recurrent.resolve(module, attr).torch_fn


def _perturbed(fn, factor=1.1):
    def wrong(*args, **kwargs):
        out = fn(*args, **kwargs)
        return (out[0] * factor, *out[1:]) if isinstance(out, tuple) else out * factor
    return wrong


def test_transformers_resolves_the_kernels_as_rocktune_reads_them():
    """What rocktune relies on in transformers 5: each kernel is a module global the layer forward calls, wrapped by
    use_kernel_func_from_hub_with_fallback with its name, package and torch function in the closure, the torch
    function being the wrapper's ``__wrapped__``; without the packages (here) transformers picked the torch one."""
    for name, (module, attr) in GLOBALS.items():
        kernel = recurrent.resolve(module, attr)
        assert kernel is not None and kernel.name == name, attr
        assert kernel.torch_fn is getattr(module, attr).__wrapped__
        assert kernel.package == ("fla" if "delta" in name else "causal_conv1d" if "conv" in name else "mamba_ssm")
        assert (kernel.fast is None) == (importlib.util.find_spec(kernel.package) is None)
    assert set(recurrent._called(qwen.Qwen3_5GatedDeltaNet)) == {a for m, a in GLOBALS.values() if m is qwen}
    assert set(recurrent._called(granite.GraniteMoeHybridMambaLayer)) == {
        "causal_conv1d_fn", "causal_conv1d_update", "mamba2_chunk_scan", "mamba2_selective_state_update",
        "mamba2_split_conv1d_scan_combined"}
    assert recurrent._called(qwen.Qwen3_5Attention) == ()
    assert set(CASES) == set(GLOBALS)


def test_a_kernel_the_kernels_package_made_a_module_resolves_the_same(monkeypatch):
    """Where the ``kernels`` package is installed (>= 0.18.2 for transformers 5.24; none here), its
    use_kernel_forward_from_hub turns transformers' wrapper into a module instance whose forward calls it
    (kernels/layer/layer.py, _create_func_module): rocktune finds the same kernel through it."""
    wrapper = qwen.torch_chunk_gated_delta_rule

    class Func(torch.nn.Module):  # kernels' _create_func_module, for this function
        def forward(self, *args, **kwargs):
            return wrapper(*args, **kwargs)

    monkeypatch.setattr(qwen, "torch_chunk_gated_delta_rule", Func())
    kernel = recurrent.resolve(qwen, "torch_chunk_gated_delta_rule")
    assert (kernel.name, kernel.package, kernel.torch_fn) == ("chunk_gated_delta_rule", "fla", wrapper.__wrapped__)
    assert kernel.original is qwen.torch_chunk_gated_delta_rule


def test_the_layers_sizes_are_read_from_the_model(models):
    gdn = next(m for m in _load(models["qwen3.5"]).modules() if isinstance(m, qwen.Qwen3_5GatedDeltaNet))
    mamba = next(m for m in _load(models["granite4"]).modules() if isinstance(m, granite.GraniteMoeHybridMambaLayer))
    assert Dims.of(gdn) == Dims(k_heads=2, v_heads=4, k_dim=16, v_dim=16, conv_width=4, channels=128)
    assert Dims.of(mamba) == Dims(heads=4, head_dim=32, groups=1, state=16, chunk=16, conv_width=4,
                                  channels=mamba.conv_dim)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", list(GLOBALS))
def test_the_self_test_accepts_transformers_own_kernel_and_rejects_a_perturbed_one(name, dtype):
    ref = recurrent.reference_call(recurrent.resolve(*GLOBALS[name]))
    good = self_test(name, _torch_fn(name), ref, "cpu", dtype, SMALL)
    assert good.ok and good.error == 0.0, good.detail
    bad = self_test(name, _perturbed(_torch_fn(name)), ref, "cpu", dtype, SMALL)
    assert not bad.ok and bad.error == pytest.approx(0.1, rel=0.1), bad.detail
    # the output 10% off, and so every gradient: the worst of them is named
    assert re.match(rf"relative error {bad.error:.1e} \((out|d\w+)\) against transformers' torch reference on cpu in ",
                    bad.detail), bad.detail
    assert f"tolerance {TOLERANCE[dtype]:.0e}" in bad.detail


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_another_correct_formulation_passes_with_its_rounding(dtype):
    """Gated DeltaNet token by token (transformers' generation kernel) stands in for the chunked one: the same math
    summed in another order, so not bit-equal, yet well within the tolerance, its gradients too."""
    name = "chunk_gated_delta_rule"
    verdict = self_test(name, _torch_fn("fused_recurrent_gated_delta_rule"),
                        recurrent.reference_call(recurrent.resolve(*GLOBALS[name])), "cpu", dtype, SMALL)
    assert verdict.ok and 0.0 < verdict.error < TOLERANCE[dtype] / 5, verdict.detail


def test_a_kernel_whose_gradient_never_arrives_is_rejected():
    """Right forward values, but the inputs cut from the graph (a backward that loses them): the gradients are zero
    where the reference's are not, an error of 1."""
    name = "chunk_gated_delta_rule"
    fn = _torch_fn(name)

    def detached(q, k, v, **kw):
        return fn(q.detach(), k.detach(), v.detach(), **kw)

    verdict = self_test(name, detached, recurrent.reference_call(recurrent.resolve(*GLOBALS[name])), "cpu",
                        torch.float32, SMALL)
    assert not verdict.ok and verdict.error == pytest.approx(1.0) and "(dx)" in verdict.detail


def test_a_kernel_that_fails_on_the_device_is_rejected_with_its_error():
    def broken(*args, **kwargs):
        raise RuntimeError("invalid device function\nmore")

    verdict = self_test("causal_conv1d_fn", broken, _torch_fn("causal_conv1d_fn"), "cpu", torch.float32, SMALL)
    assert (verdict.ok, verdict.error, verdict.detail) == (False, None, "RuntimeError: invalid device function")


def _stand_ins(model, wrap=lambda f: f, counter=None):
    """A stand-in for every kernel the model's layers call: its torch function (through ``wrap``), counting calls."""
    def counted(name, fn):
        def call(*args, **kwargs):
            if counter is not None:
                counter[name] = counter.get(name, 0) + 1
            return fn(*args, **kwargs)
        return call
    return {k.name: counted(k.name, wrap(k.torch_fn)) for k in recurrent.layer_kernels(model)}


@pytest.mark.parametrize("family", ["qwen3.5", "granite4"])
def test_kernels_that_pass_run_and_kernels_that_fail_fall_back_to_the_reference(models, family):
    """A loaded tiny model: right stand-ins pass and are what the layers call (the logits those of the torch path);
    wrong ones fail their self-test, and the layers run transformers' torch functions again (the logits exactly the
    reference's), though the wrong ones would have changed them."""
    model = _load(models[family])
    ids = torch.arange(5, 45)[None]
    with torch.no_grad():
        want = model(ids).logits
    calls: dict = {}
    line = recurrent.settle(model, "cpu", _stand_ins(model, counter=calls))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, want)
    trained = {"chunk_gated_delta_rule", "causal_conv1d_fn"} if family == "qwen3.5" else {
        "mamba_chunk_scan_combined", "causal_conv1d_fn"}
    assert trained <= set(calls)  # the forward called them (self-tests included)
    calls.clear()
    with torch.no_grad():
        model(ids)
    assert set(calls) == trained  # the model's own forward, not just the self-tests
    fast = sorted(k.name for k in recurrent.fast_kernels(model))
    assert fast == sorted(set(CASES) & {k.name for k in recurrent.layer_kernels(model)})
    assert line[0].startswith("kernels: recurrent layers on cpu (float32): fast ") and "worst relative error 0.0e+00" \
        in line[0]

    wrong = _stand_ins(model, _perturbed)
    line = recurrent.settle(model, "cpu", wrong)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, want)
    assert recurrent.fast_kernels(model) == []
    assert "transformers' torch reference for " in line[0] and "its self-test failed: relative error 1.0e-01" in line[0]
    _choose(model, wrong)  # what the wrong kernels would have done
    with torch.no_grad():
        assert (model(ids).logits - want).abs().max() > 1e-4


def _choose(model, kernels: dict) -> None:
    """Install ``kernels`` (name -> function) as the ones chosen for (cpu, float32), self-test or not."""
    for kernel in recurrent.layer_kernels(model):
        choice = getattr(kernel.module, kernel.attr)
        if kernel.name in kernels and isinstance(choice, recurrent.Choice):
            choice.chosen[recurrent.device_key("cpu", torch.float32)] = kernels[kernel.name]


def test_the_fused_mamba_kernel_is_never_used(models):
    """mamba_split_conv1d_scan_combined (training only) reads out_proj's base weight: even a stand-in is not called,
    and the training forward takes the separate kernels."""
    model = _load(models["granite4"]).train()
    calls: dict = {}
    line = recurrent.settle(model, "cpu", _stand_ins(model, counter=calls))
    calls.clear()
    model(torch.arange(5, 45)[None]).logits.sum().backward()
    assert "mamba_split_conv1d_scan_combined" not in calls and "mamba_chunk_scan_combined" in calls
    assert ("transformers' torch reference for mamba_split_conv1d_scan_combined (it reads out_proj's weight itself, "
            "which under PEFT is the frozen base weight: the LoRA on out_proj would learn nothing)") in line[0]


def test_the_choice_follows_the_device_and_dtype_it_was_proven_on(models):
    """Settled for fp32 on the CPU: a bf16 call (not proven) and any call inside ``reference()`` (the tripwire's
    reference forward) run transformers' torch functions."""
    model = _load(models["qwen3.5"])
    calls: dict = {}
    recurrent.settle(model, "cpu", _stand_ins(model, counter=calls))
    calls.clear()
    with torch.no_grad():
        model.to(torch.bfloat16)(torch.arange(5, 45)[None])
        assert calls == {}
        model.float()
        with recurrent.reference():
            model(torch.arange(5, 45)[None])
        assert calls == {}
        model(torch.arange(5, 45)[None])
    assert calls


def test_each_kernel_is_self_tested_once_per_process_device_and_dtype(models, monkeypatch):
    seen = []
    real = recurrent.self_test
    monkeypatch.setattr(recurrent, "self_test", lambda *a, **k: seen.append(a[0]) or real(*a, **k))
    model = _load(models["qwen3.5"])
    stand_ins = _stand_ins(model)
    recurrent.settle(model, "cpu", stand_ins)
    recurrent.settle(_load(models["qwen3.5"]), "cpu", stand_ins)
    assert sorted(seen) == sorted(set(CASES) & set(stand_ins))


def _installed(monkeypatch):
    """As if the packages were installed: transformers' wrapper picked a fast kernel (its torch function here)."""
    real = recurrent.resolve

    def resolve(module, attr):
        kernel = real(module, attr)
        if kernel is None or kernel.fast is not None:
            return kernel
        return recurrent.Kernel(kernel.module, kernel.attr, kernel.name, kernel.package, kernel.original,
                                kernel.torch_fn, kernel.original)
    monkeypatch.setattr(recurrent, "resolve", resolve)


def test_loading_on_the_cpu_keeps_the_torch_path_and_says_so_once(models, monkeypatch, capsys):
    """The loader's hook (models/load.py): with the packages installed, a model loaded on the CPU runs transformers'
    torch functions (the packages' kernels are GPU code), one line on the console; without them, nothing to say."""
    _load(models["qwen3.5"])
    installed = any(importlib.util.find_spec(p) for p in ("fla", "causal_conv1d", "mamba_ssm"))
    assert capsys.readouterr().err.count("kernels:") == int(installed)  # a package here: its line, else none
    _installed(monkeypatch)
    model = _load(models["qwen3.5"])
    err = capsys.readouterr().err.replace("\n", " ")
    assert err.count("kernels: recurrent layers on cpu (float32): transformers' torch reference for ") == 1
    assert "(the packages' kernels run on GPUs only)" in err
    assert recurrent.fast_kernels(model) == []


def test_the_doctor_self_tests_each_kernel_family(monkeypatch):
    from rocktune.doctor import recurrent_checks
    from rocktune.doctor.registry import plan

    names = [n for n, _ in plan("cpu", perf=False) if n.startswith("recurrent[")]
    assert names == [f"recurrent[{f},float32]" for f in ("gated_deltanet", "causal_conv1d", "mamba2")]
    assert plan("cuda", perf=False) and "recurrent[mamba2,bfloat16]" in dict(plan("cuda", perf=False))
    for family in recurrent_checks.FAMILIES:
        kernels = recurrent_checks.family_kernels(family)
        assert [k.name for k in kernels] == list(recurrent_checks.FAMILIES[family][1])
        skipped = recurrent_checks.check_recurrent("cpu", family, "float32")
        assert skipped.status == "skip" and skipped.detail.startswith("no GPU: training runs transformers' torch")
        good = recurrent_checks.check_recurrent("cpu", family, "float32", {k.name: k.torch_fn for k in kernels},
                                                SMALL)
        assert (good.status, good.error) == ("pass", 0.0) and good.detail.startswith("training uses ")
        # every kernel fed (a package installed here would run its own on the CPU otherwise), the first wrong
        wrong = {k.name: k.torch_fn for k in kernels} | {kernels[0].name: _perturbed(kernels[0].torch_fn, 1.5)}
        bad = recurrent_checks.check_recurrent("cpu", family, "float32", wrong, SMALL)
        assert bad.status == "fail" and bad.error == pytest.approx(0.5, rel=0.05)
        assert bad.detail.startswith(f"training runs transformers' torch reference path for {kernels[0].name} "
                                     "(self-test failed: relative error 5.0e-01")
    # on a GPU where transformers picked nothing fast: not installed, the reason and the fix
    if importlib.util.find_spec("mamba_ssm") is None:
        none = recurrent_checks.check_recurrent("cuda", "mamba2", "bfloat16")
        assert none.status == "skip" and none.detail == ("mamba-ssm is not installed: training runs transformers' "
                                                         "torch reference path (pip install mamba-ssm for the fast "
                                                         "one)")


# the package a family's main fast kernel needs (Gated DeltaNet: fla; Mamba2: mamba-ssm); causal-conv1d's
# convolution is used where it is installed too (it has no wheel for every machine)
NEEDS = {"qwen3.5": "fla", "granite4": "mamba_ssm"}


def _gpu_kernels(family: str) -> str | None:
    if not torch.cuda.is_available():
        return "needs a CUDA or ROCm device"
    return None if importlib.util.find_spec(NEEDS[family]) else f"needs {NEEDS[family]} installed"


@pytest.mark.gpu
@pytest.mark.parametrize("family", [pytest.param(f, marks=pytest.mark.skipif(_gpu_kernels(f) is not None,
                                                                           reason=str(_gpu_kernels(f))))
                                    for f in ("qwen3.5", "granite4")])
def test_the_installed_kernels_pass_their_self_test_on_the_gpu(models, family):
    """The real kernels on the device, in bf16: each installed one passes, and the model's logits stay within
    bf16's rounding of the torch path's."""
    from rocktune.models.load import load_model

    model = load_model(str(models[family]), "bf16", "sdpa", False, "cuda").eval()
    line = recurrent.settle(model, "cuda")
    assert line and " fast " in line[0], line
    picked = {k.name for k in recurrent.layer_kernels(model) if k.fast is not None}  # what transformers imported
    assert picked and {k.name for k in recurrent.fast_kernels(model)} == picked & set(CASES)
    ids = torch.arange(5, 45, device="cuda")[None]
    with torch.no_grad():
        got = model(ids).logits.float()
        with recurrent.reference():
            want = model(ids).logits.float()
    assert float((got - want).norm() / want.norm()) < 2e-2


@pytest.mark.parametrize("family", ["qwen3.5", "granite4"])
def test_the_lora_reference_mode_runs_the_torch_kernels(models, family):
    """lora.check.reference_mode (the correctness matrix, `doctor --model`, the run's tripwire) computes with
    transformers' torch functions whatever kernel was chosen for the device: a wrong kernel installed as chosen
    changes the run's logits, not the reference's."""
    from rocktune.lora.check import reference_mode

    model = _load(models[family])
    ids = torch.arange(5, 45)[None]
    with torch.no_grad():
        want = model(ids).logits
    recurrent.settle(model, "cpu", _stand_ins(model))  # right stand-ins: installed, chosen for (cpu, float32)
    _choose(model, _stand_ins(model, _perturbed))  # wrong kernels installed as chosen
    with torch.no_grad():
        assert (model(ids).logits - want).abs().max() > 1e-4
        with reference_mode(model):
            assert torch.equal(model(ids).logits, want)
        assert (model(ids).logits - want).abs().max() > 1e-4  # the run's path back on leaving
