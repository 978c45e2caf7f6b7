"""Several processes through torchrun on the CPU (gloo, 2 ranks): the same result as one process, exact resume
after a killed rank, a hung rank named within the timeout, a preflight that catches a collective returning junk."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from safetensors.torch import load_file

pytestmark = [pytest.mark.long, pytest.mark.skipif(sys.platform == "win32", reason="gloo + torchrun on Linux/macOS")]


@pytest.fixture(scope="module")
def setup(tiny_model_dir, tmp_path_factory):
    from rocktune.demo.task import make_task
    from tests.conftest import write_jsonl

    tmp = tmp_path_factory.mktemp("dist")
    train, _ = make_task(n_train=256, n_eval=32, seed=1)
    return tiny_model_dir, write_jsonl(tmp / "train.jsonl", train), tmp


def config(setup, out: Path, **training) -> Path:
    model, data, tmp = setup
    t = {"max_steps": 6, "micro_batch_size": 8, "grad_accum": 2, "lr": 3e-3, "warmup_steps": 1, "eval_every": 0,
         "precision": "fp32", "device": "cpu", "seed": 0, **training}
    cfg = {"model": {"name_or_path": str(model)}, "lora": {"r": 8, "alpha": 16},
           "data": {"train_file": str(data), "eval_fraction": 0.0, "max_length": 64, "cache_dir": str(tmp / "cache")},
           "training": t, "reliability": {"save_every": 2, "collective_timeout_s": 15, "preflight_timeout_s": 30},
           "output": {"dir": str(out)}}
    path = out.with_suffix(".yaml")
    path.write_text(yaml.safe_dump(cfg))
    return path


def rocktune(*args, faults=None, env=None):
    full = dict(os.environ, OMP_NUM_THREADS="1", **(env or {}))
    if faults:
        full["ROCKTUNE_FAULTS"] = json.dumps(faults)
    return subprocess.run([sys.executable, "-m", "rocktune", *map(str, args)], env=full, capture_output=True,
                          text=True, timeout=600)


def losses(run: Path) -> list[float]:
    return [r["loss"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "loss" in r]


def adapter(run: Path) -> dict:
    return load_file(run / "adapter" / "adapter_model.safetensors")


@pytest.fixture(scope="module")
def reference(setup):
    """One process, and 2 ranks uninterrupted, examples batching: the runs the fault tests must reproduce."""
    _, _, tmp = setup
    one, two = tmp / "one", tmp / "two"
    assert rocktune("train", "-c", config(setup, one), "--no-supervise").returncode == 0
    res = rocktune("train", "-c", config(setup, two), "--no-supervise", "--nproc", 2)
    assert res.returncode == 0, res.stderr
    return one, two, res.stderr


def test_two_ranks_make_the_one_process_update(reference):
    one, two, stderr = reference
    assert losses(two) == pytest.approx(losses(one), rel=1e-6)
    a, b = adapter(one), adapter(two)
    assert a.keys() == b.keys() and max(float((a[k] - b[k]).abs().max()) for k in a) < 1e-6
    assert "2 ranks, gloo; preflight passed" in stderr
    assert stderr.count("preflight passed") == 1  # rank 1 stays quiet: rank 0 speaks for the group


def test_token_batching_across_ranks_matches_one_process(setup):
    _, _, tmp = setup
    one, two = tmp / "tok1", tmp / "tok2"
    assert rocktune("train", "-c", config(setup, one, batching="tokens", micro_batch_tokens=128),
                    "--no-supervise").returncode == 0
    res = rocktune("train", "-c", config(setup, two, batching="tokens", micro_batch_tokens=128), "--no-supervise",
                   "--nproc", 2)
    assert res.returncode == 0, res.stderr
    assert losses(two) == pytest.approx(losses(one), rel=1e-5)  # rows split between ranks: another summation order
    a, b = adapter(one), adapter(two)
    assert max(float((a[k] - b[k]).abs().max()) for k in a) < 5e-5


def test_killed_rank_stops_the_group_and_the_restart_is_exact(setup, reference):
    _, two, _ = reference
    _, _, tmp = setup
    run = tmp / "killed"
    res = rocktune("train", "-c", config(setup, run), "--nproc", 2,
                   faults={"kill_at_step": 3, "rank": 1, "marker": str(tmp / "killed.marker")})
    assert res.returncode == 0, res.stderr
    incidents = [json.loads(x) for x in (run / "incidents.jsonl").read_text().splitlines()]
    assert len(incidents) == 1 and incidents[0]["failed_rank"] == 1 and "SIGKILL" in incidents[0]["rank_cause"]
    assert losses(run) == losses(two)
    assert (run / "adapter" / "adapter_model.safetensors").read_bytes() == \
        (two / "adapter" / "adapter_model.safetensors").read_bytes()


def test_hung_rank_is_named_within_the_timeout_and_the_run_recovers(setup, reference):
    _, two, _ = reference
    _, _, tmp = setup
    run = tmp / "hung"
    res = rocktune("train", "-c", config(setup, run), "--nproc", 2,
                   faults={"hang": "1@step:3", "marker": str(tmp / "hung.marker")})
    assert res.returncode == 0, res.stderr
    assert "step 3" in res.stderr and "Rank 1" in res.stderr, res.stderr[-3000:]
    [incident] = [json.loads(x) for x in (run / "incidents.jsonl").read_text().splitlines()]
    assert (incident["failed_rank"], incident["noticed_by"]) == (1, 0)  # the rank that hung, not the one that saw it
    assert losses(run) == losses(two)


def test_preflight_catches_a_collective_that_returns_wrong_values(setup):
    _, _, tmp = setup
    run = tmp / "junk"
    res = rocktune("train", "-c", config(setup, run), "--nproc", 2, faults={"junk_all_reduce_rank": 1})
    assert res.returncode == 2, res.stderr
    assert "test all-reduce on gloo returned" in res.stderr and "wrong results" in res.stderr
    assert not run.exists()  # nothing written
    assert "Traceback" not in res.stderr


def test_resume_with_another_number_of_ranks_is_refused(setup, reference):
    _, two, _ = reference
    _, _, tmp = setup
    run = tmp / "partial"
    res = rocktune("train", "-c", config(setup, run), "--no-supervise", "--nproc", 2,
                   faults={"kill_at_step": 5, "rank": 0})
    assert res.returncode != 0
    res = rocktune("train", "-c", config(setup, run), "--no-supervise", "--resume")
    assert res.returncode == 2 and "--nproc 2" in res.stderr, res.stderr


def test_launch_arguments():
    from rocktune.process.launch import torchrun_args
    from rocktune.train.request import Launch

    assert torchrun_args(Launch(nproc=4)) == ["--nproc-per-node", "4", "--max-restarts", "0", "--standalone"]
    two_nodes = torchrun_args(Launch(nproc=8, nnodes=2, node_rank=1, master_addr="10.0.0.1", master_port=29501))
    assert two_nodes[-6:] == ["--node-rank", "1", "--master-addr", "10.0.0.1", "--master-port", "29501"]
    rdzv = torchrun_args(Launch(nproc=8, nnodes=2, rdzv_endpoint="head:29400"))
    assert "--rdzv-endpoint" in rdzv and "head:29400" in rdzv


def test_bad_launch_flags_are_user_errors(tmp_path):
    res = rocktune("train", "--nnodes", 2, "data.train_file=x.jsonl")
    assert res.returncode == 2 and "--master-addr" in res.stderr


def test_fsdp_shards_the_layers_and_trains_like_one_process(setup):
    """FSDP2 on gloo, with eval and sample generations (every rank must run them in step), token batching."""
    _, _, tmp = setup
    extra = {"batching": "tokens", "micro_batch_tokens": 128, "eval_every": 3, "sample_count": 1,
             "sample_max_new_tokens": 4}
    one, sharded = tmp / "fsdp1", tmp / "fsdp2"
    for run, args in ((one, []), (sharded, ["--nproc", 2])):
        cfg = config(setup, run, **extra)
        raw = yaml.safe_load(cfg.read_text())
        raw["data"]["eval_fraction"] = 0.1
        raw["training"]["parallel"] = "fsdp"
        cfg.write_text(yaml.safe_dump(raw))
        res = rocktune("train", "-c", cfg, "--no-supervise", *args)
        assert res.returncode == 0, res.stderr[-3000:]
    assert "decoder layers sharded over 2 ranks" in res.stderr
    assert losses(sharded) == pytest.approx(losses(one), rel=1e-5)
    def evals(run):
        return [r["eval_loss"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
                if "eval_loss" in r]
    assert len(evals(sharded)) == 3 and evals(sharded) == pytest.approx(evals(one), rel=1e-5)
    assert (sharded / "samples.jsonl").read_text() == (one / "samples.jsonl").read_text()
    a, b = adapter(one), adapter(sharded)
    assert max(float((a[k] - b[k]).abs().max()) for k in a) < 5e-5


def test_doctor_runs_the_preflight_alone():
    ok = rocktune("doctor", "--nproc", 2)
    assert ok.returncode == 0 and "2 ranks, gloo; preflight passed" in ok.stdout, ok.stderr[-2000:]
    bad = rocktune("doctor", "--nproc", 2, faults={"junk_all_reduce_rank": 0})
    assert bad.returncode == 2 and "wrong results" in bad.stderr


def test_ctrl_c_stops_every_rank_after_the_same_step_with_a_checkpoint(setup, reference):
    import signal
    import time

    _, two, _ = reference
    _, _, tmp = setup
    run = tmp / "ctrlc"
    env = dict(os.environ, OMP_NUM_THREADS="1", ROCKTUNE_FAULTS=json.dumps({"slow_steps": 1.0}))
    proc = subprocess.Popen([sys.executable, "-m", "rocktune", "train", "-c", str(config(setup, run)),
                             "--nproc", "2"], env=env, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 300
    while time.time() < deadline and not (run / "metrics.jsonl").is_file() or len(losses(run)) < 2:
        time.sleep(0.5)
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 130, stderr[-3000:]
    assert "interrupted: checkpoint at step" in stderr
    stopped = len(losses(run))
    assert (run / "checkpoints" / f"step-{stopped:07d}").is_dir() and stopped < 6
    res = rocktune("train", "-c", config(setup, run), "--nproc", 2, "--resume")
    assert res.returncode == 0, res.stderr[-3000:]
    assert losses(run) == losses(two)


def test_two_nodes_on_loopback_meet_through_the_preflight_and_train(setup, tmp_path):
    """Node 1 started first, node 0 two seconds later, one process each on 127.0.0.1: the preflight (process/
    rendezvous.py) lets them meet, hands the port to torchrun's static rendezvous, and both finish."""
    import socket
    import time

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    nodes = []
    for rank in (1, 0):
        out = tmp_path / f"node{rank}"  # rank 0 alone writes; the other node's directory stays its own
        argv = ["train", "-c", config(setup, out, max_steps=2), "--no-supervise", "--nproc", 1, "--nnodes", 2,
                "--node-rank", rank, "--master-addr", "127.0.0.1", "--master-port", port, "--rendezvous-timeout", 60]
        nodes.append(subprocess.Popen([sys.executable, "-m", "rocktune", *map(str, argv)], text=True,
                                      env=dict(os.environ, OMP_NUM_THREADS="1"), stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT))
        time.sleep(2)
    texts = [p.communicate(timeout=300)[0] for p in nodes]
    assert [p.returncode for p in nodes] == [0, 0], texts[1][-2000:] + texts[0][-2000:]
    assert all("rendezvous: node" in t and "waiting up to 60 s" in t for t in texts)
    assert len(losses(tmp_path / "node0")) == 2


@pytest.mark.parametrize("task", ["dpo", "orpo"])
def test_preference_pairs_across_two_ranks_match_one_process(setup, pair_files, task):
    """Each rank takes whole micro-batches of pairs (a pair never straddles ranks): the same losses and adapter."""
    _, _, tmp = setup
    runs = []
    for nproc in (1, 2):
        out = tmp / f"{task}{nproc}"
        path = config(setup, out, micro_batch_size=4, grad_accum=2)
        cfg = yaml.safe_load(path.read_text())
        cfg["task"], cfg["data"]["train_file"] = task, str(pair_files[0])
        path.write_text(yaml.safe_dump(cfg))
        res = rocktune("train", "-c", path, "--no-supervise", *(("--nproc", 2) if nproc == 2 else ()))
        assert res.returncode == 0, res.stderr[-3000:]
        runs.append(out)
    one, two = runs
    assert losses(two) == pytest.approx(losses(one), rel=1e-5)
    a, b = adapter(one), adapter(two)
    assert a.keys() == b.keys() and max(float((a[k] - b[k]).abs().max()) for k in a) < 5e-5
