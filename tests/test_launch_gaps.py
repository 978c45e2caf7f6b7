"""The gaps left open by the hostile-input round (issue 39, item 4): the pre-launch resume check trusts only a
meta.json that matches its manifest; a data file rejected after datasets read it leaves no Arrow copy in the cache;
a JSONL file over 64 MiB is checked before a child starts, streamed in bounded memory; a c10d ``--rdzv-endpoint``
gets the socket preflight a ``--master-addr`` gets."""

from __future__ import annotations

import hashlib
import json
import socket
import time
import tracemalloc
from pathlib import Path

import pytest
import yaml

from rocktune.errors import UserError
from tests.test_bad_input import _lm_config, _no_workers, free_port, refused


# --- (a) the pre-launch resume check verifies the hash of what it reads ---------------------------------------------

def _checkpoint(root: Path, step: int, world: int, tamper: bool = False) -> Path:
    path = root / f"step-{step:07d}"
    path.mkdir(parents=True)
    meta = json.dumps({"step": step, "extra": {"world_size": world}}).encode()
    (path / "manifest.json").write_text(json.dumps({"sha256": {"meta.json": hashlib.sha256(meta).hexdigest()}}))
    if tamper:  # edited after the manifest was written (by hand, or a torn write of another size)
        meta = json.dumps({"step": step, "extra": {"world_size": 1}}).encode()
    (path / "meta.json").write_bytes(meta)
    return path


def test_prelaunch_world_check_trusts_only_a_meta_that_matches_its_manifest(tmp_path):
    from rocktune.train.prelaunch import saved_world
    from rocktune.train.resume import check_world_before_launch

    root = tmp_path / "checkpoints"
    _checkpoint(root, 2, world=2)
    _checkpoint(root, 4, world=2, tamper=True)  # says 1 process: unverified, so not believed
    (root / "step-0000006").mkdir()  # a partial write: meta.json, no manifest
    (root / "step-0000006" / "meta.json").write_text(json.dumps({"step": 6, "extra": {"world_size": 1}}))
    assert saved_world(root) == ("step-0000002", 2)
    with pytest.raises(UserError, match="checkpoint step-0000002 was written by 2 process"):
        check_world_before_launch(root, 1, force=False)
    check_world_before_launch(root, 2, force=False)


# --- (b) a rejected data file leaves no Arrow copy in datasets' cache -------------------------------------------

def _arrow(cache: Path) -> set[Path]:
    return set((cache / "sources").rglob("*.arrow")) if (cache / "sources").is_dir() else set()


def test_a_rejected_data_file_leaves_no_arrow_copy(tokenizer, tmp_path):
    """CSV goes through datasets' Arrow copy; every record empty is rejected after that copy was made."""
    from rocktune.config import DataConfig
    from rocktune.data.dataset import prepare_data

    cache = tmp_path / "cache"
    good, bad = tmp_path / "good.csv", tmp_path / "bad.csv"
    good.write_text("prompt,completion\n" + "".join(f"q{i},a{i}\n" for i in range(8)))
    bad.write_text("prompt,completion\n" + "".join(f"q{i},\n" for i in range(8)))
    prepare_data(DataConfig(train_file=str(good), eval_fraction=0.25, max_length=64), tokenizer, cache, 0)
    kept = _arrow(cache)
    assert kept  # the accepted file's copy stays (the next run's cache hit)
    with pytest.raises(UserError, match="empty 'completion'"):
        prepare_data(DataConfig(train_file=str(bad), eval_fraction=0.25, max_length=64), tokenizer, cache, 0)
    assert _arrow(cache) == kept


def test_a_rejected_pairs_file_leaves_no_arrow_copy(tokenizer, tiny_model_dir, tmp_path):
    """Preference pairs from CSV are read through datasets too; a pair with an empty answer is refused after."""
    from rocktune.config import config_from_dict
    from rocktune.tasks.preference.task import _read_pairs

    cache = tmp_path / "cache"
    good, bad = tmp_path / "good.csv", tmp_path / "bad.csv"
    good.write_text("prompt,chosen,rejected\n" + "".join(f"q{i}, yes{i}, no{i}\n" for i in range(6)))
    bad.write_text("prompt,chosen,rejected\n" + "".join(f"q{i}, yes{i},{'' if i == 3 else f' no{i}'}\n"
                                                       for i in range(6)))

    def cfg(data: Path):
        return config_from_dict({"task": "dpo", "model": {"name_or_path": str(tiny_model_dir)},
                                 "data": {"train_file": str(data), "max_length": 64, "cache_dir": str(cache)},
                                 "training": {"device": "cpu"}, "output": {"dir": str(tmp_path / "run")}})

    _read_pairs(cfg(good), tokenizer, cache)
    kept = _arrow(cache)
    assert kept
    with pytest.raises(UserError, match="'rejected' answer is empty"):
        _read_pairs(cfg(bad), tokenizer, cache)
    assert _arrow(cache) == kept


# --- (c) a JSONL file over 64 MiB is checked before a child starts, in bounded memory -------------------------------

BIG_LINE = json.dumps({"prompt": "q " * 200, "completion": "a " * 300}) + "\n"


@pytest.fixture(scope="module")
def big_jsonl(tmp_path_factory) -> tuple[Path, int]:
    """Just over 64 MiB of valid records with one torn line near the end; (path, its line number)."""
    from rocktune.tasks.causal.launch import PRECHECK_MAX_BYTES

    path = tmp_path_factory.mktemp("big") / "train.jsonl"
    n = PRECHECK_MAX_BYTES // len(BIG_LINE) + 64
    bad_line = n - 10
    with open(path, "w") as f:
        for i in range(1, n + 1):
            f.write(BIG_LINE if i != bad_line else BIG_LINE[:40] + "\n")
    assert path.stat().st_size > PRECHECK_MAX_BYTES
    return path, bad_line


def test_a_big_jsonl_is_streamed_with_bounded_memory_and_names_file_line(big_jsonl, tmp_path):
    from rocktune.config import config_from_dict
    from rocktune.tasks import precheck

    path, bad_line = big_jsonl
    cfg = _lm_config(tmp_path)
    cfg["data"]["train_file"] = str(path)
    tracemalloc.start()
    try:
        with pytest.raises(UserError) as info:
            precheck(config_from_dict(cfg))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert f"{path}:{bad_line}:" in str(info.value) and "1 line of" in str(info.value)
    assert peak < 4 << 20, f"the check held {peak / 2**20:.1f} MiB of a {path.stat().st_size >> 20} MiB file"


def test_a_big_jsonl_is_refused_before_a_child_starts(big_jsonl, tmp_path, capsys, monkeypatch):
    _no_workers(monkeypatch)
    path, bad_line = big_jsonl
    cfg = _lm_config(tmp_path)
    cfg["data"]["train_file"] = str(path)
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(cfg))
    err = refused(capsys, ["train", "-c", str(config)], tmp_path)
    assert f"{path}:{bad_line}:" in err


# --- (d) --rdzv-endpoint gets the socket preflight of --master-addr ------------------------------------------------

def test_rdzv_endpoint_on_an_occupied_port_is_refused_before_a_child_starts(tmp_path, capsys, monkeypatch):
    _no_workers(monkeypatch)
    port = free_port()
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(_lm_config(tmp_path)))
    with socket.socket() as holder:
        holder.bind(("0.0.0.0", port))
        holder.listen()
        err = refused(capsys, ["train", "-c", str(config), "--nproc", "2", "--rdzv-endpoint", f"127.0.0.1:{port}"],
                      tmp_path)
    assert f"--rdzv-endpoint 127.0.0.1:{port}: port {port} is already in use" in err
    assert "nothing was started or written" in err


@pytest.mark.parametrize("endpoint, words", [
    ("192.0.2.1:{port}", ["did not answer within 1 s", "node 1 of 2", "--rendezvous-timeout"]),  # TEST-NET-1
    ("head-node", ["expected HOST:PORT"]),
    ("head-node:http", ["expected HOST:PORT"]),
])
def test_rdzv_endpoint_that_cannot_be_reached_is_named_within_the_bound(tmp_path, capsys, monkeypatch, endpoint,
                                                                        words):
    _no_workers(monkeypatch)
    port = free_port()
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(_lm_config(tmp_path)))
    t0 = time.monotonic()
    err = refused(capsys, ["train", "-c", str(config), "--nproc", "1", "--nnodes", "2", "--node-rank", "1",
                           "--rdzv-endpoint", endpoint.format(port=port), "--rendezvous-timeout", "1"], tmp_path)
    assert time.monotonic() - t0 < 15
    assert all(w in err for w in words), err


def test_rdzv_endpoint_that_answers_passes_the_preflight():
    from rocktune.process.rendezvous import preflight
    from rocktune.train.request import Launch

    said = []
    with socket.socket() as store:  # a peer's store on another node, as this node sees it
        store.bind(("127.0.0.1", 0))
        store.listen()
        port = store.getsockname()[1]
        launch = Launch(1, 2, 1, None, 29500, f"127.0.0.1:{port}")
        preflight(launch, 5.0, said.append)  # local and busy with several nodes: a peer's store, not refused
    free = free_port()
    preflight(Launch(2, 1, 0, None, 29500, f"localhost:{free}"), 5.0, said.append)  # one node: the port is free
