"""The flat token stream for varlen attention (rocktune.data.flat): one packed row of at most T tokens per forward,
bounds of a fixed length, almost no padding, the same step learned, and at most 2 compiled graphs per run."""

from __future__ import annotations

import random
import types

import pytest
import torch

from rocktune.kernels import attention as A
from rocktune.data.batching import IGNORE, loss_token_counts
from rocktune.data.flat import (ALIGN, collate_flat, cu_slots, flat_width, forward_width, max_segment,
                                padding_share, step_forwards)
from rocktune.data.packing import epoch_steps, step_rows
from rocktune.tasks.causal.build import make_collate
from rocktune.tasks.causal.feed import Feeding, Share, StepFeed
from rocktune.tasks.causal.loss import causal_lm_loss_sum
from rocktune.tasks.causal.split import split_rows
from tests.varlen_standin import opaque_varlen


def _data(n: int, lo: int, hi: int, seed: int = 0):
    rng = random.Random(seed)
    lengths = [rng.randint(lo, hi) for _ in range(n)]
    ids = [[rng.randrange(1, 200) for _ in range(k)] for k in lengths]
    labels = [[IGNORE] * (k // 2) + x[k // 2:] for k, x in zip(lengths, ids)]  # loss on each second half
    return types.SimpleNamespace(input_ids=ids, labels=labels), lengths


def test_the_width_is_a_multiple_of_128_never_below_the_longest_example():
    assert flat_width(34 * 2048, 2048) == 69632 and flat_width(5000, 2048) == 4992
    assert flat_width(1000, 2048) == 2048 and flat_width(100, 300) == 384  # an example of max_length always fits
    assert (forward_width(1000, 1024), forward_width(897, 1024), forward_width(896, 1024)) == (1024, 1024, 896)
    assert forward_width(130, 1024) == 256
    assert cu_slots([5, 1, 3, 2, 50], 6) == 3 + 2  # 1+2+3 fit: 0, three ends, the padding's end
    assert max_segment(2048) == 2048 and max_segment(64) == 127  # an example, or padding under 128


def test_a_steps_forwards_hold_each_example_once_within_the_width_fullest_first():
    _, lengths = _data(300, 20, 512)
    lengths[7] = 512  # an example of max_length
    step = list(range(64))
    forwards = step_forwards(step, lengths, 1024)
    assert sorted(i for f in forwards for i in f) == step
    used = [sum(lengths[i] for i in f) for f in forwards]
    assert max(used) <= 1024 and used == sorted(used, reverse=True)
    assert all(forward_width(u, 1024) == 1024 for u in used[:-1])  # only the last forward is short


def test_a_flat_forward_is_one_row_with_fixed_bounds_and_unlabelled_padding():
    docs = [([1, 2, 3], [IGNORE, 2, 3]), ([4, 5], [4, 5]), ([6, 7, 8, 9], [IGNORE, IGNORE, 8, 9])]
    out = collate_flat(docs, 0, 256, slots=8)
    assert out["input_ids"].shape == (1, 128)  # 9 tokens: the step's short last forward, rounded up to 128
    assert out["cu_seq_lens"].tolist() == [0, 3, 5, 9, 128, 128, 128, 128]
    assert out["cu_seq_lens"].dtype == torch.int32
    assert max(out["cu_seq_lens"].diff().tolist()) <= max_segment(4)  # the padding segment too
    assert out["position_ids"][0, :12].tolist() == [0, 1, 2, 0, 1, 0, 1, 2, 3, 4, 5, 6]
    # each document's first label is masked (no loss asks a document to predict the next); padding has none
    assert out["labels"][0, :9].tolist() == [IGNORE, 2, 3, IGNORE, 5, IGNORE, IGNORE, 8, 9]
    assert (out["labels"][0, 9:] == IGNORE).all() and (out["input_ids"][0, 9:] == 0).all()
    with pytest.raises(ValueError, match="more than the 1 planned"):
        collate_flat(docs, 0, 256, slots=3)
    with pytest.raises(ValueError, match="does not fit the flat width 8"):
        collate_flat(docs, 0, 8, slots=8)


def test_padding_is_under_one_percent_on_the_gpu_suites_workload(tokenizer):
    """The GPU suite's data (bench/workload.py: 50-2,000 tokens, 64 examples per step, max_length 2,048) encoded
    by the real encoder; widths from a small budget to the 34 rows of 2,048 the planner gave the H200 run."""
    from rocktune.bench.workload import make_records
    from rocktune.data.encode import encode

    records = make_records(64 * 6, seed=0, token_range=(50, 2000))
    lengths = [len(encode(r, "prompt_completion", tokenizer, 2048, False, "x").input_ids) for r in records]
    steps = epoch_steps(lengths, 64, 0, 0)
    shares = {t: padding_share(steps, lengths, flat_width(t, 2048)) for t in (8192, 32768, 34 * 2048)}
    assert all(s < 0.01 for s in shares.values()), shares
    # rows of 2,048 (today's non-flat token batching), for the record: what the flat stream removes
    rows = [step_rows(s, lengths, 2048) for s in steps]
    row_share = 1 - sum(lengths) / (2048 * sum(len(r) for r in rows))
    assert row_share > 0.05, row_share  # 8.9% here, the first H200 run's 9%; flat: 0.31%, 0.12%, 0.12%


def _model(tiny_model_dir, attn):
    from rocktune.lora.lean import lean_lora
    from rocktune.models.load import apply_lora, load_model

    torch.manual_seed(0)
    model = apply_lora(load_model(str(tiny_model_dir), "fp32", attn, False, "cpu"), 8, 16, 0.0, "all-linear", False)
    for n, p in model.named_parameters():  # LoRA B starts at zero: give it values so every gradient is non-zero
        if "lora_B" in n:
            torch.nn.init.normal_(p, std=0.02)
    lean_lora(model)
    return model


def _feed(examples, lengths, width: int, rows: int = 2, world: int = 1, rank: int = 0) -> StepFeed:
    feeding = Feeding("tokens", 4, 2, 512, False, rows_per_forward=rows, seed=3, flat_width=width,
                      cu_slots=cu_slots(lengths, width) if width else 0)
    collate = make_collate(examples, True, 0, segments=True,
                           flat=(feeding.flat_width, feeding.cu_slots) if width else None)
    return StepFeed(feeding, lengths, loss_token_counts(examples.labels), collate, share=Share(rank, world))


def _step(model, step, chunk=64):
    """The loop's arithmetic: each forward's loss sum over the step's loss-bearing tokens, backward per forward;
    a flat forward's segments bounded as the run bounds them (the stand-in kernels assert the bound)."""
    model.zero_grad()
    total = 0.0
    for batch in step.forwards:
        flat = batch["input_ids"].shape[0] == 1
        loss, _ = causal_lm_loss_sum(model, batch, chunk, max_document=max_segment(512) if flat else None)
        (loss / step.loss_tokens).backward()
        total += loss.item() / step.loss_tokens
    return total, {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


def test_the_flat_stream_learns_the_same_step_as_rows_of_max_length(tiny_model_dir):
    examples, lengths = _data(64, 20, 512)
    model = _model(tiny_model_dir, A.register(A.reference_varlen))
    rows, flat = _feed(examples, lengths, 0).next(), _feed(examples, lengths, 1024).next()
    assert sorted(i for f in flat.picked for r in f for i in r) == sorted(i for f in rows.picked for r in f for i in r)
    assert flat.loss_tokens == rows.loss_tokens and len(flat.forwards) < len(rows.forwards) * 2
    assert all(b["input_ids"].shape[0] == 1 and b["input_ids"].shape[1] % ALIGN == 0 for b in flat.forwards)
    want_loss, want = _step(model, rows)
    got_loss, got = _step(model, flat)
    assert got_loss == pytest.approx(want_loss, rel=1e-5)
    assert max(float((got[k] - want[k]).abs().max() / want[k].abs().max()) for k in want) < 1e-4


def test_ranks_take_whole_flat_forwards_and_an_out_of_memory_split_keeps_the_loss(tiny_model_dir):
    examples, lengths = _data(64, 20, 512)
    both = [_feed(examples, lengths, 512, world=2, rank=r).next() for r in (0, 1)]
    whole = _feed(examples, lengths, 512).next()
    mine = [[i for f in s.picked for r in f for i in r] for s in both]
    assert not set(mine[0]) & set(mine[1]) and sorted(mine[0] + mine[1]) == sorted(
        i for f in whole.picked for r in f for i in r)
    assert sum(len(s.forwards) for s in both) == len(whole.forwards)
    assert both[0].loss_tokens == whole.loss_tokens
    model = _model(tiny_model_dir, A.register(A.reference_varlen))
    batch = whole.forwards[0]
    pieces = split_rows(batch, 3)  # at document starts, the bounds cut per piece (the padding stays with the last)
    assert sum(p["input_ids"].shape[1] for p in pieces) == batch["input_ids"].shape[1]
    sums = [causal_lm_loss_sum(model, p, 64)[0].item() for p in pieces]
    assert sum(sums) == pytest.approx(causal_lm_loss_sum(model, batch, 64)[0].item(), rel=1e-5)


@pytest.mark.slow
def test_a_compiled_model_fed_the_flat_stream_compiles_at_most_two_graphs(tiny_model_dir):
    """The collate's real output over 10 steps of varying document lengths (forwards of 3 or more widths), the decoder
    compiled as the run compiles it, the varlen kernel an opaque custom op as torch's is: Dynamo's graphs counted by
    a counting backend (the guards and graphs are Dynamo's whatever the backend; Inductor's code is the layer test's,
    test_compiled_layer.py)."""
    import torch._dynamo
    from torch._dynamo.testing import CompileCounter
    from torch._dynamo.utils import counters

    examples, lengths = _data(200, 10, 250)
    model = _model(tiny_model_dir, A.register(opaque_varlen))
    feed = _feed(examples, lengths, 640)
    counter = CompileCounter()
    torch._dynamo.reset()
    breaks = sum(counters["graph_break"].values())
    decoder = model.get_base_model().get_decoder()
    decoder.compile(backend=counter)
    try:
        widths = []
        for _ in range(10):
            step = feed.next()
            widths += [b["input_ids"].shape[1] for b in step.forwards]
            assert {b["cu_seq_lens"].numel() for b in step.forwards} == {feed.feeding.cu_slots}
            _step(model, step)
    finally:
        decoder._compiled_call_impl = None
    assert len(set(widths)) >= 3 and max(widths) == 640  # a third width reuses the symbolic graph
    # one graph of symbolic length for every width (the loss marks a flat row's length dynamic); the bound
    # is 2, and 2 here would mean a second compilation on a GPU too
    assert counter.frame_count == 1, counter.frame_count
    assert sum(counters["graph_break"].values()) == breaks


def test_token_batching_with_varlen_plans_flat_forwards():
    from rocktune.config import config_from_dict
    from rocktune.tasks.causal import autofit
    from rocktune.train.autoconf import AutoChoices

    cfg = config_from_dict({"model": {"name_or_path": "Qwen2.5-0.5B"}, "data": {"train_file": "x", "max_length": 2048},
                            "training": {"micro_batch_size": 8, "grad_accum": 8, "batching": "tokens"}})
    lengths = [50 + (i * 37) % 1950 for i in range(500)]
    feeding, notes, _ = autofit.plan_feeding(cfg, AutoChoices("cuda", "bf16", "sdpa"), lengths, 24 * 2**30, True,
                                             attn=A.VARLEN)
    assert feeding.flat_width == feeding.rows_per_forward * 2048 and feeding.flat_width % ALIGN == 0
    assert feeding.cu_slots == cu_slots(lengths, feeding.flat_width) and "flat forwards of" in notes[0]
    rows, _, _ = autofit.plan_feeding(cfg, AutoChoices("cuda", "bf16", "sdpa"), lengths, 24 * 2**30, True)
    assert rows.flat_width == 0  # SDPA and flex read rows: they keep rows of max_length


def test_the_opaque_stand_in_gives_the_reference_attention_s_values_and_gradients():
    """The stand-in's backward is written out by hand (autograd does not run inside a custom op): its gradients must
    be the reference attention's, including a zero-length document (the fixed-length bounds' padding)."""
    from rocktune.kernels.attention import reference_varlen

    torch.manual_seed(0)
    q, k, v = torch.randn(12, 4, 8), torch.randn(12, 2, 8), torch.randn(12, 2, 8)
    cu = torch.tensor([0, 5, 5, 12], dtype=torch.int32)
    grads = []
    for fn in (opaque_varlen, lambda *a, **kw: reference_varlen(*a, **kw)):
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
        out = fn(*leaves, cu, cu, 7, 7, scale=0.3, window_size=(-1, 0), enable_gqa=True)
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        grads.append((out.detach(), *(t.grad for t in leaves)))
    for got, want in zip(*grads):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
