"""Token batching (the GPU default), host-side loss indices, one sync per step, prefetch and the token budget —
every GPU code path driven on the CPU, with device facts fed in."""

from __future__ import annotations

import pytest
import torch

from rocktune.config import config_from_dict
from rocktune.data.batching import with_loss_index
from rocktune.data.encode import IGNORE
from rocktune.data.packing import cut_forwards, epoch_steps, step_rows
from rocktune.errors import UserError
from rocktune.tasks.causal import autofit, build
from rocktune.train import resume
from rocktune.train.autoconf import AutoChoices
from rocktune.tasks.causal.feed import Feeding, Share, StepFeed, _examples, rows_per_step
from rocktune.tasks import train
from rocktune.train.step import run_with_oom_recovery
from tests.conftest import tiny_run_config

GIB = 2**30


def test_epoch_steps_cover_each_example_once_and_are_reproducible():
    lengths = list(range(5, 105))
    steps = epoch_steps(lengths, 16, seed=3, epoch=0)
    assert sorted(i for s in steps for i in s) == list(range(100))
    assert [len(s) for s in steps] == [16] * 6 + [4]
    assert steps == epoch_steps(lengths, 16, seed=3, epoch=0)
    assert steps != epoch_steps(lengths, 16, seed=3, epoch=1)


def test_step_forwards_pack_rows_within_capacity_and_balance_forwards():
    lengths = [60, 50, 40, 30, 20, 10, 64, 5, 33, 27, 45, 12]
    forwards = cut_forwards(step_rows(list(range(12)), lengths, capacity=64), rows_per_forward=3)
    rows = [row for fwd in forwards for row in fwd]
    assert sorted(i for row in rows for i in row) == list(range(12))
    assert all(sum(lengths[i] for i in row) <= 64 for row in rows)
    assert all(len(f) <= 3 for f in forwards)
    assert max(len(f) for f in forwards) - min(len(f) for f in forwards) <= 1  # near-equal forwards
    assert len(forwards) == -(-len(rows) // 3)


def test_rows_per_step_caps_the_budget_at_what_a_step_holds():
    assert rows_per_step([100] * 10, examples_per_step=64, max_length=1024) == 8  # 6400 tokens -> 7 rows + 1
    assert rows_per_step([10], examples_per_step=1, max_length=1024) == 2


def test_host_loss_index_matches_the_label_mask():
    labels = torch.tensor([[IGNORE, 5, IGNORE, 7, 8], [IGNORE, IGNORE, 3, IGNORE, IGNORE]])
    batch = with_loss_index({"input_ids": torch.zeros_like(labels), "labels": labels})
    keep = labels[:, 1:] != IGNORE
    assert batch["loss_index"].tolist() == keep.flatten().nonzero().flatten().tolist()
    assert batch["loss_targets"].tolist() == labels[:, 1:][keep].tolist() == [5, 7, 8, 3]


LENGTHS = [7 + (i * 13) % 50 for i in range(40)]
EXAMPLES = [(list(range(n)), [IGNORE] * (n // 3) + list(range(n // 3, n))) for n in LENGTHS]


def _feed(prefetch: bool, mode: str = "tokens", rank: int = 0, world: int = 1, lockstep: bool = False,
          **position) -> StepFeed:
    from rocktune.data.batching import collate, loss_token_counts
    from rocktune.data.packing import collate_packed

    f = Feeding(mode=mode, micro_batch_size=4, grad_accum=3, max_length=64, packing=False, rows_per_forward=2,
                seed=5)
    if mode == "tokens":
        def coll(rows):
            return collate_packed([[EXAMPLES[i] for i in row] for row in rows], 0)
    else:
        def coll(idx):
            return collate([EXAMPLES[i][0] for i in idx], [EXAMPLES[i][1] for i in idx], 0)
    return StepFeed(f, LENGTHS, loss_token_counts([y for _, y in EXAMPLES]), lambda p: with_loss_index(coll(p)),
                    prefetch, Share(rank, world, {"idle": True}, lockstep), **position)


def test_prefetch_hands_out_the_same_steps_and_saves_the_consumed_position():
    plain, ahead = _feed(False), _feed(True)
    try:
        for _ in range(7):  # crosses the epoch boundary (40 examples / 12 per step)
            a, b = plain.next(), ahead.next()
            assert a.picked == b.picked and a.loss_tokens == b.loss_tokens
            assert all(torch.equal(x["input_ids"], y["input_ids"]) for x, y in zip(a.forwards, b.forwards))
            assert plain.position() == ahead.position() and plain.epoch == ahead.epoch
        saved = ahead.position()
        expected = [ahead.next().picked for _ in range(3)]
    finally:
        ahead.close()
    resumed = _feed(True, **saved)
    try:
        assert [resumed.next().picked for _ in range(3)] == expected
    finally:
        resumed.close()


@pytest.mark.parametrize("mode", ["tokens", "examples"])
def test_ranks_take_disjoint_shares_and_agree_on_the_global_token_count(mode):
    """The loss normaliser comes from per-example counts: it equals the collated batches' count with no
    communication, and two ranks' shares are disjoint and make up the one-process step."""
    from rocktune.data.batching import count_loss_tokens

    one, r0, r1 = _feed(False, mode), _feed(False, mode, 0, 2), _feed(False, mode, 1, 2)
    for _ in range(5):
        s, a, b = one.next(), r0.next(), r1.next()
        assert s.loss_tokens == sum(count_loss_tokens(f["labels"]) for f in s.forwards)
        assert a.loss_tokens == b.loss_tokens == s.loss_tokens
        def ids(st):
            return sorted(_examples(st.picked, mode == "tokens"))
        # a split of the same step: equal as multisets, so no rank takes what the other took (a step that crosses
        # an epoch's end may hold an example twice, once from each epoch)
        assert sorted(ids(a) + ids(b)) == ids(s)
        assert a.real_tokens + b.real_tokens == s.real_tokens


def test_token_batching_trains_the_same_step_as_example_batching(tiny_model_dir, task_files, tmp_path):
    """One optimizer step over the same 64 examples: padded examples vs packed rows give the same loss and update."""
    train_file, _ = task_files
    runs = {}
    for mode, extra in (("examples", {}), ("tokens", {"micro_batch_tokens": 128})):
        raw = tiny_run_config(tiny_model_dir, train_file, None, tmp_path / mode, max_steps=1, micro_batch_size=256,
                              grad_accum=1, batching=mode, warmup_steps=0, **extra)
        raw["data"]["eval_fraction"] = 0.0
        runs[mode] = train(config_from_dict(raw), quiet=True)
    ex, tok = runs["examples"], runs["tokens"]
    assert tok.losses == pytest.approx(ex.losses, rel=1e-5)
    a = {n: p for n, p in ex.model.named_parameters() if p.requires_grad}
    b = {n: p for n, p in tok.model.named_parameters() if p.requires_grad}
    assert a.keys() == b.keys()
    # AdamW's first update is about lr x sign(g) (lr 3e-3): summation order moves tiny gradients' updates by ~1e-6;
    # a masking or normalisation error would move them by the order of lr.
    assert all(torch.allclose(a[n], b[n], atol=2e-5) for n in a)
    import json

    rows = [json.loads(x) for x in (tmp_path / "tokens" / "metrics.jsonl").read_text().splitlines()]
    step = next(r for r in rows if r.get("step") == 1 and "loss" in r)
    assert step["forwards"] > 1 and step["real_tokens"] <= step["batch_tokens"] and step["device_wait_s"] >= 0


def test_auto_batching_is_examples_on_cpu_and_tokens_on_a_gpu():
    cfg = config_from_dict({"model": {"name_or_path": "Qwen2.5-0.5B"}, "data": {"train_file": "x", "max_length": 2048},
                            "training": {"micro_batch_size": 8, "grad_accum": 8}})
    lengths = [50 + (i * 37) % 1950 for i in range(500)]
    cpu, notes, _ = autofit.plan_feeding(cfg, AutoChoices("cpu", "fp32", "sdpa"), lengths, None, False)
    assert cpu.mode == "examples" and "fastest on a CPU" in notes[0]
    big, notes, peak = autofit.plan_feeding(cfg, AutoChoices("cuda", "bf16", "sdpa"), lengths, 140 * GIB, False)
    assert big.mode == "tokens" and big.rows_per_forward == rows_per_step(lengths, 64, 2048)  # the whole step
    assert peak and peak < 140 * GIB and "all a step holds" in notes[1]
    small, notes, peak = autofit.plan_feeding(cfg, AutoChoices("cuda", "bf16", "sdpa"), lengths, 10 * GIB, False)
    assert 1 <= small.rows_per_forward < big.rows_per_forward and peak < 10 * GIB
    with pytest.raises(UserError, match="one packed row"):
        autofit.plan_feeding(cfg, AutoChoices("cuda", "fp32", "eager"), lengths, 2 * GIB, False)
    cfg.training.micro_batch_tokens = 5000
    given, _, _ = autofit.plan_feeding(cfg, AutoChoices("cuda", "bf16", "sdpa"), lengths, None, False)
    assert given.rows_per_forward == 2  # whole rows of max_length within the budget


def test_varlen_forwards_are_sized_by_what_varlen_saves(monkeypatch):
    """The attention the model loads with reaches the planner: varlen compiled keeps no mask and recomputes the
    elementwise work, so more rows fit a budget than as padded SDPA; K/V copies (a kernel without GQA) cost some."""
    from rocktune.kernels import attention as A

    cfg = config_from_dict({"model": {"name_or_path": "Qwen2.5-0.5B"}, "data": {"train_file": "x", "max_length": 2048},
                            "training": {"micro_batch_size": 8, "grad_accum": 8}})
    lengths = [50 + (i * 37) % 1950 for i in range(500)]
    choices = AutoChoices("cuda", "bf16", "sdpa")
    sdpa, _, sdpa_peak = autofit.plan_feeding(cfg, choices, lengths, 24 * GIB, True)
    varlen, notes, peak = autofit.plan_feeding(cfg, choices, lengths, 24 * GIB, True, attn=A.VARLEN)
    assert (sdpa.rows_per_forward, varlen.rows_per_forward) == (5, 9) and peak < 24 * GIB
    monkeypatch.setattr(A, "varlen_kernel", lambda: lambda q, k, v, cq, ck, mq, mk, *, scale=None,
                        window_size=(-1, -1): None)  # torch 2.11's form: no enable_gqa
    eager, _, copies_peak = autofit.plan_feeding(cfg, choices, lengths, 24 * GIB, False, attn=A.VARLEN)
    assert eager.rows_per_forward < varlen.rows_per_forward


def test_loss_chunk_auto_by_device():
    assert autofit.loss_chunk("auto", "cpu") == 256 and autofit.loss_chunk("auto", "cuda") == 2048
    assert autofit.loss_chunk(512, "cuda") == 512


def test_compile_auto_only_on_sound_gpus_with_token_batching():
    assert build.want_compile("auto", True, "cuda", "auto")
    assert not build.want_compile("auto", False, "cuda", "auto")  # gfx906, RDNA (not measured), Windows
    assert not build.want_compile("auto", True, "cpu", "auto")
    assert not build.want_compile("auto", True, "cuda", "examples")
    assert not build.want_compile("auto", True, "cuda", "auto", world=2)  # no eager fallback for one rank of two
    assert build.want_compile(True, False, "cpu", "examples") and not build.want_compile(False, True, "cuda", "auto")


def test_a_compile_failure_falls_back_once_and_reruns_the_step():
    failure = type("BackendCompilerFailed", (RuntimeError,), {"__module__": "torch._dynamo.exc"})
    calls, fallbacks = [], []

    def attempt(pieces):
        calls.append(pieces)
        if len(calls) == 1:
            raise failure("inductor could not generate code")
        return torch.tensor(2.0)

    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    out, pieces = run_with_oom_recovery(attempt, opt, 1, 4, print, on_compile_error=fallbacks.append)
    assert float(out) == 2.0 and calls == [1, 1] and len(fallbacks) == 1
    with pytest.raises(RuntimeError, match="model bug"):  # any other error is not swallowed
        run_with_oom_recovery(lambda n: (_ for _ in ()).throw(RuntimeError("model bug")), opt, 1, 4, print,
                              on_compile_error=fallbacks.append)


def test_resume_refuses_a_checkpoint_of_the_other_batching_mode():
    class Restored:
        extra = {"batching": "tokens"}
        path = type("P", (), {"name": "step-00000004"})()

    resume.check_batching(Restored, "tokens")
    with pytest.raises(UserError, match="training.batching=tokens"):
        resume.check_batching(Restored, "examples")


@pytest.mark.parametrize("mode", ["tokens", "examples"])
def test_lockstep_gives_every_rank_as_many_forwards(mode):
    """FSDP gathers weights in every forward: ranks must run the same number, padded with idle batches."""
    feeds = [_feed(False, mode, r, 3, lockstep=True) for r in range(3)]
    for _ in range(6):
        steps = [f.next() for f in feeds]
        counts = {len(s.forwards) for s in steps}
        assert len(counts) == 1, counts
        real = [sum(1 for b in s.forwards if b != {"idle": True}) for s in steps]
        assert real[0] >= real[1] >= real[2]  # rank 0's round-robin share is the largest


def test_planner_per_rank_memory_for_ddp_and_fsdp():
    from rocktune.planner import RunSpec, estimate, load_shape

    shape = load_shape("Qwen2.5-7B")
    one = estimate(shape, RunSpec(precision="bf16", seq_len=1024))
    ddp = estimate(shape, RunSpec(precision="bf16", seq_len=1024, ranks=4, parallel="ddp"))
    fsdp = estimate(shape, RunSpec(precision="bf16", seq_len=1024, ranks=4, parallel="fsdp"))
    counts = shape.param_counts()
    assert ddp.by_name()["base_weights"] == one.by_name()["base_weights"] == shape.n_params * 2
    assert fsdp.by_name()["base_weights"] == counts["layers"] * 2 / 4 + (shape.n_params - counts["layers"]) * 2
    assert fsdp.by_name()["fsdp_gathered_layers"] == 2 * counts["layers"] // shape.layers * 2
    assert ddp.by_name()["gradient_buckets"] == ddp.by_name()["lora_grads"]
    assert fsdp.total_bytes < one.total_bytes < ddp.total_bytes


def test_parallel_auto_picks_fsdp_only_when_the_replicated_base_does_not_fit():
    cfg = config_from_dict({"model": {"name_or_path": "Qwen2.5-7B"}, "data": {"train_file": "x", "max_length": 1024}})
    assert autofit.choose_parallel(cfg, 1, "cuda", "bf16", "sdpa", 16 * GIB)[0] == "ddp"  # one process
    assert autofit.choose_parallel(cfg, 4, "cuda", "bf16", "sdpa", 80 * GIB)[0] == "ddp"
    chosen, notes = autofit.choose_parallel(cfg, 4, "cuda", "bf16", "sdpa", 20 * GIB)  # 15.2 GB of weights
    assert chosen == "fsdp" and "--parallel fsdp" in notes[0]
    assert autofit.choose_parallel(cfg, 4, "cpu", "fp32", "sdpa", None)[0] == "ddp"
    cfg.training.parallel = "fsdp"
    assert autofit.choose_parallel(cfg, 4, "cuda", "bf16", "sdpa", 80 * GIB)[0] == "fsdp"  # as asked


def test_lockstep_pads_the_parts_of_a_split_step():
    """FSDP with pieces > 1: a rank whose rows split into fewer parts still runs as many forwards as any other."""
    from rocktune.tasks.causal.split import split_rows
    from rocktune.train.faults import Faults
    from rocktune.train.step import StepRunner, forward_backward

    calls = []

    class Fake(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(()))

        def forward(self, batch):
            calls.append(batch["input_ids"].shape)
            return self.w * batch["loss_index"].numel()

    one_row = with_loss_index({"input_ids": torch.ones(1, 4, dtype=torch.long),
                               "labels": torch.tensor([[IGNORE, 1, 2, 3]])})
    idle = build.idle_batch(0)
    run = StepRunner(Fake(), "cpu", __import__("contextlib").nullcontext, torch.amp.GradScaler("cpu", enabled=False),
                     Faults({}), lockstep_idle=idle)
    total = forward_backward(run, [one_row, one_row], step_tokens=6, pieces=2, step=1, check_transfer=False,
                             split=split_rows)
    assert len(calls) == 4 and calls.count((1, 1)) == 2  # 2 unsplittable rows + 2 idle forwards
    assert float(total) == 6.0


def test_compiling_drops_only_the_mutation_analysis_traceback_from_the_log(caplog):
    """torch 2.11 logged one traceback per Liger kernel per graph on an H200 (8,659 lines in 8 steps); the filter
    drops that message alone: another torch._dynamo warning (a graph break, a recompile) still reaches the log."""
    import logging

    from rocktune.tasks.causal.build import quiet_compile_logs

    quiet_compile_logs()
    quiet_compile_logs()  # idempotent: one filter, however many runs compile in a process
    dynamo = logging.getLogger("torch._dynamo")
    assert sum(type(f).__name__ == "_QuietMutationAnalysis" for f in dynamo.filters) == 1
    with caplog.at_level(logging.WARNING, logger="torch._dynamo"):
        dynamo.warning("Encountered an exception in identify_mutated_tensors, assuming every input is mutated")
        dynamo.warning("Graph break: a user-visible warning")
    assert [r.getMessage() for r in caplog.records] == ["Graph break: a user-visible warning"]
