"""Check, then write (issue 17): every broken input is one paragraph naming the file, exit 2, no traceback, no
restart — and nothing written: neither the run directory nor the token cache exists afterwards."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from rocktune.cli import main
from tests.conftest import tiny_run_config, write_jsonl


@pytest.fixture(scope="module")
def rows():
    from rocktune.demo.task import make_task

    train, _ = make_task(n_train=24, n_eval=4, seed=5)
    return train


def broken_model(src: Path, dst: Path, how: str) -> Path:
    shutil.copytree(src, dst)
    weights = dst / "model.safetensors"
    if how == "truncated":
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    elif how == "no_tokenizer":
        for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
            (dst / name).unlink(missing_ok=True)
    elif how == "bad_tokenizer":
        (dst / "tokenizer.json").write_text('{"version": "1.0", "model": {"type": "nonsense"}}')
    elif how == "no_config":
        (dst / "config.json").unlink()
    elif how == "missing_shard":
        weights.rename(dst / "model-00001-of-00002.safetensors")
        index = {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
        (dst / "model.safetensors.index.json").write_text(json.dumps(index))
    elif how == "small_vocab":  # token ids of the data reach past the embedding: an index error on the device
        from safetensors.torch import load_file, save_file

        config = json.loads((dst / "config.json").read_text())
        (dst / "config.json").write_text(json.dumps({**config, "vocab_size": 100}))
        tensors = load_file(weights)  # weights and config agree; only the tokenizer reaches further
        save_file({k: (v[:100].contiguous() if v.shape[0] == config["vocab_size"] else v) for k, v in tensors.items()},
                  weights)
    elif how == "mismatched_weights":  # config.json of one model, weights of another (a botched conversion)
        config = json.loads((dst / "config.json").read_text())
        (dst / "config.json").write_text(json.dumps({**config, "intermediate_size": config["intermediate_size"] * 2}))
    return dst


def run_cli(cfg: dict, tmp_path: Path, capfd) -> tuple[int, str]:
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    code = main(["train", "-c", str(tmp_path / "c.yaml"), "--no-supervise"])
    return code, " ".join(capfd.readouterr().err.split())


def assert_nothing_written(tmp_path: Path) -> None:
    assert not (tmp_path / "out" / "run").exists()
    assert not (tmp_path / "out" / "cache").exists()
    assert not (tmp_path / "out" / ".rocktune_cache").exists()


MODEL_CASES = {
    "truncated": ("model.safetensors is truncated", "re-download"),
    "no_tokenizer": ("has no tokenizer files", "tokenizer files"),
    "bad_tokenizer": ("does not load", "re-download"),
    "no_config": ("has no config.json", "re-download"),
    "missing_shard": ("model-00002-of-00002.safetensors", "incomplete"),
    "small_vocab": ("train.jsonl:1: the tokenizer gives token id", "vocab_size=100"),
    "mismatched_weights": ("do not fit its config.json", "mlp.down_proj.weight: file"),
}


@pytest.mark.parametrize("how", sorted(MODEL_CASES))
def test_broken_model_directory_is_one_clear_error(tiny_model_dir, rows, tmp_path, capfd, how):
    model = broken_model(tiny_model_dir, tmp_path / "model", how)
    train = write_jsonl(tmp_path / "train.jsonl", rows)
    code, err = run_cli(tiny_run_config(model, train, None, tmp_path / "out" / "run"), tmp_path, capfd)
    assert code == 2, err
    assert "Traceback" not in err and err.count("error:") == 1
    for part in MODEL_CASES[how]:
        assert part in err, (part, err)
    assert str(model) in err or "train.jsonl" in err
    assert_nothing_written(tmp_path)


DEEP = '{"prompt": "a", "completion": "b", "meta": ' + "[" * 5000 + "]" * 5000 + "}"
EMPTY_TURN = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": ""}]}
DATA_CASES = {
    # name: (train lines, eval lines or None, extra config, expected parts)
    "deep_nesting": (None, None, {}, ("train.jsonl:3:", "nested too deeply")),
    "empty_assistant_turn": ([EMPTY_TURN], None, {}, ("train.jsonl:1:", "the only record has no non-empty assistant")),
    "bad_eval_beside_good_train": (None, ["{oops"], {}, ("eval.jsonl:1: malformed JSON",)),
    "eval_split_leaves_nothing": (None, None, {"eval_fraction": 0.99},
                                  ("data.eval_fraction=0.99", "train.jsonl", "none to train on")),
}


@pytest.mark.parametrize("case", sorted(DATA_CASES))
def test_pathological_data_is_one_clear_error(tiny_model_dir, rows, tmp_path, capfd, case):
    train_rows, eval_lines, extra, parts = DATA_CASES[case]
    train = write_jsonl(tmp_path / "train.jsonl", train_rows or rows)
    if case == "deep_nesting":
        train.write_text("\n".join([json.dumps(rows[0]), json.dumps(rows[1]), DEEP]) + "\n")
    evals = None
    if eval_lines is not None:
        evals = tmp_path / "eval.jsonl"
        evals.write_text("\n".join(eval_lines) + "\n")
    cfg = tiny_run_config(tiny_model_dir, train, evals, tmp_path / "out" / "run")
    cfg["data"].update(extra)
    code, err = run_cli(cfg, tmp_path, capfd)
    assert code == 2, err
    assert "Traceback" not in err and "RecursionError" not in err and err.count("error:") == 1
    for part in parts:
        assert part in err, (part, err)
    assert_nothing_written(tmp_path)  # the good train file's cache included


def test_platform_gate_before_anything_is_written(tiny_model_dir, rows, tmp_path, capfd):
    train = write_jsonl(tmp_path / "train.jsonl", rows)
    cfg = tiny_run_config(tiny_model_dir, train, None, tmp_path / "out" / "run")
    cfg["model"]["liger"] = "on"
    code, err = run_cli(cfg, tmp_path, capfd)
    assert code == 2 and "model.liger=on" in err and "Traceback" not in err
    assert_nothing_written(tmp_path)


def test_empty_targets_dropped_and_counted_when_others_remain(tokenizer, rows, tmp_path):
    from rocktune.config import DataConfig
    from rocktune.data.dataset import prepare_data

    train = write_jsonl(tmp_path / "train.jsonl", rows[:3] + [{"prompt": "x", "completion": "  "}] + rows[3:6])
    d = DataConfig(train_file=str(train), eval_fraction=0.0, max_length=64)
    tr, _, stats = prepare_data(d, tokenizer, tmp_path / "cache", 0)
    assert len(tr) == 6
    assert any(f"1 of 7 records of {train} have an empty 'completion' and were dropped ({train}:4)" in n
               for n in stats.notes), stats.notes


def test_supervised_run_with_truncated_weights_is_not_restarted(tiny_model_dir, rows, tmp_path):
    model = broken_model(tiny_model_dir, tmp_path / "model", "truncated")
    train = write_jsonl(tmp_path / "train.jsonl", rows)
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(tiny_run_config(model, train, None, tmp_path / "out" / "run")))
    proc = subprocess.run([sys.executable, "-m", "rocktune", "train", "-c", str(tmp_path / "c.yaml")],
                          capture_output=True, text=True)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr and "restart" not in proc.stderr and proc.stderr.count("error:") == 1
    assert "truncated" in proc.stderr
    assert_nothing_written(tmp_path)  # no incidents.jsonl either: a user error is not an incident
