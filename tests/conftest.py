"""Shared fixtures: a tiny random Qwen2 model directory and small data files, all built offline."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

TINY_SHAPE = {"hidden": 64, "layers": 2, "heads": 4, "kv_heads": 2}
LONG_REASON = ("long: a minute or more on 2 CPU cores, outside `make test`; `make test-long` runs it (CI does), "
               "or set ROCKTUNE_LONG=1")


def pytest_collection_modifyitems(config, items):
    """Tests marked ``long`` keep ``make test`` within minutes: skipped there with their reason, run by
    ``make test-long`` (``-m long``), which CI runs after ``make test``, or anywhere with ``ROCKTUNE_LONG=1``."""
    if os.environ.get("ROCKTUNE_LONG") == "1" or "long" in (config.getoption("markexpr") or ""):
        return
    skip = pytest.mark.skip(reason=LONG_REASON)
    for item in items:
        if item.get_closest_marker("long"):
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    from rocktune.demo.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=0, **TINY_SHAPE)


@pytest.fixture(scope="session")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


@pytest.fixture
def task_files(tmp_path) -> tuple[Path, Path]:
    from rocktune.demo.task import make_task

    train, evals = make_task(n_train=256, n_eval=32, seed=1)
    return write_jsonl(tmp_path / "train.jsonl", train), write_jsonl(tmp_path / "eval.jsonl", evals)


def tiny_run_config(model_dir: Path, train_file: Path, eval_file: Path | None, out_dir: Path, **training) -> dict:
    t = {"max_steps": 6, "micro_batch_size": 8, "grad_accum": 2, "lr": 3e-3, "warmup_steps": 2, "eval_every": 0,
         "precision": "fp32", "device": "cpu", "seed": 0}
    t.update(training)
    return {
        "model": {"name_or_path": str(model_dir)},
        "lora": {"r": 8, "alpha": 16},
        "data": {"train_file": str(train_file), "eval_file": str(eval_file) if eval_file else None,
                 "max_length": 64, "cache_dir": str(out_dir.parent / "cache")},
        "training": t,
        "output": {"dir": str(out_dir)},
    }


@pytest.fixture(scope="session")
def data(tmp_path_factory) -> tuple[Path, Path]:
    """The LM fault-injection tests' data (tests/lm_runs.py): the demo task, 200 train and 16 eval records."""
    from rocktune.demo.task import make_task

    tmp = tmp_path_factory.mktemp("rel")
    tr, ev = make_task(n_train=200, n_eval=16, seed=2)
    return write_jsonl(tmp / "train.jsonl", tr), write_jsonl(tmp / "eval.jsonl", ev)


@pytest.fixture(scope="session")
def pair_files(tmp_path_factory) -> tuple[Path, Path]:
    """Preference pairs of the demo task (tasks/preference/demo/pairs.py): 64 train and 8 eval pairs, TRL's
    prompt/chosen/rejected."""
    from rocktune.tasks.preference.demo.pairs import make_pairs

    tmp = tmp_path_factory.mktemp("pairs")
    tr, ev = make_pairs(n_train=64, n_eval=8, seed=3)
    return write_jsonl(tmp / "train.jsonl", tr), write_jsonl(tmp / "eval.jsonl", ev)


@pytest.fixture(scope="session")
def reference(tiny_model_dir, data, tmp_path_factory) -> Path:
    """One uninterrupted LM run (tests/lm_runs.py's config): what every faulted run must reproduce exactly."""
    from rocktune.config import config_from_dict
    from rocktune.tasks import train
    from tests.lm_runs import config

    out = tmp_path_factory.mktemp("ref") / "run"
    train(config_from_dict(config(tiny_model_dir, data, out)), quiet=True)
    return out


# the tiny vision-language models (tests/test_vlm_*.py): built per test module, as each module used to
@pytest.fixture(scope="module")
def vlm_dirs(tmp_path_factory):
    """family -> a tiny random-init model directory of it, built once per module when first asked for."""
    from rocktune.tasks.vlm.demo.tiny_vlm import build_tiny_vlm

    built: dict[str, Path] = {}

    def get(family: str = "qwen2_5_vl") -> Path:
        if family not in built:
            built[family] = build_tiny_vlm(tmp_path_factory.mktemp(f"tiny-{family}") / "model", family=family)
        return built[family]
    return get


@pytest.fixture(scope="module")
def vlm_dir(vlm_dirs) -> Path:
    return vlm_dirs()
