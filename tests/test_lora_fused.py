"""The fused LoRA side path (rocktune.lora.fused through lean_lora(fused=True)): the lean path's values and PEFT's
files, fewer ops per adapted linear, PEFT's own forward wherever it does not apply, compile and checkpointing."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from rocktune.lora import fused as lora_fused
from rocktune.lora.lean import lean_lora
from rocktune.models.load import apply_lora, load_model

# every torch users run (make test-torches): the side paths are where a torch release can make training silently wrong
pytestmark = pytest.mark.torches

_spec = importlib.util.spec_from_file_location("lean_lora_parity",
                                               Path(__file__).parents[1] / "benchmarks" / "lean_lora_parity.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


def _model(model_dir, precision="fp32", dropout=0.0, checkpointing=False):
    torch.manual_seed(0)
    model = apply_lora(load_model(str(model_dir), precision, "sdpa", False, "cpu"), 8, 16, dropout, "all-linear",
                       checkpointing)
    for n, p in model.named_parameters():  # LoRA B starts at zero: give it values so the side path matters
        if "lora_B" in n:
            torch.nn.init.normal_(p, std=0.05)
    return model


def _forward_backward(model, autocast: bool = False):
    ids = torch.arange(5, 69).view(2, 32)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        logits = model(input_ids=ids).logits
    logits.float().logsumexp(-1).mean().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    model.zero_grad(set_to_none=True)
    return logits.detach().float(), grads


def _rel(got: dict, want: dict) -> float:
    assert got.keys() == want.keys() and got
    return max(float((got[k] - want[k]).abs().max() / want[k].abs().max()) for k in want)


@pytest.fixture
def calls(monkeypatch):
    """How many times the fused node ran."""
    seen = []
    real = lora_fused.FusedLoRA.apply
    monkeypatch.setattr(lora_fused.FusedLoRA, "apply", lambda *a: seen.append(1) or real(*a))
    return seen


@pytest.mark.parametrize("precision,autocast,tol", [("fp32", False, 1e-5), ("bf16", True, 3e-2),
                                                    ("fp32", True, 3e-2)])
def test_fused_computes_what_the_lean_path_computes(tiny_model_dir, precision, autocast, tol, calls):
    """Outputs and every LoRA gradient of one step; bf16 within bf16 rounding (the fused add rounds once, in the
    matmul, where the lean path rounds the side term and then the sum)."""
    lean = _model(tiny_model_dir, precision)
    lean_lora(lean, fused=False)
    want_out, want = _forward_backward(lean, autocast)
    fused = _model(tiny_model_dir, precision)
    note = lean_lora(fused)
    assert note.startswith("LoRA side path: fused on 14 of 14 adapted linear layers (4 groups share one A matmul")
    got_out, got = _forward_backward(fused, autocast)
    assert len(calls) == 2 * 4  # per layer one node each for q/k/v, gate/up, o and down: 8 for 14 linears
    assert float((got_out - want_out).abs().max() / want_out.abs().max()) <= tol
    assert len(got) == 28 and _rel(got, want) <= tol


def test_the_saved_adapter_is_peft_s_byte_for_byte_and_loads_with_the_same_logits(tiny_model_dir, tmp_path):
    from peft import PeftModel

    peft_model = _model(tiny_model_dir)
    peft_model.save_pretrained(tmp_path / "peft")
    fused = _model(tiny_model_dir)
    lean_lora(fused)
    _forward_backward(fused)  # the fused node has run (casts cached, groups formed): files must not care
    fused.save_pretrained(tmp_path / "fused")
    for name in ("adapter_model.safetensors", "adapter_config.json"):
        assert (tmp_path / "fused" / name).read_bytes() == (tmp_path / "peft" / name).read_bytes(), name
    loaded = PeftModel.from_pretrained(load_model(str(tiny_model_dir), "fp32", "sdpa", False, "cpu"),
                                       tmp_path / "fused")
    ids = torch.arange(5, 37).view(1, 32)
    with torch.no_grad():
        assert torch.allclose(fused(input_ids=ids).logits, loaded(input_ids=ids).logits, atol=1e-5)


def test_cases_it_does_not_cover_keep_the_lean_or_peft_s_forward(tiny_model_dir, calls):
    ids = torch.arange(5, 37).view(1, 32)
    base = load_model(str(tiny_model_dir), "fp32", "sdpa", False, "cpu")
    with torch.no_grad():
        base_out = base(input_ids=ids).logits
        dropped = _model(tiny_model_dir, dropout=0.1)
        lean_lora(dropped)
        dropped.train()
        dropped(input_ids=ids)
        assert not calls  # dropout while training: the lean forward (it draws the same mask PEFT does)
        dropped.eval()
        on = dropped(input_ids=ids).logits
        assert not calls  # no gradients: the lean forward (PEFT's values to the bit)
        with torch.enable_grad():
            assert torch.allclose(dropped(input_ids=ids).logits, on, atol=1e-5)
        assert len(calls) == 8  # evaluating with gradients, dropout is the identity: fused
        with dropped.disable_adapter():
            assert torch.allclose(dropped(input_ids=ids).logits, base_out, atol=1e-6) and len(calls) == 8
        dropped.merge_adapter()
        assert torch.allclose(dropped(input_ids=ids).logits, on, atol=1e-5) and len(calls) == 8
        dropped.unmerge_adapter()
        dropped.add_adapter("other", dropped.peft_config["default"])
        dropped.set_adapter("other")  # another adapter active than the one patched: PEFT's own forward
        # (B starts at zero: the base's output, up to what merging and unmerging left in the base weights)
        assert torch.allclose(dropped(input_ids=ids).logits, base_out, atol=1e-5) and len(calls) == 8
        dropped.base_model.set_adapter(["default", "other"])  # two active at once: PEFT's own forward sums them
        assert torch.allclose(dropped(input_ids=ids).logits, on, atol=1e-5) and len(calls) == 8
    from peft import LoraConfig, get_peft_model

    dora = get_peft_model(load_model(str(tiny_model_dir), "fp32", "sdpa", False, "cpu"),
                          LoraConfig(r=4, target_modules="all-linear", use_dora=True))
    assert lean_lora(dora) is None  # DoRA is a variant: PEFT's forward stays

    class Quantised(torch.nn.Linear):  # a stand-in for a quantised base layer: not a plain nn.Linear
        pass

    model = bench.block("peft", 64, ("q_proj", "k_proj", "v_proj"), (64, 16, 16))
    model.base_model.model.k_proj.base_layer.__class__ = Quantised
    assert lean_lora(model) == ("LoRA side path: fused on 2 of 3 adapted linear layers (0 groups share one A "
                                "matmul; the others and other cases: the lean forward)")


def test_a_trainable_base_bias_or_an_inference_call_keep_training_right(calls):
    """A base whose bias trains (PEFT's bias="all") needs the gradient the fused node does not give: lean forward.
    A call under inference mode must not leave casts in the cache that a training step would then save."""
    model = bench.block("peft", 64, ("q_proj", "k_proj", "v_proj"), (64, 16, 16))
    lean_lora(model)
    x = torch.randn(2, 5, 64)
    with torch.inference_mode():
        model(x)
    assert not calls  # no gradients: the lean forward
    sum(y.sum() for y in model(x)).backward()  # would raise if an inference-mode cast had been cached
    assert len(calls) == 1
    model.base_model.model.q_proj.base_layer.bias.requires_grad_(True)
    sum(y.sum() for y in model(x)).backward()
    assert len(calls) == 1 and model.base_model.model.q_proj.base_layer.bias.grad is not None


def test_gradient_checkpointing_gives_the_same_gradients(tiny_model_dir):
    plain = _model(tiny_model_dir)
    lean_lora(plain)
    want_out, want = _forward_backward(plain)
    ckpt = _model(tiny_model_dir, checkpointing=True)
    lean_lora(ckpt)
    ckpt.train()
    got_out, got = _forward_backward(ckpt)
    assert torch.allclose(got_out, want_out, atol=1e-6) and _rel(got, want) <= 1e-6


@pytest.mark.parametrize("update", ["adamw_fused", "adamw_foreach", "sgd", "load_state_dict", "copy_"])
def test_every_way_an_adapter_changes_reaches_the_next_forward(tiny_model_dir, update):
    """The fused node casts from the live parameters at every call, so nothing about how they changed matters: torch's
    fused AdamW does not bump the version counters a cast cache would have trusted (the bug that stalled every GPU
    run's default optimizer), a state-dict load or a ``copy_`` may or may not."""
    model = _model(tiny_model_dir, "bf16")
    lean_lora(model)
    trainable = [p for p in model.parameters() if p.requires_grad]
    _forward_backward(model, True)  # a first fused call, as a run's first micro-batch makes
    for p in trainable:
        p.grad = torch.full_like(p, 0.01)
    with torch.no_grad():
        if update == "adamw_fused":
            torch.optim.AdamW(trainable, lr=0.1, fused=True).step()
        elif update == "adamw_foreach":
            torch.optim.AdamW(trainable, lr=0.1, foreach=True).step()
        elif update == "sgd":
            torch.optim.SGD(trainable, lr=10.0).step()
        elif update == "load_state_dict":
            model.load_state_dict({n: p + 0.1 for n, p in model.named_parameters() if p.requires_grad},
                                  strict=False)
        else:
            for p in trainable:
                p.copy_(p + 0.1)
    model.zero_grad(set_to_none=True)
    got, _ = _forward_backward(model, True)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):  # no grad: the lean path, PEFT's values
        want = model(input_ids=torch.arange(5, 69).view(2, 32)).logits.float()
    assert float((got - want).abs().max()) <= 3e-2 * float(want.abs().max())
    stale = _model(tiny_model_dir, "bf16")  # the adapter before the update: the forward must have left it
    lean_lora(stale)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        before = stale(input_ids=torch.arange(5, 69).view(2, 32)).logits.float()
    assert float((got - before).abs().max()) > 10 * float((got - want).abs().max())


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_op_counts_per_adapted_linear(precision):
    """Steady-state aten kernels per adapted linear (views and allocations left out), counted by
    benchmarks/lean_lora_parity.py --ops; the figures of docs/speed.md section 6. A regression shows here."""
    want = {  # (forward, backward) kernels per adapted linear, q/k/v block then a lone projection
        "fp32": {"peft": ((5, 23 / 3), (5, 7)), "fused": ((11 / 3, 5), (4, 6))},
        "bf16": {"peft": ((9, 35 / 3), (9, 11)), "fused": ((11 / 3, 16 / 3), (5, 7))},
    }[precision]
    for mode, shapes in want.items():
        for names, (fwd, bwd) in zip((("q_proj", "k_proj", "v_proj"), ("o_proj",)), shapes):
            got = bench.count_ops(mode, names, precision)
            assert (got["forward"]["kernels"], got["backward"]["kernels"]) == pytest.approx((fwd, bwd)), \
                (mode, names, got["forward"]["by_op"], got["backward"]["by_op"])


@pytest.mark.slow  # compiles two decoder layers: about 15-20 s on 2 shared cores
def test_the_compiled_decoder_runs_the_fused_path_without_graph_breaks(tiny_model_dir):
    import torch._dynamo

    from rocktune.platform.stack import compile_refusal

    refused = compile_refusal(torch.__version__)  # a run on this torch trains eager, saying why (knowledge.yaml)
    if refused:
        pytest.skip(f"torch {torch.__version__}: {refused}")

    eager = _model(tiny_model_dir)
    lean_lora(eager)
    want_out, want = _forward_backward(eager)
    model = _model(tiny_model_dir)
    lean_lora(model)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    model.get_base_model().get_decoder().compile(backend="aot_eager")
    got_out, got = _forward_backward(model)
    breaks = sum(torch._dynamo.utils.counters["graph_break"].values())
    assert breaks == 0, dict(torch._dynamo.utils.counters["graph_break"])
    assert torch.allclose(got_out, want_out, atol=1e-5) and _rel(got, want) <= 1e-5
    torch._dynamo.reset()


def test_a_quantised_base_keeps_peft_s_forward(tiny_model_dir):
    """QLoRA: PEFT wraps a bitsandbytes 4-bit base in its own layer class, which neither path patches."""
    from transformers import AutoModelForCausalLM

    from rocktune.models import quant
    from tests.test_qlora import cpu_kernel_or_skip

    cpu_kernel_or_skip("nf4")
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, device_map={"": "cpu"}, dtype=torch.float32,
                                                quantization_config=quant.bnb_config("nf4", True, torch.float32))
    model = apply_lora(base, 8, 16, 0.0, "all-linear", False)
    assert lean_lora(model) is None
