"""The batched tokeniser gives exactly the per-record reference's tokens and labels, and every source kind loads."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from rocktune.config import DataConfig
from rocktune.data import encode, fastencode, records, synthetic
from rocktune.data.dataset import prepare_data, tokenize_file
from rocktune.demo.task import make_task
from rocktune.errors import UserError
from tests.conftest import write_jsonl

ROOT = Path(__file__).resolve().parents[1]
NOT_SFT = ("preference", "gsm8k_style")  # pairs and GRPO prompts: records of other tasks
FILES = sorted(f for f in (ROOT / "examples" / "data").glob("*.jsonl") if not f.name.startswith(NOT_SFT)) + sorted(
    f for f in (ROOT / "tests" / "data").rglob("*.jsonl") if "preference" not in f.name)


@pytest.fixture(scope="module")
def bpe(tokenizer):
    """A byte-level BPE with real merges (trained here, offline): tokens span characters, so a segment boundary
    that moved would change the tokens; the tiny tokenizer's one token per byte could not show it."""
    from rocktune.demo.tiny import build_bpe_tokenizer

    return build_bpe_tokenizer(vocab_size=900, per_set=300, seed=9)


def _record_sets():
    for f in FILES:
        recs = records.read_records(f)
        yield f.name, recs
    train, evals = make_task(n_train=64, n_eval=8, seed=1)
    yield "demo-task", [(f"demo[{i}]", r) for i, r in enumerate(train + evals)]
    for name, make in synthetic.SETS.items():
        yield f"synthetic-{name}", [(f"{name}[{i}]", r) for i, r in enumerate(make(120, seed=3))]


SETTINGS = [(ml, top, cut) for ml in (24, 96, 4096) for top in (False, True) for cut in ("prompt", "end")]


@pytest.mark.parametrize("which", ["tiny", "bpe"])
def test_batched_tokens_equal_the_per_record_reference(which, tokenizer, bpe):
    tok = tokenizer if which == "tiny" else bpe
    compared = 0
    for name, recs in _record_sets():
        shape = records.detect_shape(recs, "auto")
        layout = fastencode.chat_layout(tok) if shape == "messages" else None
        assert shape != "messages" or layout is not None  # the one-rendering path is the one under test
        # ShareGPT normalised; these tokenizers' ChatML has no tools (refused: tests/test_template_fidelity.py):
        # tool records are compared without them, and with templates that have them in tests/test_chat_data.py
        rows, locs = records.prepare(recs, shape, drop_tools=True), [loc for loc, _ in recs]
        for ml, top, cut in SETTINGS:
            fast = fastencode.encode_many(rows, tok, fastencode.EncodeSettings(shape, ml, top, cut), locs, layout)
            for loc, rec, got in zip(locs, rows, fast):
                want = encode.encode(rec, shape, tok, ml, top, loc, cut)
                assert got == want, (name, loc, ml, top, cut)
                compared += 1
    assert compared > 5000


def test_prepared_cache_rows_equal_the_reference(tmp_path, tokenizer):
    """Through datasets.map, two worker processes and the memory-mapped cache: the same rows, in order."""
    rows = synthetic.chats(300, seed=5)
    f = write_jsonl(tmp_path / "chat.jsonl", rows)
    # lossy_truncation=keep: the cut examples are trained as cut, so that the rows compare with encode's
    d = DataConfig(train_file=str(f), eval_fraction=0.0, max_length=200, num_proc=2, lossy_truncation="keep")
    from rocktune.data import tokenise

    tokenise.ROWS_PER_PROC, saved = 100, tokenise.ROWS_PER_PROC  # two workers for 300 rows
    try:
        train, _, stats = prepare_data(d, tokenizer, tmp_path / "cache", 0)
    finally:
        tokenise.ROWS_PER_PROC = saved
    want = [encode.encode(r, "messages", tokenizer, 200, False, "x") for r in rows]
    want = [w for w in want if any(t != encode.IGNORE for t in w.labels[1:])]
    assert len(train) == len(want) and stats.n_truncated == sum(w.truncated for w in want) > 0
    assert all(train.input_ids[i] == w.input_ids and train.labels[i] == w.labels for i, w in enumerate(want))
    assert train.lengths() == [len(w.input_ids) for w in want]
    assert isinstance(train.input_ids.flat, np.memmap)  # mapped, not loaded
    assert stats.cache_bytes > 0 and stats.records_per_s > 0


# --- sources ----------------------------------------------------------------------------------------------------

ROWS = [{"question": f"q{i} what is {i} + {i}?", "answer": f" {2 * i}"} for i in range(12)]
MAPPED = {"prompt": "question", "completion": "answer"}


def _expect(tokenizer, rows=ROWS):
    return [encode.encode({"prompt": r["question"], "completion": r["answer"]}, "prompt_completion", tokenizer, 64,
                          False, "x").input_ids for r in rows]


def _write_source(kind: str, tmp_path: Path) -> str:
    import datasets

    ds = datasets.Dataset.from_list(ROWS)
    if kind == "parquet":
        ds.to_parquet(tmp_path / "d.parquet")
        return str(tmp_path / "d.parquet")
    if kind == "csv":
        ds.to_csv(tmp_path / "d.csv", index=False)
        return str(tmp_path / "d.csv")
    if kind == "jsonl":
        return str(write_jsonl(tmp_path / "d.jsonl", ROWS))
    if kind == "arrow":
        ds.save_to_disk(tmp_path / "saved")
        arrow = next((tmp_path / "saved").glob("*.arrow"))
        return str(arrow.rename(tmp_path / "d.arrow"))
    if kind == "disk":
        ds.save_to_disk(tmp_path / "saved")
        return str(tmp_path / "saved")
    datasets.DatasetDict({"train": ds, "test": ds.select(range(3))}).save_to_disk(tmp_path / "dict")
    return str(tmp_path / "dict")


@pytest.mark.parametrize("kind", ["jsonl", "parquet", "csv", "arrow", "disk", "dict"])
def test_every_file_kind_with_column_mapping(kind, tmp_path, tokenizer):
    spec = _write_source(kind, tmp_path)
    d = DataConfig(max_length=64, columns=MAPPED, split="train")
    ex, stats = tokenize_file(spec, d, tokenizer, tmp_path / "cache")
    assert [ex.input_ids[i] for i in range(len(ex))] == _expect(tokenizer)
    assert stats.shape == "prompt_completion" and "prompt<-question" in stats.source
    if kind == "dict":
        ex, _ = tokenize_file(spec, d.model_copy(update={"eval_split": "test"}), tokenizer, tmp_path / "cache",
                              eval_side=True)
        assert len(ex) == 3
        with pytest.raises(UserError, match=r"splits \['test', 'train'\], not data.split=valid"):
            tokenize_file(spec, d.model_copy(update={"split": "valid"}), tokenizer, tmp_path / "cache")


def test_errors_name_the_row_and_the_mapping(tmp_path, tokenizer):
    import datasets

    rows = [dict(r) for r in ROWS]
    rows[4]["answer"] = None  # a hole in a parquet column: that row has no completion
    datasets.Dataset.from_list(rows).to_parquet(tmp_path / "d.parquet")
    with pytest.raises(UserError, match=r"d\.parquet\[row 4\]: record is missing 'completion'"):
        tokenize_file(str(tmp_path / "d.parquet"), DataConfig(columns=MAPPED), tokenizer, tmp_path / "c")
    with pytest.raises(UserError, match=r"data.columns maps to \['reply'\].*does not have"):
        tokenize_file(str(tmp_path / "d.parquet"), DataConfig(columns={"completion": "reply"}), tokenizer,
                      tmp_path / "c")
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "a", "completion": "b"}, {"prompt": "a"}])
    with pytest.raises(UserError, match=r"bad\.jsonl:2: record is missing 'completion'"):
        tokenize_file(str(bad), DataConfig(), tokenizer, tmp_path / "c")
    assert not [p for p in (tmp_path / "c").glob("*") if p.name != "sources"]  # nothing cached


def _hub_cache(root: Path) -> Path:
    """A datasets cache holding 'tester/tiny_set' as load_dataset would leave it, built offline by datasets' own
    JSON builder and laid out as the cache builder looks it up (<name>/<config>/<version>/<hash>/)."""
    from datasets.packaged_modules.json.json import Json

    cache = root / "hf" / "datasets"
    f = write_jsonl(root / "src.jsonl", ROWS)
    Json(cache_dir=str(cache), dataset_name="tiny_set", hash="0123abcd", data_files={"train": str(f)}
         ).download_and_prepare()
    built = next((cache / "tiny_set").glob("default-*/0.0.0/0123abcd"))
    target = cache / "tester___tiny_set" / "default" / "0.0.0"
    target.mkdir(parents=True)
    built.rename(target / "0123abcd")
    return cache


def test_hub_id_loads_from_the_local_cache_offline(tmp_path, tokenizer, monkeypatch):
    import datasets

    cache = _hub_cache(tmp_path)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", cache)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    d = DataConfig(max_length=64, columns=MAPPED)
    ex, stats = tokenize_file("tester/tiny_set", d, tokenizer, tmp_path / "cache")
    assert [ex.input_ids[i] for i in range(len(ex))] == _expect(tokenizer) and "(hub," in stats.source
    with pytest.raises(UserError, match="tester/missing is a hub dataset id, HF_HUB_OFFLINE is set"):
        tokenize_file("tester/missing", d, tokenizer, tmp_path / "cache")


def test_token_rows_count_like_the_lists():
    from rocktune.data.batching import loss_token_counts
    from rocktune.data.checks import loss_positions
    from rocktune.data.tokens import TokenRows, from_lists

    rows = [[-100, 5, 7], [3], [], [-100, -100, 9, 256], [256, 1]]
    flat, offsets = from_lists(rows)
    view = TokenRows(flat, offsets).take([4, 0, 3, 1, 2])
    picked = [rows[i] for i in (4, 0, 3, 1, 2)]
    assert list(view) == picked and view.lengths().tolist() == [2, 3, 4, 1, 0]
    assert loss_token_counts(view) == [loss_positions(r) for r in picked] == [1, 2, 2, 0, 0]
    assert view.rows_with([256]) == 1  # the leading 256 of row 4 is position 0: not trained


def test_counts_in_blocks_match(monkeypatch):
    """Counting reads the flat array in blocks of whole rows; a block edge inside the set changes nothing."""
    from rocktune.data import tokens

    rows = synthetic_rows = [[-100] * (i % 5) + list(range(i % 7)) for i in range(200)]
    flat, offsets = tokens.from_lists(synthetic_rows)
    whole = tokens.TokenRows(flat, offsets).loss_counts()
    monkeypatch.setattr(tokens, "BLOCK", 9)
    assert tokens.TokenRows(flat, offsets).loss_counts().tolist() == whole.tolist() == \
        [sum(1 for y in r[1:] if y != -100) for r in rows]


def test_cache_is_mapped_not_copied(tmp_path):
    """A rank that loads the cache maps it: its private memory grows by a small part of the cache's size, even after
    the lengths, the loss counts and a batch's rows were read (what training reads before its first step)."""
    import subprocess
    import sys

    from rocktune.data import cache

    n_rows, width = 200_000, 100
    entry = cache.Entry(tmp_path, "k")
    offsets = np.arange(n_rows + 1, dtype=np.int64) * width
    ids = np.arange(n_rows * width, dtype=np.int32) % 250
    entry.write("offsets", len(offsets), np.int64, [offsets])
    entry.write("input_ids", len(ids), np.int32, [ids])
    entry.write("labels", len(ids), np.int32, [np.where(ids % 3 == 0, -100, ids)])
    entry.commit({"n_records": n_rows})
    size = cache.size_bytes(tmp_path, "k")
    code = f"""
import re
from pathlib import Path
def anon():
    return int(re.search(r"RssAnon:\\s+(\\d+)", Path("/proc/self/status").read_text()).group(1)) * 1024
from rocktune.data import cache
from rocktune.data.batching import loss_token_counts
from rocktune.data.dataset import _examples
before = anon()
arrays, meta = cache.load(Path({str(tmp_path)!r}), "k")
ex = _examples(arrays)
lengths, counts = ex.lengths(), loss_token_counts(ex.labels)
rows = [ex.input_ids[i] for i in range(0, len(ex), 1000)]
print(anon() - before, len(lengths), sum(counts))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    grown, n, trained = int(out[0]), int(out[1]), int(out[2])
    assert n == n_rows and trained == int((np.where(ids % 3 == 0, -100, ids).reshape(n_rows, width)[:, 1:] != -100
                                           ).sum())
    assert size > 150 * 2**20 and grown < size / 8, (grown, size)


@pytest.mark.parametrize("kind", ["jsonl", "parquet", "disk"])
def test_streamed_source_gives_the_same_examples(kind, tmp_path, tokenizer):
    """data.streaming: no Arrow copy of the source, batches spread over a pool of two workers, the same tokens."""
    spec = _write_source(kind, tmp_path)
    d = DataConfig(max_length=64, columns=MAPPED, streaming=True, num_proc=2)
    ex, stats = tokenize_file(spec, d, tokenizer, tmp_path / "cache")
    assert [ex.input_ids[i] for i in range(len(ex))] == _expect(tokenizer)
    assert "streamed" in stats.source and stats.n_records == len(ROWS)
    assert not list((tmp_path / "cache").rglob("*.arrow"))  # no Arrow copy of the source was made


def test_streamed_errors_name_the_row(tmp_path, tokenizer):
    rows = [{"prompt": "a", "completion": "b"}] * 1500 + [{"prompt": "a", "completion": 7}]
    f = write_jsonl(tmp_path / "d.jsonl", rows)
    with pytest.raises(UserError, match=r"d\.jsonl:1501: 'completion' must be a string, got int"):
        tokenize_file(str(f), DataConfig(streaming=True, num_proc=2), tokenizer, tmp_path / "c")
    assert not (tmp_path / "c").exists() or not list((tmp_path / "c").glob("*/meta.json"))  # nothing cached


def test_a_user_turn_quoting_a_reply_falls_back_to_the_per_prefix_rendering(tokenizer):
    layout = fastencode.chat_layout(tokenizer)
    quoted = "<|im_start|>assistant\nhi<|im_end|>\n"
    msgs = [{"role": "user", "content": f"say {quoted}"}, {"role": "assistant", "content": "hi"},
            {"role": "user", "content": "again"}, {"role": "assistant", "content": "hi"}]
    assert fastencode.chat_segments(msgs, tokenizer, layout) is None  # ambiguous: not guessed
    settings = fastencode.EncodeSettings("messages", 512, False)
    got = fastencode.encode_many([{"messages": msgs}], tokenizer, settings, ["x"], layout)[0]
    assert got == encode.encode({"messages": msgs}, "messages", tokenizer, 512, False, "x")
    plain = [{"role": "user", "content": "say hi"}, {"role": "assistant", "content": "hi"}]
    assert fastencode.chat_segments(plain, tokenizer, layout) == encode.chat_segments(plain, tokenizer, "x")
