"""task: grpo over two ranks (torchrun, gloo, CPU): each rank samples a share of every step's prompts, yet the run is
one process's — the same completions (sample digests), rewards, losses and adapter — and a rank killed mid-run is
restarted from its checkpoint into the uninterrupted run's bytes."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import yaml

from tests.conftest import write_jsonl
from tests.test_distributed import adapter, rocktune

pytestmark = [pytest.mark.long, pytest.mark.skipif(sys.platform == "win32", reason="gloo + torchrun on Linux/macOS")]

# What must be equal exactly (same completions, same rewards) and what only within float tolerance (another
# summation order: each rank's forwards hold other rows, and the gradients are summed over ranks).
EXACT = ("samples", "reward", "reward_std", "rewards/exact/mean", "rewards/regex/mean", "completions/mean_length",
         "completions", "tokens", "real_tokens", "frac_reward_zero_std", "eval_reward")
CLOSE = ("loss", "kl", "grad_norm")


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    from rocktune.demo.task import make_task

    rows, held = make_task(n_train=7, n_eval=5, seed=2)
    tmp = tmp_path_factory.mktemp("grpo_nproc")

    def prompts(name, part):
        return write_jsonl(tmp / name, [{"prompt": r["prompt"], "answer": r["completion"]} for r in part])
    return prompts("train.jsonl", rows), prompts("eval.jsonl", held), tmp


def config(model: Path, files, out: Path, **grpo) -> Path:
    """7 prompts, 2 a step: each epoch's last step holds one, so one rank's share is empty there (an idle forward);
    5 held-out prompts: uneven eval shares."""
    train, held, tmp = files
    cfg = {"task": "grpo", "model": {"name_or_path": str(model)}, "lora": {"r": 8, "alpha": 16},
           "data": {"train_file": str(train), "eval_file": str(held), "max_length": 32,
                    "cache_dir": str(tmp / "cache")},
           "grpo": {"num_generations": 4, "max_completion_length": 6, "beta": 0.05, "top_k": 30,
                    "rewards": [{"function": "exact"}, {"function": "regex", "pattern": "[A-Z]", "weight": 0.5}],
                    **grpo},
           "training": {"max_steps": 6, "micro_batch_size": 2, "grad_accum": 4, "lr": 5e-3, "warmup_steps": 0,
                        "eval_every": 3, "precision": "fp32", "device": "cpu", "seed": 0},
           "reliability": {"save_every": 2, "collective_timeout_s": 30, "preflight_timeout_s": 60},
           "output": {"dir": str(out)}}
    path = out.with_suffix(".yaml")
    path.write_text(yaml.safe_dump(cfg))
    return path


def rows(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


def assert_same_run(a: Path, b: Path) -> None:
    ra, rb = rows(a), rows(b)
    assert len(ra) == len(rb)
    for x, y in zip(ra, rb):
        assert x.get("step") == y.get("step")
        for key in EXACT:
            assert x.get(key) == y.get(key), (x.get("step"), key, x.get(key), y.get(key))
        for key in CLOSE:
            if key in x:
                assert y[key] == pytest.approx(x[key], rel=1e-5, abs=1e-7), (x["step"], key)
    wa, wb = adapter(a), adapter(b)
    assert wa.keys() == wb.keys() and max(float((wa[k] - wb[k]).abs().max()) for k in wa) < 5e-5


@pytest.mark.parametrize("grpo", [{"loss_type": "dapo", "scale_rewards": "batch", "beta": 0.0}, {"loss_type": "grpo"}],
                         ids=["dapo-batch-std-beta0", "grpo"])
def test_two_ranks_train_the_one_process_run(tiny_model_dir, files, grpo):
    """dapo: the normaliser is the whole step's completion tokens, and ``batch``'s std the whole step's rewards:
    both need the other rank's share; at beta 0 the completions whose advantage is 0 get no forward, so the ranks'
    forwards hold different rows. grpo: per-sequence means, per-group std."""
    _, _, tmp = files
    name = "-".join(f"{v}" for v in grpo.values())
    one, two = tmp / f"one-{name}", tmp / f"two-{name}"
    res = rocktune("train", "-c", config(tiny_model_dir, files, one, **grpo), "--no-supervise")
    assert res.returncode == 0, res.stderr[-3000:]
    res = rocktune("train", "-c", config(tiny_model_dir, files, two, **grpo), "--no-supervise", "--nproc", 2)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "2 ranks, gloo; preflight passed" in res.stderr
    steps = [r for r in rows(two) if "loss" in r]
    assert len(steps) == 6 and [r["completions"] for r in steps] == [8, 8, 8, 4, 8, 8]  # step 4: one prompt
    assert any("eval_reward" in r for r in rows(two))
    if grpo.get("beta") == 0.0:
        assert sum(r["zero_advantage_skipped"] for r in steps) > 0  # the skip is what ran
        assert [r["zero_advantage_skipped"] for r in steps] == [r["zero_advantage_skipped"] for r in rows(one)
                                                                if "loss" in r]
    assert_same_run(one, two)


def test_a_killed_rank_restarts_into_the_uninterrupted_run(tiny_model_dir, files):
    """Rank 1 is killed at step 3; the supervisor restarts both ranks from step 2's checkpoint: the same metrics
    (completions included: the draws are keyed, nothing of a generator's to lose) and the same adapter bytes."""
    _, _, tmp = files
    whole, killed = tmp / "whole", tmp / "killed"
    res = rocktune("train", "-c", config(tiny_model_dir, files, whole), "--no-supervise", "--nproc", 2)
    assert res.returncode == 0, res.stderr[-3000:]
    res = rocktune("train", "-c", config(tiny_model_dir, files, killed), "--nproc", 2,
                   faults={"kill_at_step": 3, "rank": 1, "marker": str(tmp / "killed.marker")})
    assert res.returncode == 0, res.stderr[-3000:]
    incidents = [json.loads(x) for x in (killed / "incidents.jsonl").read_text().splitlines()]
    assert len(incidents) == 1 and incidents[0]["failed_rank"] == 1
    keys = EXACT + CLOSE + ("lr",)
    assert [{k: r.get(k) for k in keys} for r in rows(killed)] == [{k: r.get(k) for k in keys} for r in rows(whole)]
    wa, wb = adapter(whole), adapter(killed)
    assert all(bool((wa[k] == wb[k]).all()) for k in wa)
