"""Varlen attention over packed rows (rocktune.kernels.attention): the collate's document bounds, the glue registered
with transformers, the choice and its self-test. torch's kernel is CUDA-only, so on the CPU a per-segment SDPA with the
kernel's signature (``reference_varlen``) stands in for it: what is tested here is everything around the kernel."""

from __future__ import annotations

import inspect

import pytest
import torch

from rocktune.kernels import attention as A
from rocktune.data.batching import with_loss_index
from rocktune.data.packing import collate_packed, cu_seq_lens, cut_segments
from rocktune.errors import UserError
from rocktune.models.load import apply_lora, load_model
from rocktune.tasks.causal.loss import causal_lm_loss_sum
from rocktune.tasks.causal.split import split_rows
from tests.varlen_standin import opaque_varlen_2_11


def _example(gen, n):
    x = torch.randint(5, 200, (n,), generator=gen).tolist()
    return x, x


def _rows(lengths_per_row, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [[_example(gen, n) for n in row] for row in lengths_per_row]


def test_the_collate_builds_int32_document_bounds_with_padding_as_one_trailing_segment():
    rows = _rows([[7, 20, 3], [25], [1, 9], [32]])
    batch = collate_packed(rows, 0, 32, segments=True)
    cu = batch["cu_seq_lens"]
    assert cu.dtype == torch.int32
    # row 0: 7, 20, 3 then 2 pads; row 1: 25 then 7 pads; row 2: 1, 9 then 22 pads; row 3: full, no pad segment
    assert cu.tolist() == [0, 7, 27, 30, 32, 57, 64, 65, 74, 96, 128]
    assert "cu_seq_lens" not in collate_packed(rows, 0, 32)  # only when varlen attention runs
    assert cu_seq_lens([[4, 4]], 8).tolist() == [0, 4, 8]


def test_an_out_of_memory_split_cuts_the_bounds_per_piece():
    batch = with_loss_index(collate_packed(_rows([[7, 20, 3], [25], [1, 9], [32]]), 0, 32, segments=True))
    pieces = split_rows(batch, 2)
    assert [p["cu_seq_lens"].tolist() for p in pieces] == [[0, 7, 27, 30, 32, 57, 64], [0, 1, 10, 32, 64]]
    assert all(p["cu_seq_lens"].dtype == torch.int32 for p in pieces)
    assert cut_segments(torch.tensor([0, 3, 8, 12], dtype=torch.int32), 3, 12).tolist() == [0, 5, 9]
    one_row = with_loss_index(collate_packed([[e for row in _rows([[5, 6], [7]]) for e in row]], 0, 0, True))
    assert [p["cu_seq_lens"].tolist() for p in split_rows(one_row, 2)] == [[0, 5], [0, 6, 13]]


def _kernel_2_10(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None):
    """torch 2.10's signature: causality as a flag, no scale, no grouped-query heads."""
    assert key.shape[1] == query.shape[1]  # the glue must have repeated the K/V heads
    return A.reference_varlen(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k,
                              window_size=(-1, 0) if is_causal else (-1, -1))


def test_the_kernel_arguments_are_read_from_its_signature():
    now = A.KernelArgs.of(A.reference_varlen)
    assert now == A.KernelArgs({"window_size": (-1, 0)}, True, True)
    assert A.KernelArgs.of(_kernel_2_10) == A.KernelArgs({"is_causal": True}, False, False)
    with pytest.raises(TypeError, match="no is_causal or window_size"):
        A.KernelArgs.of(lambda q, k, v, cu_q, cu_k, max_q, max_k: q)
    kernel = A.varlen_kernel()  # this torch's own, read the same way (it runs on CUDA only)
    if kernel is not None:
        assert set(A.KernelArgs.of(kernel).causal) <= set(inspect.signature(kernel).parameters)


@pytest.mark.parametrize("kernel", [A.reference_varlen, _kernel_2_10], ids=["torch-2.13", "torch-2.10"])
def test_the_self_test_passes_on_a_sound_kernel_and_fails_on_a_wrong_one(kernel):
    result = A.self_test("cpu", torch.float32, kernel)
    assert result.ok and result.error < 1e-5, result.detail

    def not_causal(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1), enable_gqa=False):
        return A.reference_varlen(q, k, v, cu_q, cu_k, max_q, max_k, scale=scale, enable_gqa=enable_gqa)

    bad = A.self_test("cpu", torch.float32, not_causal)
    assert not bad.ok and bad.error > 1e-2 and "output" in bad.detail
    assert not A.self_test("cpu", torch.float32, lambda *a, **k: 1 / 0).ok  # a raising kernel is a failed test


def test_the_doctor_check_skips_on_a_cpu_and_runs_the_glue_with_a_stand_in():
    from rocktune.doctor import model_checks as m
    from rocktune.doctor.registry import plan

    assert m.check_varlen("cpu", "float32").status == "skip"
    assert m.check_varlen("cpu", "float32", kernel=A.reference_varlen).status == "pass"
    assert [n for n, _ in plan("cuda", perf=False) if n.startswith("varlen")] == ["varlen[bfloat16]",
                                                                                  "varlen[float16]"]


def _passed(device, dtype):
    return A.SelfTest(True, "fed in: passed", 0.0)


def _failed(device, dtype):
    return A.SelfTest(False, "fed in: RuntimeError", None)


def test_auto_picks_varlen_on_a_gpu_when_its_self_test_passes_else_flex_under_compile_else_sdpa():
    packed, compiled = True, True
    name, note = A.choose("auto", "sdpa", "cuda", (packed, not compiled), torch.bfloat16, test=_passed)
    assert name == A.VARLEN and "self-test: fed in: passed" in note
    from transformers import AttentionInterface

    assert A.VARLEN in AttentionInterface._global_mapping
    name, note = A.choose("auto", "sdpa", "cuda", (packed, compiled), torch.bfloat16, test=_failed)
    assert name == "flex_attention" and "varlen self-test failed: fed in: RuntimeError" in note
    name, note = A.choose("auto", "sdpa", "cuda", (packed, not compiled), torch.bfloat16, test=_failed)
    assert name == "sdpa" and "flex attention needs compile" in note
    name, note = A.choose("auto", "sdpa", "cpu", (packed, not compiled), torch.float32, test=_passed)
    assert name == "sdpa" and "CUDA/ROCm-only" in note
    name, note = A.choose("auto", "sdpa", "cuda", (not packed, compiled), torch.bfloat16, test=_passed)
    assert name == "sdpa" and "not packed" in note
    assert A.choose("eager", "eager", "cuda", (packed, compiled), torch.bfloat16, test=_passed) == ("eager", None)
    with pytest.raises(UserError, match="varlen needs torch >= 2.10 and a ROCm/CUDA GPU"):
        A.choose("varlen", "varlen", "cpu", (packed, compiled), torch.float32)


@pytest.fixture(scope="module")
def tiny_llama_dir(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    path = tmp_path_factory.mktemp("llama") / "model"
    LlamaForCausalLM(cfg).save_pretrained(path)
    return path


class _Spy:
    """The stand-in kernel, recording what reached it."""

    def __init__(self):
        self.calls = []

    def __call__(self, q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1), enable_gqa=False):
        self.calls.append((cu_q.clone(), max_q, enable_gqa, tuple(k.shape)))
        return A.reference_varlen(q, k, v, cu_q, cu_k, max_q, max_k, scale=scale, window_size=window_size,
                                  enable_gqa=enable_gqa)


def _loss_and_grads(model_dir, attn, batch):
    torch.manual_seed(0)
    model = apply_lora(load_model(str(model_dir), "fp32", attn, False, "cpu"), 8, 16, 0.0, "all-linear", False)
    for n, p in model.named_parameters():  # LoRA B starts at zero: give it values so every gradient is non-zero
        if "lora_B" in n:
            torch.nn.init.normal_(p, std=0.02)
    loss, n = causal_lm_loss_sum(model, batch, 16)
    loss.backward()
    return loss.item() / n, {k: p.grad for k, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("which", ["qwen2", "llama"])
def test_varlen_gives_dense_masked_sdpas_loss_and_gradients_on_packed_rows(which, tiny_model_dir, tiny_llama_dir,
                                                                           monkeypatch):
    model_dir = tiny_model_dir if which == "qwen2" else tiny_llama_dir
    batch = with_loss_index(collate_packed(_rows([[7, 20, 3], [25], [1, 9, 12], [32]], seed=3), 0, 32,
                                           segments=True))
    dense = {k: v for k, v in batch.items() if k != "cu_seq_lens"}
    want_loss, want = _loss_and_grads(model_dir, "sdpa", dense)
    spy = _Spy()
    name = A.register(spy)
    import transformers.masking_utils as mu

    def no_search(*a, **k):
        raise AssertionError("varlen must not search the position ids for documents")

    monkeypatch.setattr(mu, "find_packed_sequence_indices", no_search)
    monkeypatch.setattr(mu, "sdpa_mask", no_search)
    got_loss, got = _loss_and_grads(model_dir, name, batch)
    assert got_loss == pytest.approx(want_loss, rel=1e-5)
    assert want.keys() == got.keys() and len(got) > 0
    worst = max(float((got[k] - want[k]).abs().max() / want[k].abs().max()) for k in want)
    assert worst < 1e-4
    # every layer's forward got the collate's bounds and the row width, with K/V left at their 2 heads
    assert len(spy.calls) == 2
    assert all(torch.equal(cu, batch["cu_seq_lens"]) and max_q == 32 and gqa and kv[1] == 2
               for cu, max_q, gqa, kv in spy.calls)


def test_without_bounds_the_glue_is_causal_sdpa_for_evaluation_and_generation(tiny_model_dir):
    """Eval batches are right-padded examples and generation one prompt with a cache: no cu_seq_lens reach the
    function, and causal attention is exact on every real token there."""
    spy = _Spy()
    name = A.register(spy)
    model = load_model(str(tiny_model_dir), "fp32", name, False, "cpu")
    ref = load_model(str(tiny_model_dir), "fp32", "sdpa", False, "cpu")
    x = torch.tensor([[5, 9, 11, 17, 3]])
    out = model.generate(input_ids=x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=4)
    want = ref.generate(input_ids=x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=4)
    assert torch.equal(out, want) and spy.calls == []


def test_a_token_batched_run_picks_varlen_on_a_gpu_and_trains_as_sdpa_does(tiny_model_dir, task_files, tmp_path,
                                                                           monkeypatch):
    """The real train(): auto's choice made as on a GPU (device name fed in, the stand-in kernel for torch's), the
    bounds from the collate through the feed, the step and the loss to every layer: the same losses as SDPA."""
    import json

    from rocktune.config import config_from_dict
    from rocktune.tasks import train
    from rocktune.tasks.causal import build
    from tests.conftest import tiny_run_config

    def as_on_a_gpu(setting, advised, device, feeding, dtype):
        monkeypatch.setattr(A, "varlen_kernel", lambda: A.reference_varlen)
        return A.choose(setting, advised, "cuda", feeding, dtype, test=lambda d, dt: A.self_test("cpu", dt))

    losses = {}
    for attn in ("sdpa", "auto"):
        if attn == "auto":
            monkeypatch.setattr(build, "choose_attention", as_on_a_gpu)
        raw = tiny_run_config(tiny_model_dir, task_files[0], None, tmp_path / attn, max_steps=3, batching="tokens",
                              micro_batch_tokens=128, micro_batch_size=16, grad_accum=2)
        raw["model"]["attn_implementation"] = attn
        raw["data"]["eval_fraction"] = 0.0
        losses[attn] = train(config_from_dict(raw), quiet=True).losses
    assert losses["auto"] == pytest.approx(losses["sdpa"], rel=1e-5) and len(losses["auto"]) == 3
    notes = json.loads((tmp_path / "auto" / "run_info.json").read_text())["notes"]
    assert any(n.startswith("attention: varlen_attn over the collate's document bounds (self-test: ") for n in notes)
    assert any("flat forwards of 128 tokens" in n for n in notes)  # varlen: one flat row per forward (data/flat.py)


# Grouped-query heads on a torch whose varlen_attn takes no enable_gqa (2.11, the GPU test machine's): the stand-in
# with that signature accepts grouped K/V as aten's FA2 varlen kernel does (query heads a multiple of the K/V heads).
def _refuses_groups(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1)):
    """A 2.11-signature kernel that demands as many K/V heads as query heads (as a cuDNN backend may)."""
    if k.shape[1] != q.shape[1]:
        raise RuntimeError("fed in: key/value heads must equal query heads")
    return opaque_varlen_2_11(q, k, v, cu_q, cu_k, max_q, max_k, scale=scale, window_size=window_size)


def _wrong_groups(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1)):
    """A 2.11-signature kernel that takes grouped K/V silently and pairs query head h with K/V head h % H_kv (the
    interleaved order) instead of h // group: wrong, and raising nothing."""
    group = q.shape[1] // k.shape[1]
    k, v = (t.repeat(1, group, 1) for t in (k, v))
    return opaque_varlen_2_11(q, k, v, cu_q, cu_k, max_q, max_k, scale=scale, window_size=window_size)


def test_the_self_test_proves_grouped_kv_un_repeated_on_a_kernel_without_enable_gqa():
    assert A.SELF_TEST_HEADS == (14, 2)  # Qwen2.5-0.5B's grouping: a group of 7
    assert not A.KernelArgs.of(opaque_varlen_2_11).gqa
    took = A.self_test("cpu", torch.float32, opaque_varlen_2_11)
    assert took.ok and took.grouped_kv and took.error < 1e-5 and "grouped K/V un-repeated" in took.detail
    with_flag = A.self_test("cpu", torch.float32, A.reference_varlen)  # 2.13's enable_gqa: one call, no copies
    assert with_flag.ok and with_flag.grouped_kv and "un-repeated" not in with_flag.detail
    for kernel, why in ((_refuses_groups, "RuntimeError: fed in"), (_wrong_groups, "worst relative error")):
        kept = A.self_test("cpu", torch.float32, kernel)
        assert kept.ok and not kept.grouped_kv and kept.error < 1e-5, kept.detail  # proven with K/V repeated
        assert "K/V repeated per query head (un-repeated they failed: " in kept.detail and why in kept.detail


@pytest.mark.parametrize("kernel, grouped", [(opaque_varlen_2_11, True), (_refuses_groups, False),
                                             (_wrong_groups, False)], ids=["takes-groups", "refuses", "miscomputes"])
def test_auto_registers_grouped_kv_only_where_the_self_test_proved_them(kernel, grouped):
    name, note = A.choose("auto", "sdpa", "cuda", (True, False), torch.float32,
                          test=lambda d, dt: A.self_test("cpu", dt, kernel))
    assert name == A.VARLEN and ("grouped K/V un-repeated" in note) == grouped
    assert A.repeats_kv(kernel) is not grouped  # the memory planner counts the copies exactly when they are made
    A.register(kernel)  # as set (model.attn_implementation=varlen), untested: repeated on such a kernel
    assert A.repeats_kv(kernel)
    assert not A.repeats_kv(A.reference_varlen)  # enable_gqa: never a copy


class _Spy211(_Spy):
    def __call__(self, q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1)):
        self.calls.append((cu_q.clone(), max_q, False, tuple(k.shape)))
        return opaque_varlen_2_11(q, k, v, cu_q, cu_k, max_q, max_k, scale=scale, window_size=window_size)


@pytest.fixture(scope="module")
def tiny_qwen_14_2_dir(tmp_path_factory):
    """Qwen2.5-0.5B's head grouping at toy width: 14 query heads of 8 dims over 2 K/V heads."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=256, hidden_size=112, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=128)
    path = tmp_path_factory.mktemp("qwen14") / "model"
    Qwen2ForCausalLM(cfg).save_pretrained(path)
    return path


@pytest.mark.parametrize("grouped", [True, False], ids=["un-repeated", "repeated"])
def test_grouped_kv_through_the_2_11_signature_give_sdpas_loss_and_gradients(grouped, tiny_qwen_14_2_dir):
    """The whole model, 14 query heads over 2 K/V heads, through the compiler-opaque stand-in with 2.11's signature:
    un-repeated K/V (2 heads reach the kernel) and repeated ones (14) both give dense masked SDPA's loss and
    gradients."""
    batch = with_loss_index(collate_packed(_rows([[7, 20, 3], [25], [1, 9, 12], [32]], seed=3), 0, 32,
                                           segments=True))
    dense = {k: v for k, v in batch.items() if k != "cu_seq_lens"}
    want_loss, want = _loss_and_grads(tiny_qwen_14_2_dir, "sdpa", dense)
    spy = _Spy211()
    got_loss, got = _loss_and_grads(tiny_qwen_14_2_dir, A.register(spy, grouped_kv=grouped), batch)
    assert got_loss == pytest.approx(want_loss, rel=1e-5)
    worst = max(float((got[k] - want[k]).abs().max() / want[k].abs().max()) for k in want)
    assert worst < 1e-4 and len(got) > 0
    assert [kv[1] for *_, kv in spy.calls] == [2 if grouped else 14] * 2  # one call per layer


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or A.varlen_kernel() is None,
                    reason="needs a CUDA or ROCm device and torch >= 2.10")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_torchs_kernel_passes_the_grouped_query_self_test_on_the_device(dtype):
    """The varlen self-test, 14 query heads over 2 K/V heads, on this device's kernel: passes, and where the kernel
    takes no enable_gqa (torch 2.11) it says whether grouped K/V went un-repeated (benchmarks/varlen_gqa.py prints
    both calls' errors)."""
    result = A.self_test("cuda", dtype)
    assert result.ok, result.detail
