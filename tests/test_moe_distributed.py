"""The MoE expert path on several processes (issue 54, item 6): a tiny Qwen3-MoE through torchrun on the CPU (gloo,
2 ranks) with DDP and FSDP2 gives one process's losses and adapter, a killed rank resumes exactly, and 4-bit expert
stacks are refused under FSDP2. The runs, configs and readers are tests/test_distributed.py's (the dense proofs)."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest
import yaml

from tests.test_distributed import adapter, config, losses, rocktune

pytestmark = [pytest.mark.long, pytest.mark.skipif(sys.platform == "win32", reason="gloo + torchrun on Linux/macOS")]

# What the dense FSDP test adds: every rank in lockstep through token batching, eval and sample generations.
FSDP_EXTRA = {"batching": "tokens", "micro_batch_tokens": 128, "eval_every": 3, "sample_count": 1,
              "sample_max_new_tokens": 4, "parallel": "fsdp"}
GROUPED = "expert LoRA: grouped on the routed tokens (2 MoE blocks"


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(model, data, tmp) as tests/test_distributed.py's ``config`` takes them: the family fixtures' Qwen3-MoE (2
    MoE layers of 4 experts, top-2) with expert widths of 64 (bitsandbytes' CPU nf4 kernel is wrong on rows of 32)
    and chat conversations."""
    from tests.conftest import write_jsonl
    from tests.family_fixtures import BY_NAME, build_family, chat_records

    tmp = tmp_path_factory.mktemp("moe_dist")
    family = BY_NAME["qwen3-moe"]
    model = build_family(dataclasses.replace(family, extra={**family.extra, "moe_intermediate_size": 64}),
                         tmp / "model")
    return model, write_jsonl(tmp / "train.jsonl", chat_records(256, True, seed=1)), tmp


def moe_config(setup, out: Path, quantization: str = "none", **training) -> Path:
    path = config(setup, out, **training)
    raw = yaml.safe_load(path.read_text())
    raw["model"]["quantization"] = quantization
    if training.get("eval_every"):
        raw["data"]["eval_fraction"] = 0.1
    path.write_text(yaml.safe_dump(raw))
    return path


def train(setup, name: str, nproc: int = 1, *flags, faults=None, **kwargs) -> tuple[Path, str]:
    out = setup[2] / name
    nprocs = ("--nproc", nproc) if nproc > 1 else ()
    res = rocktune("train", "-c", moe_config(setup, out, **kwargs), *flags, *nprocs, faults=faults)
    assert res.returncode == 0, res.stderr[-3000:]
    return out, res.stderr


def rows(run: Path, key: str) -> list:
    return [r[key] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if key in r]


def adapter_gap(one: Path, other: Path) -> float:
    a, b = adapter(one), adapter(other)
    assert a.keys() == b.keys() and any(".mlp.experts." in k for k in a)  # the expert LoRA is in the file
    return max(float((a[k] - b[k]).abs().max()) for k in a)


@pytest.fixture(scope="module")
def runs(setup):
    """Uninterrupted runs: one process and 2 DDP ranks (example batching); one process and 2 FSDP2 ranks (the
    dense FSDP test's lockstep settings). The kill tests must reproduce the 2-rank ones."""
    out = {"one": train(setup, "one", 1, "--no-supervise"), "ddp": train(setup, "ddp", 2, "--no-supervise"),
           "one_fsdp": train(setup, "one_fsdp", 1, "--no-supervise", **FSDP_EXTRA),
           "fsdp": train(setup, "fsdp", 2, "--no-supervise", **FSDP_EXTRA)}
    assert all(GROUPED in stderr for _, stderr in out.values())  # every run trained the grouped expert path
    return {k: run for k, (run, _) in out.items()} | {"fsdp_stderr": out["fsdp"][1]}


def test_two_ddp_ranks_make_the_one_process_update(runs):
    """DDP all-reduces the expert LoRA's gradients like the other adapter weights: the dense test's tolerances."""
    assert losses(runs["ddp"]) == pytest.approx(losses(runs["one"]), rel=1e-6)
    assert adapter_gap(runs["one"], runs["ddp"]) < 1e-6
    assert losses(runs["one"])[-1] < losses(runs["one"])[0] - 0.5  # it trained
    # the router metrics are the step's, summed over the ranks: what one process routes, not rank 0's half
    assert rows(runs["ddp"], "expert_load") == rows(runs["one"], "expert_load")
    assert rows(runs["ddp"], "router_aux_loss") == pytest.approx(rows(runs["one"], "router_aux_loss"), rel=1e-5)


def test_fsdp_shards_the_expert_stacks_and_trains_like_one_process(runs):
    """fully_shard on each decoder layer splits its expert stacks by expert like its 2-D weights (2 layers x
    gate_up and down), the grouped forward reads the gathered stacks; eval and samples run in lockstep."""
    assert "2 decoder layers sharded over 2 ranks" in runs["fsdp_stderr"]
    assert "(4 expert stacks among them, split by expert)" in runs["fsdp_stderr"]
    one, sharded = runs["one_fsdp"], runs["fsdp"]
    assert losses(sharded) == pytest.approx(losses(one), rel=1e-5)
    assert len(rows(sharded, "eval_loss")) == 3 and rows(sharded, "eval_loss") == pytest.approx(
        rows(one, "eval_loss"), rel=1e-5)
    assert (sharded / "samples.jsonl").read_text() == (one / "samples.jsonl").read_text()
    assert adapter_gap(one, sharded) < 5e-5


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_a_killed_rank_resumes_exactly(setup, runs, parallel):
    """Rank 1 SIGKILLed at step 3; the supervisor restarts the group from the step-2 checkpoint: the losses, the
    expert load (the router hooks' counts, summed over the ranks) and the adapter bytes are the uninterrupted
    run's."""
    extra = FSDP_EXTRA if parallel == "fsdp" else {}
    run, _ = train(setup, f"killed_{parallel}", 2, faults={"kill_at_step": 3, "rank": 1,
                                                          "marker": str(setup[2] / f"{parallel}.marker")}, **extra)
    [incident] = [json.loads(x) for x in (run / "incidents.jsonl").read_text().splitlines()]
    assert incident["failed_rank"] == 1 and "SIGKILL" in incident["rank_cause"]
    whole = runs[parallel]
    assert losses(run) == losses(whole)
    assert rows(run, "expert_load") == rows(whole, "expert_load") and len(rows(run, "expert_load")) == 6
    assert (run / "adapter" / "adapter_model.safetensors").read_bytes() == \
        (whole / "adapter" / "adapter_model.safetensors").read_bytes()


def test_4bit_expert_stacks_train_on_ddp_ranks_like_one_process(setup):
    """model.quantization=nf4: every rank holds the 4-bit stacks whole (lora/moe_nf4.py), DDP averages the
    adapter's gradients; the same losses and adapter as one process."""
    pytest.importorskip("bitsandbytes")
    one, stderr = train(setup, "nf4_one", 1, "--no-supervise", quantization="nf4")
    two, _ = train(setup, "nf4_ddp", 2, "--no-supervise", quantization="nf4")
    assert "(stacks in 4 bit, dequantised per expert)" in stderr
    assert losses(two) == pytest.approx(losses(one), rel=1e-6)
    assert adapter_gap(one, two) < 1e-6


def test_4bit_expert_stacks_under_fsdp_are_refused_before_any_worker(setup):
    """The 4-bit stacks are bitsandbytes' packed bytes held beside the module, not parameters FSDP could split:
    refused at launch (train/prelaunch.py), with the way out, and nothing written."""
    out = setup[2] / "nf4_fsdp"
    res = rocktune("train", "-c", moe_config(setup, out, quantization="nf4", parallel="fsdp"), "--nproc", 2)
    assert res.returncode == 2, res.stderr[-3000:]
    assert "training.parallel=fsdp with model.quantization: FSDP does not shard bitsandbytes' packed weights" in \
        res.stderr and "use training.parallel=ddp" in res.stderr
    assert "Traceback" not in res.stderr and not out.exists()
