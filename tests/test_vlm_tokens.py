"""training.batching: tokens for task=vlm: a step's conversations packed (with their images) into rows of
data.max_length and cut into forwards of rows, as the text tasks' token batching does. One step equals the same
conversations fed as examples; a token-batched run trains, says so, resumes exactly after SIGKILL; the feed's
prefetch, resume position and rank shares; the GPU sizing of micro_batch_tokens: auto; what is refused."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest

from rocktune.config import config_from_dict, refuse_inapplicable
from rocktune.errors import UserError
from rocktune.tasks import refuse_before_launch, train
from rocktune.tasks.vlm import launch
from rocktune.tasks.vlm.launch import transformers_major
from rocktune.train.request import RunOptions
from tests.test_task_contract import run_worker
from tests.test_vlm_train import _metrics, vlm_config

GIB = 2**30
# token batching packs: transformers 4's Qwen-VL models attend across packed conversations (refused: a test below)
needs_5 = pytest.mark.skipif(transformers_major() < 5, reason="packed vlm rows need transformers 5")


@pytest.fixture(scope="module")
def colours(tmp_path_factory) -> tuple[Path, Path]:
    from rocktune.tasks.vlm.demo.vision_task import write_colour_task

    return write_colour_task(tmp_path_factory.mktemp("colours"), n_train=48, n_eval=8, seed=0)


def _tokens_config(vlm_dir: Path, colours, out: Path, **training) -> dict:
    """A colour conversation is about 56 tokens: a row of 240 holds about 4."""
    cfg = vlm_config(vlm_dir, colours, out, **{"micro_batch_size": 4, "grad_accum": 2, "max_steps": 8,
                                               "batching": "tokens", **training})
    cfg["data"]["max_length"] = 240
    return cfg


def _encoded(vlm_dir: Path, file: Path, max_length: int = 240):
    from transformers import AutoConfig

    from rocktune.data.records import read_records
    from rocktune.tasks.vlm.data.vision import encode
    from rocktune.models.load import load_tokenizer
    from rocktune.tasks.vlm.vision.model import vision_tokens

    tok = load_tokenizer(str(vlm_dir), False)
    vision = vision_tokens(str(vlm_dir), AutoConfig.from_pretrained(vlm_dir), tok, None, None)
    return [encode(r, file.parent, tok, vision, max_length, loc) for loc, r in read_records(file)], tok, vision


@needs_5
def test_one_token_batched_step_is_the_example_batched_step(vlm_dir, colours, tmp_path):
    """The same 48 conversations in one optimizer step: 48 padded rows in one forward, or packed into rows of 240 and
    cut into forwards of 4 rows. The step's loss (normalised by its loss tokens) and every adapter weight after the
    AdamW update agree, so packing, the block-diagonal attention, the 3-D positions and the normaliser are right."""
    import torch

    runs = {}
    for mode, extra in (("examples", {}), ("tokens", {"micro_batch_tokens": 4 * 240})):
        cfg = _tokens_config(vlm_dir, colours, tmp_path / mode, max_steps=1, micro_batch_size=48, grad_accum=1,
                             batching=mode, warmup_steps=0, lr=1e-3, **extra)
        runs[mode] = train(config_from_dict(cfg), quiet=True)
    ex, tok = runs["examples"], runs["tokens"]
    assert tok.losses == pytest.approx(ex.losses, rel=1e-5)
    a = {n: p for n, p in ex.model.named_parameters() if p.requires_grad}
    b = {n: p for n, p in tok.model.named_parameters() if p.requires_grad}
    assert a.keys() == b.keys() and a
    # AdamW's first update is about lr x g / (|g| + 1e-8): a masking or normalisation error moves weights by the
    # order of lr (1e-3). The summation order (one forward of 48 rows, or 3 of 4 packed rows) moves the one entry of
    # 65,536 whose gradient is near 1e-8 by 1.1% of lr (1.1e-5; 3.3e-5 at lr 3e-3), the rest by under 5e-6.
    assert all(torch.allclose(a[n], b[n], atol=2e-5) for n in a)
    step = next(r for r in _metrics(tmp_path / "tokens") if "loss" in r)
    # 48 conversations of ~56 tokens fill about 12 rows of 240: 3 forwards of at most 4 rows, all 48 images
    assert step["images"] == 48 and 2 < step["forwards"] <= 4
    assert step["real_tokens"] <= step["batch_tokens"] <= step["forwards"] * 4 * 240


@needs_5
def test_a_token_batched_run_trains_and_says_so(vlm_dir, colours, tmp_path):
    run = tmp_path / "run"
    train(config_from_dict(_tokens_config(vlm_dir, colours, run, max_steps=30, eval_every=10,
                                          micro_batch_tokens=240)), quiet=True)
    steps = [r for r in _metrics(run) if "loss" in r]
    evals = [r["eval_loss"] for r in _metrics(run) if "eval_loss" in r]
    assert evals[-1] < 0.5 * evals[0]
    # the global batch is in examples: 8 conversations a step whatever the rows; 8 x ~56 tokens are 2 rows of 240,
    # one row a forward (micro_batch_tokens 240)
    assert all(s["images"] == 8 and s["forwards"] == 2 for s in steps)
    assert all(s["real_tokens"] <= s["batch_tokens"] <= 2 * 240 for s in steps)
    info = json.loads((run / "run_info.json").read_text())
    assert info["data"]["batching"] == "tokens"
    assert any(n.startswith("batching: tokens — 8 examples per optimizer step packed into rows of 240, up to 1 rows")
               for n in info["notes"]), info["notes"]


@needs_5
def test_a_token_batched_run_resumes_exactly_after_sigkill(vlm_dir, colours, tmp_path):
    from safetensors.torch import load_file

    ref, run = tmp_path / "ref", tmp_path / "run"
    keys = ("step", "loss", "samples", "images")
    configs = [_tokens_config(vlm_dir, colours, d) for d in (ref, run)]
    for c in configs:
        c["reliability"]["save_every"] = 2
    train(config_from_dict(configs[0]), quiet=True)
    cfg = configs[1]
    assert run_worker(cfg, {"kill_at_step": 5}).returncode == -signal.SIGKILL
    train(config_from_dict(cfg), RunOptions(resume=True), quiet=True)
    trim = [[{k: r[k] for k in keys if k in r} for r in _metrics(d) if "loss" in r] for d in (ref, run)]
    assert len(trim[0]) == 8 and trim[0] == trim[1]
    got, want = (load_file(d / "adapter" / "adapter_model.safetensors") for d in (run, ref))
    assert all(got[k].equal(want[k]) for k in want)
    # the checkpoint says its mode: resumed as examples (even forced past the config check), its position (whole
    # steps) would mean other conversations
    cfg["training"]["batching"] = "examples"
    with pytest.raises(UserError, match=r"written with batching=tokens.*Resume with training.batching=tokens"):
        train(config_from_dict(cfg), RunOptions(resume=True, resume_force=True), quiet=True)


def test_the_token_feed_prefetches_resumes_and_deals_rows_to_ranks(vlm_dir, colours):
    """Each step holds micro_batch_size x grad_accum conversations, drawn without a length sort, every one once an
    epoch; prefetching and a resumed feed hand out the same batches and positions; two ranks' forwards are one
    process's rows dealt round-robin, with the same normaliser, and a rank without rows runs the idle batch."""
    import torch

    from rocktune.tasks.vlm.data.vision_pack import collate_packed
    from rocktune.tasks.vlm.feed import TokenVisionFeed

    examples, tok, vision = _encoded(vlm_dir, colours[0])

    def batch(rows):
        return collate_packed(rows, tok.pad_token_id, vision)

    def walk(feed, n):
        out = []
        for _ in range(n):
            step = feed.next()
            out.append((step.loss_tokens, feed.position(), step.picked,
                        [{k: v.clone() for k, v in f.items()} for f in step.forwards]))
        feed.close()
        return out

    shape = (4, 2, 0)
    plain = walk(TokenVisionFeed(examples, shape, batch, rows=(240, 1)), 6)
    seen = [i for _, _, picked, _ in plain for forward in picked for row in forward for i in row]
    assert len(seen) == 48 and sorted(seen) == list(range(48))  # 6 steps of 8: one epoch, each conversation once
    assert plain[0][1] == {"epoch": 0, "index": 1}  # the position counts whole steps
    assert all(sum(len(e.input_ids) for e in (examples[i] for i in row)) <= 240
               for _, _, picked, _ in plain for forward in picked for row in forward)
    ahead = walk(TokenVisionFeed(examples, shape, batch, prefetch=True, rows=(240, 1)), 6)
    resumed = walk(TokenVisionFeed(examples, shape, batch, prefetch=True, rows=(240, 1), **plain[2][1]), 3)
    for got in (ahead, [None] * 3 + resumed):
        for want, step in zip(plain, got):
            if step is None:
                continue
            assert step[:3] == want[:3]
            assert all(torch.equal(a[k], b[k]) for a, b in zip(step[3], want[3]) for k in a)
    idle = {"input_ids": torch.zeros(1, 1, dtype=torch.long)}
    one = TokenVisionFeed(examples, (1, 2, 0), batch, rows=(240, 4)).next()  # 2 conversations: one row
    ranks = [TokenVisionFeed(examples, (1, 2, 0), batch, share=(r, 2, idle), rows=(240, 4)).next() for r in (0, 1)]
    assert ranks[0].picked == one.picked and ranks[1].picked == [] and ranks[1].forwards == [idle]
    assert ranks[0].loss_tokens == ranks[1].loss_tokens == one.loss_tokens > 0
    whole = TokenVisionFeed(examples, (8, 2, 0), batch, rows=(240, 1)).next()
    dealt = [TokenVisionFeed(examples, (8, 2, 0), batch, share=(r, 2, idle), rows=(240, 1)).next() for r in (0, 1)]
    rows = [f[0] for f in whole.picked]
    assert [f[0] for f in dealt[0].picked] == rows[0::2] and [f[0] for f in dealt[1].picked] == rows[1::2]


def test_micro_batch_tokens_is_whole_rows_given_or_two_on_a_cpu_and_sized_by_the_vlm_planner_on_a_gpu(vlm_dir,
                                                                                                     colours):
    from rocktune.tasks.vlm.autofit import densest, plan_feeding

    examples, _, _ = _encoded(vlm_dir, colours[0])
    cfg = config_from_dict(_tokens_config(vlm_dir, colours, Path("out"), micro_batch_size=16, grad_accum=2))
    # 32 conversations of ~56 tokens: 8 rows of 240, one more for packing slack; more rows per forward buy nothing
    cap = 9
    cpu, notes, peak = plan_feeding(cfg, "cpu", "fp32", examples, None)
    assert (cpu.mode, cpu.rows_per_forward, peak) == ("tokens", 2, None)
    assert notes == ["batching: tokens — 32 examples per optimizer step packed into rows of 240, up to 2 rows (480 "
                     "tokens) per forward"]
    big, notes, peak = plan_feeding(cfg, "cuda", "bf16", examples, 80 * GIB)
    assert big.rows_per_forward == cap and peak < 80 * GIB and "(all a step holds)" in notes[1]
    assert "sized by the vlm planner as SDPA with a materialised mask" in notes[1]
    # a budget between one row's need and the whole step's: fewer rows, still within it
    from rocktune.planner.fit import MARGIN
    from rocktune.tasks.vlm.planner.vlm import VLMSpec, estimate_vlm, load_vlm_shape

    text, shape = load_vlm_shape(str(vlm_dir))

    def need(rows):
        spec = VLMSpec(micro_batch=rows, seq_len=240, patches=densest(examples, rows * 240), lora_r=16,
                       precision="bf16", loss_fraction=1.0, padded=True, loss_chunk=2048)
        return estimate_vlm(text, shape, spec).total_bytes

    budget = int(need(4) / (1 - MARGIN)) + 1
    mid, _, peak = plan_feeding(cfg, "cuda", "bf16", examples, budget)
    assert 1 <= mid.rows_per_forward <= 4 < cap and peak < budget
    with pytest.raises(UserError, match=r"one packed row of data.max_length=240 .* training.batching: examples"):
        plan_feeding(cfg, "cuda", "bf16", examples, need(1) // 2)
    cfg.training.micro_batch_tokens = 1000  # taken as given: whole rows of max_length
    given, _, _ = plan_feeding(cfg, "cuda", "bf16", examples, None)
    assert given.rows_per_forward == 4
    # the densest conversations come first: every one of the colour task has one image
    assert len(densest(examples, 240)) == 5 and len(densest(examples, 0)) == 0


def test_auto_batching_stays_examples_for_vlm(vlm_dir, colours):
    from rocktune.tasks.vlm.autofit import plan_feeding

    examples, _, _ = _encoded(vlm_dir, colours[0])
    cfg = config_from_dict(vlm_config(vlm_dir, colours, Path("out")))
    for device in ("cpu", "cuda"):
        feeding, notes, peak = plan_feeding(cfg, device, "fp32", examples, None)
        assert (feeding.mode, peak) == ("examples", None)
        assert notes == ["batching: examples — 8 examples (batch_order mixed) per forward x 1 = 8 per optimizer step "
                         "(auto: examples for task=vlm on every device)"]


@pytest.mark.parametrize("task", ["dpo", "orpo", "grpo", "video-lora"])
def test_token_batching_is_taken_for_vlm_and_still_refused_where_it_cannot_work(tmp_path, task):
    training = {"batching": "tokens", "micro_batch_tokens": 480}
    vlm = vlm_config(Path("m"), (Path("t.jsonl"), Path("e.jsonl")), tmp_path / "run", **training)
    refuse_inapplicable(config_from_dict(vlm))  # no refusal
    other = config_from_dict({"task": task, "model": {"name_or_path": "m"}, "data": {"train_file": "t"},
                              "training": training})
    with pytest.raises(UserError, match=r"training.batching=tokens, training.micro_batch_tokens=480: only for "
                                        rf"task=lm, vlm. Not supported for task={task}"):
        refuse_inapplicable(other)


def test_what_token_batching_cannot_do_is_refused(monkeypatch, tmp_path):
    from rocktune.tasks.vlm.vision.model import check_data_settings

    cfg = vlm_config(Path("m"), (Path("t.jsonl"), Path("e.jsonl")), tmp_path / "run", batching="tokens")
    with pytest.raises(UserError, match=r"--auto plans task=vlm's rows one conversation each; with "
                                        r"training.batching=tokens"):
        refuse_before_launch(config_from_dict(cfg), RunOptions(auto_fit=True))
    with pytest.raises(UserError, match=r"training.batching=tokens with task=vlm packs Qwen-VL conversations .*"
                                        r"Gemma 3 would need its own, so set training.batching: examples"):
        check_data_settings("gemma3", None, None, "training.batching=tokens")
    check_data_settings("qwen2_5_vl", None, None, "training.batching=tokens")  # Qwen packs
    monkeypatch.setattr(launch, "transformers_major", lambda: 4)
    with pytest.raises(UserError, match=r"training.batching=tokens with task=vlm needs transformers 5 .* Drop "
                                        r"training.batching=tokens"):
        refuse_before_launch(config_from_dict(cfg), RunOptions())


@needs_5
def test_the_oom_split_cuts_a_token_forward_between_rows(vlm_dir, colours):
    """An out-of-memory retry runs a forward of packed rows as pieces of whole rows, each with its own images: their
    summed loss and loss-token count are the whole forward's."""
    from rocktune.tasks.vlm.data.vision_pack import collate_packed
    from rocktune.tasks.vlm.feed import TokenVisionFeed
    from rocktune.tasks.vlm.loss import VisionLoss
    from tests.test_vlm_packing import _model

    examples, tok, vision = _encoded(vlm_dir, colours[0])
    feed = TokenVisionFeed(examples, (16, 1, 0), lambda rows: collate_packed(rows, tok.pad_token_id, vision),
                           rows=(240, 8))
    (forward,) = feed.next().forwards
    pieces = feed.split(forward, feed.max_pieces(forward))
    assert len(pieces) == forward["input_ids"].shape[0] >= 4  # 16 conversations of ~56 tokens: 4-5 rows of 240
    assert sum(int(p["image_counts"].sum()) for p in pieces) == 16
    loss = VisionLoss(_model(vlm_dir), chunk_size=7)
    whole, count = loss.sum_and_count(forward)
    parts = [loss.sum_and_count(p) for p in pieces]
    assert sum(n for _, n in parts) == count
    assert float(sum(v for v, _ in parts)) == pytest.approx(float(whole), rel=1e-5)
