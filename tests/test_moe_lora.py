"""Expert LoRA on the routed tokens (rocktune.lora.moe) against PEFT's target_parameters path, family by family:
the same loss and adapter gradients from one forward and backward, the routing corner cases (an expert with no
token, a token routed to no expert, top-k with weights, gpt-oss's expert biases), and the adapter files PEFT's own.
The training matrix (tests/test_training_matrix.py, test_moe_experts_*) runs the optimizers, precisions,
checkpointing and compiled cases."""

from __future__ import annotations

import pytest
import torch
import transformers

from rocktune.lora import moe
from rocktune.models.load import apply_lora

DIMS = dict(vocab_size=300, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=512, initializer_range=0.1, head_dim=16)
# every MoE family of transformers 5 that rocktune's grouped path covers, as a tiny random model
FAMILIES = {
    "qwen3_moe": ("Qwen3MoeConfig", dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                         norm_topk_prob=True)),
    "mixtral": ("MixtralConfig", dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=48)),
    "gpt_oss": ("GptOssConfig", dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=32,
                                     layer_types=["full_attention", "sliding_attention"], sliding_window=16)),
    "glm4_moe": ("Glm4MoeConfig", dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                       first_k_dense_replace=0, n_shared_experts=1, intermediate_size=64, n_group=1,
                                       topk_group=1)),
    "qwen3_5_moe": ("Qwen3_5MoeTextConfig", dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                                 shared_expert_intermediate_size=32,
                                                 layer_types=["linear_attention", "full_attention"])),
}
IDS = torch.randint(5, 290, (2, 24), generator=torch.Generator().manual_seed(3))


def build(family: str, experts: str, dtype=torch.float32, implementation: str = "grouped_mm"):
    """The tiny model with LoRA on all-linear (expert stacks included), lora_B non-zero so A has a gradient, and
    the expert biases (gpt-oss) non-zero so that they count. ``implementation``: transformers' experts forward
    (grouped_mm is its default; the reference PEFT wraps)."""
    cls, extra = FAMILIES[family]
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(getattr(transformers, cls)(**DIMS, **extra), dtype=dtype,
                                                          experts_implementation=implementation)
    model = apply_lora(model, 8, 16, 0.0, "all-linear", False, experts=experts)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n or n.endswith("_proj_bias"):
                p.copy_((torch.randn(p.shape, generator=gen) * 0.02).to(p.dtype))
    return model


def loss_and_grads(model) -> tuple[float, dict[str, torch.Tensor]]:
    loss = model(input_ids=IDS, labels=IDS).loss
    loss.backward()
    return float(loss), {n: p.grad.float().clone() for n, p in model.named_parameters() if p.requires_grad}


def relative(got: dict, want: dict) -> float:
    num = sum(float((got[n] - want[n]).pow(2).sum()) for n in want)
    return (num / sum(float(want[n].pow(2).sum()) for n in want)) ** 0.5


@pytest.fixture
def calls(monkeypatch) -> list:
    """Every call of the grouped experts forward (so a test knows the path it measures ran)."""
    seen: list = []
    real = moe.experts_forward
    monkeypatch.setattr(moe, "experts_forward", lambda *a: seen.append(a[0]) or real(*a))
    return seen


@pytest.mark.parametrize("implementation", ("eager", "grouped_mm"))
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_grouped_path_gives_pefts_loss_and_gradients(family, implementation, calls):
    ref_loss, ref_grads = loss_and_grads(build(family, "peft", implementation=implementation))
    assert not calls
    model = build(family, "grouped", implementation=implementation)
    loss, grads = loss_and_grads(model)
    assert len(calls) == 2  # both MoE blocks took the grouped path
    note = moe.expert_path_note(model)
    assert f"grouped on the routed tokens (2 MoE blocks, in place of transformers' {implementation}" in note
    assert sorted(grads) == sorted(ref_grads)
    expert_grads = [n for n in grads if ".experts." in n]
    assert len(expert_grads) == 2 * 2 * 2  # gate_up and down, A and B, two layers
    assert all(float(grads[n].abs().max()) > 0 for n in grads)
    assert loss == pytest.approx(ref_loss, rel=1e-6)
    assert relative(grads, ref_grads) < 1e-5


@pytest.mark.parametrize("layout", ("padded", "grouped_mm"))
def test_bf16_weights_in_both_layouts_within_the_matrix_tolerance(layout, calls, monkeypatch):
    """bf16: the padded batched matmul (the CPU's) and torch's grouped_mm (a GPU's; forced here, torch's CPU kernel
    is slow but computes the same) against PEFT's path, within the matrix's bf16 tolerance."""
    kernel = []
    real = torch.nn.functional.grouped_mm
    monkeypatch.setattr(torch.nn.functional, "grouped_mm", lambda *a, **k: kernel.append(1) or real(*a, **k))
    ref_loss, ref_grads = loss_and_grads(build("qwen3_moe", "peft", torch.bfloat16))
    kernel.clear()  # transformers' own grouped_mm experts (the reference) call it too
    monkeypatch.setattr(moe, "_grouped_kernel", lambda x, widths=(): layout == "grouped_mm")
    loss, grads = loss_and_grads(build("qwen3_moe", "grouped", torch.bfloat16))
    assert calls and len(kernel) == (2 * 2 * 3 if layout == "grouped_mm" else 0)  # blocks x stacks x (W, A, B)
    assert loss == pytest.approx(ref_loss, rel=5e-3)
    assert relative(grads, ref_grads) < 1e-1  # rocktune.lora.check.TOLERANCE["bf16"]["grad"]


def test_the_grouped_kernel_layout_equals_pefts_in_fp32_on_the_corner_cases(calls, monkeypatch):
    """The grouped layout's bookkeeping (offsets, sentinel, no-token expert) in fp32: torch's kernel is bf16-only on
    the CPU, so its fp32 stand-in here is a per-group matmul over the same offsets."""
    def per_group(x, w, offs):
        starts = [0, *offs[:-1].tolist()]
        return torch.cat([x[a:b] @ w[e] for e, (a, b) in enumerate(zip(starts, offs.tolist()))])

    monkeypatch.setattr(moe, "_grouped_kernel", lambda x, widths=(): True)
    monkeypatch.setattr(torch.nn.functional, "grouped_mm", per_group)
    test_an_expert_without_tokens_and_a_token_routed_to_none(calls)


def _experts_call(model, top_k_index: torch.Tensor, weights: torch.Tensor):
    """The first MoE block's experts, called directly with a chosen routing."""
    block = next(m for m in model.modules() if hasattr(m, "_rt_experts") or type(m).__name__ == "ParamWrapper")
    hidden = torch.randn(top_k_index.shape[0], 64, generator=torch.Generator().manual_seed(5), requires_grad=True)
    out = block(hidden, top_k_index, weights)
    out.pow(2).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.detach(), hidden.grad, grads


def test_an_expert_without_tokens_and_a_token_routed_to_none(calls):
    """Expert 3 of 4 receives nothing; token 2 is routed to the sentinel 4 (no expert) in one slot; top-2 weights."""
    index = torch.tensor([[0, 1], [1, 0], [2, 4], [0, 2], [1, 2]])
    weights = torch.tensor([[0.7, 0.3], [0.6, 0.4], [0.9, 0.1], [0.5, 0.5], [0.2, 0.8]])
    # transformers' eager experts skip the sentinel; its grouped_mm ones assume there is none
    want = _experts_call(build("mixtral", "peft", implementation="eager"), index, weights)
    got = _experts_call(build("mixtral", "grouped", implementation="eager"), index, weights)
    assert len(calls) == 1
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-6)
    assert sorted(got[2]) == sorted(want[2])
    for name in want[2]:
        torch.testing.assert_close(got[2][name], want[2][name], rtol=1e-5, atol=1e-6)
    a = next(g for n, g in got[2].items() if "experts" in n and "lora_A" in n)  # [E·r, in]: expert 3's rows
    assert float(a.view(4, 8, -1)[3].abs().max()) == 0.0 and float(a.view(4, 8, -1)[:3].abs().max()) > 0.0


def test_the_saved_adapter_is_pefts_and_loads_merges_in_peft(tmp_path):
    """After three AdamW steps on each path the adapters are equal within fp32 rounding, the files hold the same
    tensors by name and shape, and PEFT loads the grouped path's adapter onto a fresh base with its logits."""
    from peft import PeftModel
    from safetensors.torch import load_file

    saved = {}
    for path in ("peft", "grouped"):
        model = build("qwen3_moe", path)
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        for _ in range(3):
            opt.zero_grad()
            model(input_ids=IDS, labels=IDS).loss.backward()
            opt.step()
        model.save_pretrained(tmp_path / path)
        saved[path] = load_file(tmp_path / path / "adapter_model.safetensors")
    assert {k: v.shape for k, v in saved["grouped"].items()} == {k: v.shape for k, v in saved["peft"].items()}
    for k, v in saved["peft"].items():
        torch.testing.assert_close(saved["grouped"][k], v, rtol=1e-4, atol=1e-5)
    with torch.no_grad():
        want = model(input_ids=IDS).logits
        base = transformers.AutoModelForCausalLM.from_config(model.get_base_model().config)
        loaded = PeftModel.from_pretrained(base, tmp_path / "grouped")
        model_sd = {k: v for k, v in model.get_base_model().state_dict().items() if "lora_" not in k}
        loaded.get_base_model().load_state_dict(model_sd, strict=False)
        torch.testing.assert_close(loaded(input_ids=IDS).logits, want, rtol=1e-4, atol=1e-4)
        merged = loaded.merge_and_unload()
        torch.testing.assert_close(merged(input_ids=IDS).logits, want, rtol=1e-4, atol=1e-4)


def test_disabled_adapters_take_pefts_forward(calls):
    model = build("qwen3_moe", "grouped")
    base = build("qwen3_moe", "peft")
    with torch.no_grad(), model.disable_adapter(), base.disable_adapter():
        torch.testing.assert_close(model(input_ids=IDS).logits, base(input_ids=IDS).logits)
    assert not calls


def test_experts_without_the_traits_stay_on_pefts_path_with_a_note(calls):
    """An experts class rocktune does not know (no use_experts_implementation traits, not Llama 4's): PEFT's forward
    stays, and the note says why."""
    from peft import LoraConfig, get_peft_model

    class PlainExperts(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.gate_up_proj = torch.nn.Parameter(torch.randn(4, 8, 32, generator=torch.Generator().manual_seed(0)))

        def forward(self, x):  # every expert on every token, summed
            return torch.einsum("ti,eio->to", x, self.gate_up_proj)

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.experts = PlainExperts()

        def forward(self, x):
            return self.experts(x)

    model = get_peft_model(Block(), LoraConfig(r=2, target_modules=[], target_parameters=["experts.gate_up_proj"]))
    assert moe.patch(model, "grouped") == ("expert LoRA: PEFT's target_parameters path in 1 MoE blocks (PlainExperts "
                                           "has no transformers experts-implementation traits)")
    assert not any("forward" in vars(m) for m in model.modules())
    assert model(torch.ones(3, 8)).shape == (3, 32) and not calls
    with pytest.raises(ValueError, match="unknown expert LoRA path"):
        moe.patch(torch.nn.Module(), "fast")


LLAMA4 = dict(intermediate_size=32, intermediate_size_mlp=64, interleave_moe_layer_step=1, pad_token_id=None)


def _llama4(experts: str, top_k: int, dtype=torch.float32):
    """Llama 4's text model at DIMS, both layers MoE (8 experts, shared expert, sigmoid router scores on the
    input), LoRA on all-linear, lora_B non-zero."""
    torch.manual_seed(0)
    config = transformers.Llama4TextConfig(**DIMS, **LLAMA4, num_local_experts=8, num_experts_per_tok=top_k)
    model = apply_lora(transformers.AutoModelForCausalLM.from_config(config, dtype=dtype), 8, 16, 0.0, "all-linear",
                       False, experts=experts)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.copy_((torch.randn(p.shape, generator=gen) * 0.02).to(p.dtype))
    return model


@pytest.mark.parametrize("top_k", (1, 2))
def test_llama4s_dense_routed_experts_take_the_grouped_path_with_pefts_loss_and_gradients(top_k, calls):
    """Llama 4 has one experts forward in transformers (no experts_implementation choice): its block runs every
    expert on every token, the input scaled by the router's sigmoid score (0 where not picked). The grouped path on
    the picked rows gives PEFT's loss and every adapter gradient (the shared expert's and the attention's too), top-1
    as Llama 4 ships and top-2."""
    ref_loss, ref_grads = loss_and_grads(_llama4("peft", top_k))
    assert not calls
    model = _llama4("grouped", top_k)
    loss, grads = loss_and_grads(model)
    assert len(calls) == 2
    assert "in place of transformers' dense-routed experts" in moe.expert_path_note(model)
    assert sorted(grads) == sorted(ref_grads)
    assert len([n for n in grads if ".experts." in n]) == 2 * 2 * 2
    assert len([n for n in grads if ".shared_expert." in n]) == 2 * 3 * 2  # gate, up, down: A and B, two layers
    assert all(float(grads[n].abs().max()) > 0 for n in grads)
    assert loss == pytest.approx(ref_loss, rel=1e-6)
    assert relative(grads, ref_grads) < 1e-5


def test_llama4_with_adapters_disabled_in_reference_mode_and_in_bf16(calls):
    """The calls Llama 4's grouped path leaves to PEFT: adapters disabled (PEFT's forward on the dense input formed
    from the picks) and the reference mode (the block's own forward), each PEFT's logits; bf16 on the padded layout
    within the matrix's tolerance."""
    from rocktune.lora.check import reference_mode

    model, base = _llama4("grouped", 1), _llama4("peft", 1)
    with torch.no_grad():
        with model.disable_adapter(), base.disable_adapter():
            torch.testing.assert_close(model(input_ids=IDS).logits, base(input_ids=IDS).logits, rtol=1e-5, atol=1e-5)
        assert not calls
        with reference_mode(model):
            torch.testing.assert_close(model(input_ids=IDS).logits, base(input_ids=IDS).logits, rtol=1e-5, atol=1e-5)
        assert not calls
    ref_loss, ref_grads = loss_and_grads(_llama4("peft", 1, torch.bfloat16))
    loss, grads = loss_and_grads(_llama4("grouped", 1, torch.bfloat16))
    assert len(calls) == 2
    assert loss == pytest.approx(ref_loss, rel=5e-3)
    assert relative(grads, ref_grads) < 1e-1  # rocktune.lora.check.TOLERANCE["bf16"]["grad"]


def test_llama4s_experts_on_an_expert_without_tokens_and_top2_scores(calls):
    """Llama 4's experts wrapper called with a chosen routing (expert 7 of 8 gets nothing, top-2 scores scaling the
    input) against PEFT's forward on the dense scaled input its block forms: output, input gradient and adapter
    gradients equal; expert 7's factors get exactly zero gradient (B is the input-side factor here: PEFT swapped
    Llama 4's [E, in, out] stacks)."""
    index = torch.tensor([[0, 1], [1, 5], [2, 6], [0, 2], [3, 4]])
    weights = torch.tensor([[0.7, 0.3], [0.6, 0.4], [0.9, 0.1], [0.5, 0.5], [0.2, 0.8]])
    model = _llama4("grouped", 2)
    block = model.base_model.model.model.layers[0].feed_forward
    wrapper = block.experts
    hidden = torch.randn(5, 64, generator=torch.Generator().manual_seed(5))
    out = {}
    for side in ("peft", "grouped"):
        model.zero_grad()
        x = hidden.clone().requires_grad_(True)
        if side == "peft":
            y = moe._peft_call(wrapper, wrapper._rt_experts[1], x, (index, weights), {})
        else:
            y = wrapper(x, index, weights)
        y.pow(2).sum().backward()
        out[side] = y.detach(), x.grad, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    assert len(calls) == 1
    torch.testing.assert_close(out["grouped"][0], out["peft"][0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out["grouped"][1], out["peft"][1], rtol=1e-5, atol=1e-6)
    assert sorted(out["grouped"][2]) == sorted(out["peft"][2]) and len(out["peft"][2]) == 4
    for name, want in out["peft"][2].items():
        torch.testing.assert_close(out["grouped"][2][name], want, rtol=1e-5, atol=1e-6)
    b = next(g for n, g in out["grouped"][2].items() if "base_layer.lora_B" in n)  # gate_up's B [in, r·E]
    assert float(b.view(64, 8, 8)[:, :, 7].abs().max()) == 0.0 and float(b.view(64, 8, 8)[:, :, :7].abs().max()) > 0


def test_the_reference_mode_runs_pefts_expert_path(calls):
    """lora.check.reference_mode (the matrix, doctor --model, the run's tripwire) puts PEFT's forward back."""
    from rocktune.lora.check import reference_mode

    model = build("qwen3_moe", "grouped")
    with torch.no_grad():
        with reference_mode(model):
            ref = model(input_ids=IDS).logits
        assert not calls
        got = model(input_ids=IDS).logits
    assert len(calls) == 2
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_the_moe_bench_sides_train_alike_and_the_ratios_follow():
    from rocktune.bench import moe as bench_moe
    from rocktune.bench.moe_step import run

    spec = {"shape": "tiny-moe", "device": "cpu", "precision": "bf16", "tokens": (2, 16), "warmup": 0, "steps": 2,
            "seed": 0}
    rt, hf = ({"status": "ok", **run({**spec, "side": side})} for side in bench_moe.SIDES)
    assert rt["path"].startswith("expert LoRA: grouped on the routed tokens (2 MoE blocks")
    assert "PEFT target_parameters" in hf["path"] and rt["adapter_parameters"] == hf["adapter_parameters"]
    got = bench_moe.compare(rt, hf)
    assert got["loss_max_rel_diff"] < bench_moe.LOSS_TOLERANCE
    assert got["tokens_per_s"] == pytest.approx(rt["tokens_per_s"] / hf["tokens_per_s"])
    fake = {"status": "ok", "losses": [2.0, 1.0], "model_bytes": 100, "useful_tokens_per_step": 10}
    ratios = bench_moe.compare({**fake, "tokens_per_s": 40.0, "peak_bytes": 150},
                               {**fake, "tokens_per_s": 10.0, "peak_bytes": 300})
    assert ratios["tokens_per_s"] == 4.0 and ratios["peak"] == 0.5 and ratios["peak_above_model"] == 0.25
    assert ratios["valid"] and ratios["goal_met"] == {"tokens_per_s": True, "peak": True}
    stale = bench_moe.compare({**fake, "losses": [2.0, 2.0], "tokens_per_s": 1.0, "peak_bytes": 1},
                              {**fake, "tokens_per_s": 1.0, "peak_bytes": 1})
    assert not stale["valid"]  # a side whose loss did not fall has no speed figure


@pytest.mark.gpu
def test_on_the_gpu_bf16_takes_torchs_grouped_mm_and_equals_pefts_path(calls, monkeypatch):
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 0):
        pytest.skip("needs a CUDA/ROCm device of sm80 or later")
    kernel = []
    real = torch.nn.functional.grouped_mm
    monkeypatch.setattr(torch.nn.functional, "grouped_mm", lambda *a, **k: kernel.append(1) or real(*a, **k))
    ids = IDS.cuda()
    out = {}
    for path in ("peft", "grouped"):
        model = build("qwen3_moe", path, torch.bfloat16).cuda()
        kernel.clear()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        out[path] = float(loss), {n: p.grad.float().cpu() for n, p in model.named_parameters() if p.requires_grad}
    assert len(calls) == 2 and len(kernel) == 2 * 2 * 3  # the grouped side: blocks x stacks x (W, A, B)
    assert out["grouped"][0] == pytest.approx(out["peft"][0], rel=5e-3)
    assert relative(out["grouped"][1], out["peft"][1]) < 1e-1


def _fixture_family(name: str, experts: str):
    """tests/family_fixtures.py's tiny model of ``name`` (the families test_families.py trains), LoRA on
    all-linear, lora_B non-zero."""
    from tests.family_fixtures import BY_NAME, TEMPLATES, build_tokenizer, family_config

    fam = BY_NAME[name]
    torch.manual_seed(0)
    config = family_config(fam, build_tokenizer(TEMPLATES[fam.template]))
    model = apply_lora(transformers.AutoModelForCausalLM.from_config(config), 8, 16, 0.0, "all-linear", False,
                       experts=experts)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
    return model


def _fixture_moe_families() -> list[str]:
    from tests.family_fixtures import FAMILIES as ALL

    return [f.name for f in ALL if f.moe]


@pytest.mark.parametrize("name", _fixture_moe_families())
def test_every_moe_family_of_the_matrix_takes_its_path(name, calls):
    """Each MoE family rocktune trains takes the grouped path, with PEFT's loss and gradients; Llama 4's
    dense-routed experts too (its block's routed forward), said in the note."""
    ids = torch.randint(5, 290, (2, 24), generator=torch.Generator().manual_seed(3))
    out = {}
    for experts in ("peft", "grouped"):
        model = _fixture_family(name, experts)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        out[experts] = float(loss), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    note = moe.expert_path_note(model)
    assert calls and note.startswith("expert LoRA: grouped on the routed tokens ("), note
    if name == "llama4":  # its two MoE layers (the other two are dense)
        assert len(calls) == 2 and "(2 MoE blocks, in place of transformers' dense-routed experts" in note
    assert out["grouped"][0] == pytest.approx(out["peft"][0], rel=1e-6)
    assert relative(out["grouped"][1], out["peft"][1]) < 1e-5


@pytest.mark.parametrize("name,replaced", [("qwen3-moe", "grouped_mm"), ("llama4", "dense-routed")])
def test_the_run_log_names_the_expert_path(tmp_path, name, replaced):
    """A run's model building (tasks/causal/build.py) returns the expert-path note with its other notes."""
    from rocktune.config import LoraConfig, ModelConfig
    from rocktune.tasks.causal.build import model_with_adapter
    from tests.family_fixtures import BY_NAME, build_family

    model_dir = build_family(BY_NAME[name], tmp_path / "model")
    model, notes = model_with_adapter(ModelConfig(name_or_path=str(model_dir)), LoraConfig(), "fp32", "sdpa", "cpu",
                                      False)
    assert [n for n in notes if n.startswith("expert LoRA: grouped on the routed tokens (2 MoE blocks, in place of "
                                             f"transformers' {replaced} experts")], notes


def _dequantised_twin(family: str) -> tuple:
    """The grouped model with its expert stacks in 4 bit, and a twin whose stacks hold exactly those 4-bit values
    dequantised, in full precision (the same model but for the storage)."""
    from rocktune.lora import moe_nf4

    make = (lambda: _llama4("grouped", 2)) if family == "llama4" else (lambda: build(family, "grouped"))
    q, twin = make(), make()
    moe_nf4.quantize_experts(q)
    stacks = [m for m in q.modules() if hasattr(m, "_rt_nf4")]
    for experts, other in zip(stacks, [m for m in twin.modules() if type(m) is type(stacks[0])]):
        for name, stack in experts._rt_nf4.items():
            full = torch.stack([stack.weight(e, torch.float32) for e in range(len(stack.packed))])
            with torch.no_grad():
                getattr(other, name).copy_(full if stack.transposed else full.transpose(1, 2))
    return q, twin


@pytest.mark.parametrize("family,layout", [("qwen3_moe", "padded"), ("gpt_oss", "padded"), ("llama4", "padded"),
                                           ("qwen3_moe", "grouped_mm")])
def test_4bit_expert_stacks_compute_what_their_dequantised_values_do(family, layout, monkeypatch):
    """lora/moe_nf4.py's per-expert dequantisation inside the grouped forward and backward: the loss and every
    adapter gradient equal the full-precision path's on the dequantised values (gpt-oss: transposed stacks with
    biases; Llama 4: [E, in, out] stacks, the score on the input, top-2; grouped_mm: the sorted-rows layout, torch's
    kernel stood in by a per-group matmul in fp32)."""
    if layout == "grouped_mm":
        def per_group(x, w, offs):
            starts = [0, *offs[:-1].tolist()]
            return torch.cat([x[a:b] @ w[e] for e, (a, b) in enumerate(zip(starts, offs.tolist()))])

        monkeypatch.setattr(moe, "_grouped_kernel", lambda x, widths=(): True)
        monkeypatch.setattr(torch.nn.functional, "grouped_mm", per_group)
    q, twin = _dequantised_twin(family)
    assert all(getattr(m, n).numel() == 0 for m in q.modules() if hasattr(m, "_rt_nf4") for n in m._rt_nf4)
    assert "(stacks in 4 bit, dequantised per expert)" in moe.expert_path_note(q)
    loss, grads = loss_and_grads(q)
    ref_loss, ref_grads = loss_and_grads(twin)
    assert loss == pytest.approx(ref_loss, rel=1e-6)
    assert relative(grads, ref_grads) < 1e-5
    with torch.no_grad(), q.disable_adapter(), twin.disable_adapter():  # a reference pass: the base alone
        torch.testing.assert_close(q(input_ids=IDS).logits, twin(input_ids=IDS).logits, rtol=1e-5, atol=1e-5)


def test_an_nf4_moe_run_follows_the_full_precision_run_with_a_quarter_of_the_expert_bytes(tmp_path):
    """model.quantization=nf4 on the Qwen3.5-MoE fixture (dense linears 4-bit by transformers, expert stacks by
    lora/moe_nf4.py): 4 AdamW steps on one batch follow the fp32 run's losses within 3% (measured: 0.5% at the
    first step, 1.4% at the fourth), the loss falls, the stacks take under 0.3x their bf16 bytes, and the saved
    adapter has the full-precision run's tensors."""
    from safetensors.torch import load_file

    from rocktune.lora import moe_nf4
    from rocktune.models.load import load_model
    from tests.family_fixtures import BY_NAME, build_family

    pytest.importorskip("bitsandbytes")
    model_dir = build_family(BY_NAME["qwen3.5-moe"], tmp_path / "model")
    ids = torch.randint(5, 250, (2, 32), generator=torch.Generator().manual_seed(0))
    losses, files = {}, {}
    for quant in ("none", "nf4"):
        torch.manual_seed(0)
        model = apply_lora(load_model(str(model_dir), "fp32", "sdpa", False, "cpu", quant), 8, 16, 0.0,
                           "all-linear", False)
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        losses[quant] = []
        for _ in range(4):
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses[quant].append(float(loss.detach()))
        model.save_pretrained(tmp_path / quant)
        files[quant] = load_file(tmp_path / quant / "adapter_model.safetensors")
        if quant == "nf4":
            stacks = [s for m in model.modules() for s in getattr(m, "_rt_nf4", {}).values()]
            assert len(stacks) == 4  # two MoE layers: gate_up and down
            bf16 = sum(2 * len(s.packed) * s.features[0] * s.features[1] for s in stacks)
            assert sum(s.nbytes() for s in stacks) < 0.3 * bf16
    for got, want in zip(losses["nf4"], losses["none"]):
        assert got == pytest.approx(want, rel=3e-2)
    assert losses["nf4"][-1] < losses["nf4"][0] - 1.0
    assert {k: v.shape for k, v in files["nf4"].items()} == {k: v.shape for k, v in files["none"].items()}
    assert moe_nf4.quantize_experts(torch.nn.Linear(2, 2)) is None  # nothing on the grouped path: no note


def test_the_cpu_and_fp32_take_the_padded_layout():
    """torch's CPU grouped_mm refuses fp32 and is a slow reference loop in bf16; fp32 has no kernel anywhere."""
    assert not moe._grouped_kernel(torch.empty(0, 8, dtype=torch.bfloat16), (16, 64))
    assert not moe._grouped_kernel(torch.empty(0, 8, dtype=torch.float32), (16, 64))
