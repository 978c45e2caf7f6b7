"""QLoRA: the gate refuses the known-bad platforms (simulated snapshots), real 4-bit / 8-bit training on the CPU,
the adapter on a quantised base, exact resume, the planner's quantised sizes, the 4-bit self-tests."""

import dataclasses
import json
import signal
from pathlib import Path

import pytest
import torch

from rocktune.config import config_from_dict
from rocktune.errors import UserError
from rocktune.platform.advise import advise
from rocktune.platform.detect import Device, Platform
from tests.conftest import tiny_run_config, write_jsonl
from rocktune.train.request import RunOptions, RunRequest

PLATFORMS = Path(__file__).parent / "data" / "platforms"
# Recorded on CPU (torch 2.13, bitsandbytes 0.50.2, fp32 compute, seed 0), the same with ATen's default, AVX2 and
# this CPU's own kernels; since data.batch_order: mixed became the default (2026-11-28; tests/test_batch_order.py).
EXPECTED = {
    "nf4": [5.785962, 5.71905, 5.695919, 5.609365, 5.262967, 5.156743],
    "int8": [5.773544, 5.695078, 5.674954, 5.570383, 5.241759, 5.199078],
    "fp4": [5.782679, 5.663141, 5.636484, 5.613186, 5.228224, 5.212816],
}


def snapshot(name: str, **changes) -> Platform:
    plat = Platform.from_dict(json.loads((PLATFORMS / f"{name}.json").read_text()))
    libs = {**plat.libraries, "bitsandbytes": "0.50.2", **changes.pop("libraries", {})}
    return dataclasses.replace(plat, libraries={k: v for k, v in libs.items() if v}, **changes)


def gate(plat: Platform, quant: str = "nf4", model: str = "Qwen2.5-7B", vram: int | None = 20 * 2**30) -> list[str]:
    from rocktune.models.quant import gate as run_gate

    precision = advise(plat).defaults.precision
    return run_gate(plat, quant, model, precision, vram, 1024, 16)


# --- gating, before anything is loaded ----------------------------------------------------------------------


REFUSED = [
    ("gfx906", snapshot("mi50_gfx906_torch241_rocm60"), "nf4",
     r"no bitsandbytes build carries gfx906.*\[qlora-gfx906\]"),
    ("old bitsandbytes on ROCm", snapshot("mi300x_gfx942", libraries={"bitsandbytes": "0.49.2"}, hip="7.0.1"),
     "nf4", r"0\.49\.2 gave NaN losses.*\[qlora-bnb-old-rocm\]"),
    ("int8 on RDNA2", snapshot("rx6700xt_gfx1031", hip="7.14.0", rocm="7.14"), "int8",
     r"hipBLASLt does not support RDNA2 \(gfx1031\).*\[qlora-int8-rdna2\]"),
    ("Windows build without the arch", snapshot("strix_halo_gfx1151_windows", hip="7.2.1", rocm="7.2.1",
                                                devices=[Device(0, "Radeon 780M", "gfx1103")]), "nf4",
     r"ROCm 7\.2\.1, windows\) carries no kernels for gfx1103.*\[qlora-build-lacks-arch\]"),
    ("ROCm without a bitsandbytes library", snapshot("rx7900xt_gfx1100_linux", hip="6.2.4", rocm="6.2"), "nf4",
     r"no linux library for ROCm 6\.2.*\[qlora-no-bnb-library\]"),
    ("bitsandbytes missing", snapshot("cpu_only", libraries={"bitsandbytes": None}), "nf4",
     r"needs bitsandbytes, which is not installed.*pip install 'rocktune\[qlora\]'"),
]


@pytest.mark.parametrize(("plat", "quant", "reason"), [r[1:] for r in REFUSED], ids=[r[0] for r in REFUSED])
def test_gate_refuses_with_the_reason(plat, quant, reason):
    with pytest.raises(UserError, match=reason) as info:
        gate(plat, quant)
    assert "model.quantization=none" in str(info.value)


def test_refusal_names_the_bitsandbytes_build_and_the_planners_unquantised_figure():
    from rocktune.models.quant import unquantised_alternative

    plat = snapshot("rx6700xt_gfx1031")  # RDNA2 on ROCm 6.3: only the ROCm 7.14 library carries it
    with pytest.raises(UserError) as info:
        gate(plat, "nf4", "Qwen2.5-7B", 12 * 2**30)
    text = str(info.value)
    assert "install a torch build for ROCm 7.14 or later on linux" in text
    assert "its ROCm 7.14 library carries gfx1031" in text
    alternative = unquantised_alternative("Qwen2.5-7B", "fp32", 12 * 2**30, 1024, 16)
    assert alternative and alternative in text
    assert "Qwen2.5-7B needs" in alternative and "fits:" in alternative and "LoRA in fp32" in alternative


def test_gate_allows_supported_platforms_and_says_what_to_watch():
    assert gate(snapshot("rx7900xt_gfx1100_linux", hip="7.0.2", rocm="7.0")) == []
    assert gate(snapshot("rx6700xt_gfx1031", hip="7.14.0", rocm="7.14"), "nf4") == []
    assert gate(snapshot("strix_halo_gfx1151_windows", hip="7.2.1", rocm="7.2.1")) == []
    assert gate(snapshot("rtx4090_linux"), "int8") == []
    rocm64 = gate(snapshot("rx7900xt_gfx1100_linux"))  # ROCm 6.4: the library of bitsandbytes#2087
    assert len(rocm64) == 1 and "bitsandbytes#2087" in rocm64[0] and rocm64[0].startswith("nf4: warning")
    assert gate(snapshot("cpu_only"), "int8")[0].startswith("int8: info")


def test_doctor_advice_flags_bitsandbytes_that_cannot_run_here():
    ids = {f.id for f in advise(snapshot("mi50_gfx906_torch241_rocm60")).findings}
    assert "bnb-arch-unsupported" in ids
    ids = {f.id for f in advise(snapshot("mi300x_gfx942", libraries={"bitsandbytes": "0.49.2"})).findings}
    assert "bnb-old-rocm" in ids
    assert not {f.id for f in advise(snapshot("rx7900xt_gfx1100_linux")).findings} & {"bnb-arch-unsupported",
                                                                                       "bnb-old-rocm"}


def test_config_field():
    base = {"data": {"train_file": "x.jsonl"}}
    assert config_from_dict(base).model.quantization == "none"
    assert config_from_dict({**base, "model": {"quantization": "nf4"}}).model.double_quant is True
    with pytest.raises(UserError, match=r"model\.quantization.*nf4.*int8"):
        config_from_dict({**base, "model": {"quantization": "int4"}})


# --- the planner ----------------------------------------------------------------------------------------------


def test_planner_base_weights_match_a_loaded_quantised_model(tmp_path):
    bnb = pytest.importorskip("bitsandbytes")
    from transformers import AutoModelForCausalLM

    from rocktune.models import quant
    from rocktune.demo.tiny import build_tiny_model
    from rocktune.planner.estimate import RunSpec, estimate
    from rocktune.planner.shapes import load_shape

    path = build_tiny_model(tmp_path / "wide", hidden=256, layers=2, heads=4, kv_heads=2, vocab_size=2048)
    for q, dq in (("nf4", True), ("nf4", False), ("int8", True)):
        model = AutoModelForCausalLM.from_pretrained(path, quantization_config=quant.bnb_config(q, dq, torch.float32),
                                                     dtype=torch.float32, device_map={"": "cpu"})
        model = quant.prepare(model, False)
        loaded = sum(p.numel() * p.element_size() for p in model.parameters())
        for m in model.modules():  # scales live beside the packed weights
            w = getattr(m, "weight", None)
            if isinstance(w, bnb.nn.Params4bit):
                loaded += sum(v.numel() * v.element_size() for v in w.quant_state.as_dict(packed=True).values()
                              if torch.is_tensor(v))
            elif getattr(w, "SCB", None) is not None:
                loaded += w.SCB.numel() * w.SCB.element_size()
        predicted = estimate(load_shape(str(path)), RunSpec(quant=q, double_quant=dq)).by_name()["base_weights"]
        assert predicted == pytest.approx(loaded, rel=0.01), (q, dq)


def test_planner_proposes_nf4_only_when_nothing_else_fits():
    from rocktune.planner import RunSpec, suggest_settings

    big = suggest_settings("Qwen2.5-14B", 20 * 2**30, RunSpec(seq_len=1024, lora_r=16,
                           targets="all-linear", precision="bf16", attn="sdpa"), 8)
    assert big.quant == "nf4" and "proposing an nf4 base" in big.reasons[0]
    assert big.total_bytes <= 20 * 2**30
    assert suggest_settings("Qwen2.5-3B", 20 * 2**30, RunSpec(seq_len=1024, lora_r=16,
                            targets="all-linear", precision="bf16", attn="sdpa"), 8).quant == "none"


# --- real training on the CPU ----------------------------------------------------------------------------------


def cpu_kernel_or_skip(quant: str) -> None:
    """Skip, with bitsandbytes' own error, where it has no CPU kernel for ``quant``."""
    bnb = pytest.importorskip("bitsandbytes", reason="bitsandbytes not installed (pip install 'rocktune[qlora]')")
    w = torch.randn(64, 64)
    try:
        if quant == "int8":
            layer = bnb.nn.Linear8bitLt(64, 64, bias=False, has_fp16_weights=False)
            layer.weight = bnb.nn.Int8Params(w, requires_grad=False, has_fp16_weights=False)
        else:
            layer = bnb.nn.Linear4bit(64, 64, bias=False, quant_type=quant, compute_dtype=torch.float32)
            layer.weight = bnb.nn.Params4bit(w, requires_grad=False, quant_type=quant)
        layer.to("cpu")(torch.randn(2, 64, requires_grad=True)).sum().backward()
    except (NotImplementedError, RuntimeError) as exc:
        pytest.skip(f"bitsandbytes {bnb.__version__} has no CPU kernel for {quant}: {str(exc).splitlines()[0]}")


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    from rocktune.demo.task import make_task

    tmp = tmp_path_factory.mktemp("qlora-data")
    tr, ev = make_task(n_train=256, n_eval=32, seed=1)
    return write_jsonl(tmp / "train.jsonl", tr), write_jsonl(tmp / "eval.jsonl", ev)


def qlora_config(model_dir, task, out: Path, quant: str, **training) -> dict:
    cfg = tiny_run_config(model_dir, task[0], task[1], out, **training)
    cfg["model"]["quantization"] = quant
    return cfg


def run(model_dir, task, out: Path, quant: str, **training):
    from rocktune.tasks import train

    return train(config_from_dict(qlora_config(model_dir, task, out, quant, **training)), quiet=True)


@pytest.fixture(scope="module", params=["nf4", pytest.param("fp4", marks=pytest.mark.slow), "int8"])
def trained(request, tiny_model_dir, task, tmp_path_factory):
    cpu_kernel_or_skip(request.param)
    return request.param, run(tiny_model_dir, task, tmp_path_factory.mktemp(request.param) / "run", request.param)


def fresh_base(model_dir, quant: str):
    from transformers import AutoModelForCausalLM

    from rocktune.models import quant as q

    config = q.bnb_config(quant, True, torch.float32)
    model = AutoModelForCausalLM.from_pretrained(model_dir, quantization_config=config, dtype=torch.float32,
                                                 device_map={"": "cpu"})
    return q.prepare(model, False)  # the same kernels as training (no CPU inference repacking)


def test_losses_match_recorded_values(trained):
    quant, result = trained
    assert result.losses == pytest.approx(EXPECTED[quant], abs=5e-3)
    assert result.eval_loss_after < result.eval_loss_before


def test_only_adapters_train_and_the_quantised_base_is_unchanged(trained, tiny_model_dir):
    quant, result = trained
    trainable = {n for n, p in result.model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    fresh = fresh_base(tiny_model_dir, quant).state_dict()
    state = {k.replace(".base_layer", ""): v for k, v in result.model.get_base_model().state_dict().items()
             if "lora_" not in k}
    packed = [k for k, v in fresh.items() if k.endswith(".weight") and v.dtype in (torch.uint8, torch.int8)]
    assert len(packed) == 2 * 7  # every linear of both layers was quantised
    assert all(torch.equal(state[k], v) for k, v in fresh.items())
    lora_b = [v for k, v in result.model.state_dict().items() if "lora_B" in k]
    assert len(lora_b) == 2 * 7 and all(float(v.abs().sum()) > 0 for v in lora_b)


def test_adapter_is_peft_format_and_loads_on_a_quantised_base(trained, tiny_model_dir):
    from peft import PeftModel

    quant, result = trained
    adapter = result.run_dir / "adapter"
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and (adapter / "adapter_model.safetensors").is_file()
    loaded = PeftModel.from_pretrained(fresh_base(tiny_model_dir, quant), adapter).eval()
    result.model.eval()
    ids = torch.tensor([[97, 98, 99, 32, 61, 32, 100]])
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, result.model(input_ids=ids).logits,
                                   rtol=0, atol=1e-5)


@pytest.mark.slow
def test_sigkill_then_resume_is_exact_on_a_4bit_base(tiny_model_dir, task, tmp_path):
    import os
    import subprocess
    import sys

    from rocktune.tasks import train

    cpu_kernel_or_skip("nf4")
    training = {"max_steps": 6}
    reliability = {"save_every": 2, "keep_checkpoints": 2, "min_free_disk_mb": 0}
    cfgs = {}
    for name in ("ref", "killed"):
        cfgs[name] = qlora_config(tiny_model_dir, task, tmp_path / name, "nf4", **training)
        cfgs[name]["lora"]["dropout"] = 0.1  # RNG state must come back too
        cfgs[name]["reliability"] = reliability
    train(config_from_dict(cfgs["ref"]), quiet=True)
    request = RunRequest(cfgs["killed"], RunOptions(overwrite=True))
    env = dict(os.environ, ROCKTUNE_FAULTS=json.dumps({"kill_at_step": 3}))
    proc = subprocess.run([sys.executable, "-m", "rocktune.process.worker", request.to_json()], env=env,
                          capture_output=True, text=True, check=False)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    ckpt = tmp_path / "killed" / "checkpoints"
    saved = sorted(p.name for p in ckpt.iterdir() if p.is_dir())
    assert saved and all((ckpt / s / "adapter_model.safetensors").is_file() for s in saved)
    assert all(f.stat().st_size < 2**20 for s in saved for f in (ckpt / s).iterdir())  # adapter only, no base
    train(config_from_dict(cfgs["killed"]), RunOptions(resume=True), quiet=True)

    def losses(run_dir):
        rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
        return [(r["step"], r.get("loss"), r.get("eval_loss")) for r in rows]

    assert losses(tmp_path / "killed") == losses(tmp_path / "ref")
    adapter = "adapter/adapter_model.safetensors"
    assert (tmp_path / "killed" / adapter).read_bytes() == (tmp_path / "ref" / adapter).read_bytes()


# --- the 4-bit self-tests (doctor and the pre-load check) ------------------------------------------------------


def test_doctor_quant_checks_pass_on_cpu_and_catch_a_wrong_dequantisation():
    pytest.importorskip("bitsandbytes")
    from rocktune.doctor import quant_checks as qc
    from rocktune.doctor.registry import FAULTS

    for check in (qc.check_quant4, qc.check_linear4bit, qc.check_qlora_step):
        result = check("cpu", "nf4")
        assert result.status == "pass", (check.__name__, result.detail)
    result = qc.check_linear8bit("cpu")
    assert result.status == "pass" and result.error < result.tolerance / 2, result.detail
    for kind, bad in FAULTS["dequant"].items():
        result = qc.check_quant4("cpu", "nf4", dequant=bad)
        assert result.status == "fail" and result.error > 10 * result.tolerance, (kind, result.detail)


def test_preload_self_test_refuses_a_build_that_dequantises_wrongly(tiny_model_dir, monkeypatch):
    bf = pytest.importorskip("bitsandbytes.functional")
    from rocktune.tasks.causal.quant_gate import check_quantization

    notes = check_quantization("nf4", str(tiny_model_dir), "fp32", "cpu", 64, 8)
    assert notes[-1] == "nf4 self-test on cpu passed (rows of 64, 192)"
    real = bf.dequantize_4bit
    monkeypatch.setattr(bf, "dequantize_4bit", lambda *a, **k: real(*a, **k) * 1.05)
    with pytest.raises(UserError, match=r"computes wrong nf4 results on cpu \(nf4 rows of 64"):
        check_quantization("nf4", str(tiny_model_dir), "fp32", "cpu", 64, 8)


@pytest.mark.slow
def test_doctor_child_runs_the_4bit_checks_and_honours_an_injected_dequantisation():
    import os

    pytest.importorskip("bitsandbytes")
    from rocktune.doctor.registry import INJECT_ENV
    from rocktune.doctor.runner import run_checks

    names = ["quant4[nf4]", "quant4[fp4]", "linear4bit[nf4]", "qlora[nf4]"]
    env = {**{k: v for k, v in os.environ.items() if k != INJECT_ENV}, INJECT_ENV: "dequant=swap"}
    results = {r.name: r for r in run_checks("cpu", names, env, timeout=120)}
    assert [results[n].status for n in names] == ["fail", "fail", "pass", "pass"]
    assert "differs from the reference" in results["quant4[nf4]"].detail


def test_cli_refuses_a_model_whose_rows_this_bitsandbytes_dequantises_wrongly(task, tmp_path, capsys):
    import yaml

    from rocktune.cli import main
    from rocktune.demo.tiny import build_tiny_model
    from rocktune.doctor.quant_checks import check_quant4

    pytest.importorskip("bitsandbytes")
    if check_quant4("cpu", "nf4", shape=(64, 96)).status == "pass":
        pytest.skip("this bitsandbytes dequantises rows of 96 values correctly on the CPU")
    model = build_tiny_model(tmp_path / "odd", hidden=96, layers=1, heads=4, kv_heads=2)
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump(qlora_config(model, task, tmp_path / "run", "nf4")))
    assert main(["train", "--no-supervise", "-c", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert "computes wrong nf4 results on cpu (nf4 rows of 96" in err
    assert not (tmp_path / "run").exists()  # refused before the run directory was touched


SAVED_POINTS = [("small-llama", "bf16", False, "nf4")] + [
    pytest.param(*p, marks=pytest.mark.slow) for p in (("small-llama", "bf16", True, "nf4"),
                                                       ("small-llama", "fp32", False, "int8"),
                                                       ("tiny-qwen2", "bf16", False, "fp4"))]


@pytest.mark.parametrize(("name", "precision", "ckpt", "quant"), SAVED_POINTS)
def test_planner_saved_activations_on_a_quantised_base_within_2_percent(name, precision, ckpt, quant, tmp_path):
    """Bytes autograd saves in a real step on a QLoRA base (fp32 stream, half autocast copies) vs the planner."""
    import importlib.util

    from transformers import AutoConfig, AutoModelForCausalLM

    from rocktune.models.load import apply_lora, load_model
    from rocktune.planner.estimate import RunSpec, estimate
    from rocktune.planner.shapes import shape_from_config

    cpu_kernel_or_skip(quant)
    spec = importlib.util.spec_from_file_location(
        "planner_validation", Path(__file__).parents[1] / "benchmarks" / "planner_validation.py")
    pv = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(pv)
    config = pv.MODELS[name]
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.for_model(**config)).save_pretrained(tmp_path / name)
    model = apply_lora(load_model(str(tmp_path / name), precision, "sdpa", False, "cpu", quant), 8, 16, 0.0,
                       "all-linear", ckpt)
    model.train()
    got = pv.measure_step(model, pv.make_batch(config["vocab_size"], 4, 64), precision)
    run = RunSpec(micro_batch=4, seq_len=64, lora_r=8, precision=precision, checkpointing=ckpt, quant=quant,
                  loss_fraction=got["loss_tokens"] / (4 * 63), device="cpu")
    predicted = estimate(shape_from_config(config), run).saved_bytes
    assert predicted == pytest.approx(got["saved_bytes"], rel=0.02)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA or ROCm device")
def test_gpu_nf4_peak_within_10_percent(tmp_path):
    """The planner's nf4 allocated peak vs torch.cuda.max_memory_allocated for Qwen2.5-0.5B's shape (random init)."""
    import importlib.util

    from transformers import AutoConfig, AutoModelForCausalLM

    from rocktune.models.load import apply_lora, load_model
    from rocktune.planner.estimate import RunSpec, estimate
    from rocktune.planner.shapes import presets, shape_from_config

    cpu_kernel_or_skip("nf4")  # bitsandbytes importable at all
    spec = importlib.util.spec_from_file_location(
        "planner_validation", Path(__file__).parents[1] / "benchmarks" / "planner_validation.py")
    pv = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(pv)
    config = {k: v for k, v in presets()["Qwen2.5-0.5B"].items() if k != "source"}
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.for_model(**config), dtype=torch.bfloat16).save_pretrained(tmp_path)
    model = apply_lora(load_model(str(tmp_path), "bf16", "sdpa", False, "cuda", "nf4"), 8, 16, 0.0, "all-linear",
                       False)
    model.train()
    batch = pv.make_batch(config["vocab_size"], 1, 1024, device="cuda")
    for _ in range(2):  # the second step holds the optimizer states, as every later one does
        torch.cuda.reset_peak_memory_stats()
        got = pv.measure_step(model, batch, "bf16", device="cuda")
    run = RunSpec(micro_batch=1, seq_len=1024, lora_r=8, precision="bf16", quant="nf4",
                  loss_fraction=got["loss_tokens"] / 1023, loss_chunk=1024)
    predicted = estimate(shape_from_config(config), run).peak_allocated
    assert predicted == pytest.approx(torch.cuda.max_memory_allocated(), rel=0.10)


@pytest.mark.slow
@pytest.mark.parametrize("trained", ["nf4"], indirect=True)
def test_oom_recovery_on_a_4bit_base_sees_the_same_samples(trained, tiny_model_dir, task, tmp_path):
    """An OOM mid-step splits the micro-batches; on a 4-bit base the step's arithmetic stays the same."""
    from rocktune.train.faults import Faults
    from rocktune.tasks import train

    _, plain = trained
    cfg = qlora_config(tiny_model_dir, task, tmp_path / "oom", "nf4")
    result = train(config_from_dict(cfg), quiet=True, faults=Faults({"oom_at_step": 3, "oom_at_forward": 2}))

    def rows(run_dir):
        return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if '"loss"' in x]

    got, want = rows(result.run_dir), rows(plain.run_dir)
    assert [r["samples"] for r in got] == [r["samples"] for r in want]
    assert [r["loss"] for r in got] == pytest.approx([r["loss"] for r in want], rel=1e-5)
