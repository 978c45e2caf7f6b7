"""The prepared dataset does not depend on how it was prepared: one process, a pool of workers taking batches out of
order, a streamed source, all give the per-record reference's tokens and labels and byte-identical cache files, and
those files are the ones the code before the speed work of issue 46 wrote (pinned digests, demo tokenizer)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from rocktune.config import DataConfig
from rocktune.data import checks, encode, records, synthetic, textstream, tokenise
from rocktune.data.dataset import tokenize_file
from rocktune.demo.tiny import build_tokenizer
from tests.conftest import write_jsonl

N = 300
MAX_LENGTH = 64  # short enough that many examples are truncated, a few dropped
TARGET = {"alpaca": "output", "prompt_completion": "completion", "text": "text"}
# sha256 of input_ids.npy + labels.npy + offsets.npy + meta.json (the file's path replaced by "F"), written by the
# code before issue 46's speed work (datasets.map over contiguous shards), for ``_rows(shape)`` and build_tokenizer()
PINNED = {
    "alpaca": "6f221453672e61807ebf6e249630b0472746735d499c39887f61f4f33846c706",
    "messages": "e2b852ed35f1db57988cbd143c3249d727b37118c15beab8be20d4138de564e4",
    "prompt_completion": "d32078d3fbf7029a85fc39acdd395aa0bbcde07e3074e6a59303216055569aa2",
    "text": "7798b0129aace159c4555e908aef0239d6610dc042e61d8f7cb3367b538deaf4",
}
PATHS = {"one process": dict(num_proc=1), "two workers": dict(num_proc=2),
         "streamed, two workers": dict(num_proc=2, streaming=True)}


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


@pytest.fixture
def small_batches(monkeypatch):
    """Workers for a few hundred rows, in many small batches: results arrive out of order and must be put back."""
    monkeypatch.setattr(tokenise, "ROWS_PER_PROC", 50)
    monkeypatch.setattr(tokenise, "BATCH", 16)


def _rows(shape: str) -> list[dict]:
    """Synthetic records with a blank target every 37th (dropped, counted) and a key the shape does not use."""
    rows = synthetic.SETS[shape](N, seed=11)
    for i in range(0, N, 37):
        if shape in TARGET:
            rows[i][TARGET[shape]] = "  "
        rows[i]["extra"] = "x"
    return rows


def _prepare(tmp_path: Path, shape: str, tok, **how):
    tmp_path.mkdir(parents=True, exist_ok=True)
    f = write_jsonl(tmp_path / f"{shape}.jsonl", _rows(shape))
    cache = tmp_path / "cache"
    d = DataConfig(max_length=MAX_LENGTH, chat_template="never" if shape != "messages" else "auto", **how)
    examples, _ = tokenize_file(str(f), d, tok, cache)
    entry = next(p for p in cache.iterdir() if p.is_dir() and p.name != "sources" and not p.name.startswith("."))
    digest = hashlib.sha256()
    for name in ("input_ids.npy", "labels.npy", "offsets.npy", "meta.json"):
        data = (entry / name).read_bytes()
        if name == "meta.json":  # meta's "cuts" (issue 55: what truncation removed) came later: the rest is pinned
            meta = json.loads(data)
            meta.pop("cuts", None)
            data = json.dumps(meta, indent=1).encode().replace(str(f).encode(), b"F")
        digest.update(data)
    return examples, digest.hexdigest()


def _reference(shape: str, tok) -> list[encode.Encoded]:
    """The examples record by record (``encode.encode``; a text's windows from its whole tokens), dropped ones out."""
    out = []
    rows = records.prepare([(str(i), r) for i, r in enumerate(_rows(shape))], shape)
    for rec in rows:
        if records.targets_empty(rec, shape):
            continue
        if shape == "text":
            ids = tok(rec["text"])["input_ids"] + [tok.eos_token_id]
            out += textstream.windows(ids, MAX_LENGTH, textstream.stride_for(MAX_LENGTH, None))
        else:
            out.append(encode.encode(rec, shape, tok, MAX_LENGTH, False, "x"))
    return [e for e in out if checks.loss_positions(e.labels) > 0]


@pytest.mark.parametrize("shape", sorted(PINNED))
def test_every_path_writes_the_same_cache_as_before(shape, tmp_path, tok, small_batches):
    want = _reference(shape, tok)
    digests = {}
    for name, how in PATHS.items():
        ex, digests[name] = _prepare(tmp_path / name.replace(" ", "_").replace(",", ""), shape, tok, **how)
        assert len(ex) == len(want), (shape, name)
        for i, w in enumerate(want):
            assert ex.input_ids[i] == w.input_ids and ex.labels[i] == w.labels, (shape, name, i)
    assert set(digests.values()) == {PINNED[shape]}, (shape, digests)


def test_pinned_sets_have_what_they_are_meant_to_cover(tok):
    """The pinned sets truncate, drop and count unused keys: a digest of an easy case would prove little."""
    for shape in PINNED:
        rows = _reference(shape, tok)
        assert len(rows) > 100
        assert shape == "text" or any(len(r.input_ids) == MAX_LENGTH for r in rows)
    assert json.dumps(_rows("alpaca")[0]).count('"extra"') == 1


def test_where_processes_cannot_fork_one_process_writes_the_same_cache(tmp_path, tok, monkeypatch):
    """Windows has no fork: the workers (which inherit the encoder and the mapped rows) give way to one process."""
    import multiprocessing

    monkeypatch.setattr(multiprocessing, "get_all_start_methods", lambda: ["spawn"])
    assert tokenise.workers(8, 10**6) == 1
    _, digest = _prepare(tmp_path, "alpaca", tok, num_proc=2)
    assert digest == PINNED["alpaca"]
