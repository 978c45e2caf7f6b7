"""Text data as a stream (issue 46, item 2): documents cut into max_length windows, every token trained once, the
stop rule kept for answers, and a run killed mid-corpus resuming exactly."""

from __future__ import annotations

import random
import signal

import pytest

from rocktune.config import DataConfig, config_from_dict
from rocktune.data.checks import check_training_data
from rocktune.data.dataset import tokenize_file
from rocktune.data.encode import IGNORE
from rocktune.data.textstream import stride_for, windows
from rocktune.errors import UserError
from rocktune.data.preview import build_preview
from rocktune.tasks import train
from rocktune.train.request import RunOptions
from tests.conftest import write_jsonl
from tests.lm_runs import adapter_bytes, config, logged, run_worker


def targets(wins) -> list[int]:
    """The tokens trained across windows: positions 1.. whose label is not ignored (position 0 never is)."""
    return [lab for w in wins for lab in w.labels[1:] if lab != IGNORE]


@pytest.mark.parametrize("n,length,stride", [(10, 4, 3), (10, 4, 2), (10, 4, 1), (3, 4, 3), (4, 4, 3), (5, 4, 3),
                                             (257, 64, 63), (257, 64, 16)])
def test_every_token_after_the_first_is_trained_exactly_once(n, length, stride):
    ids = list(range(1000, 1000 + n))
    wins = windows(ids, length, stride)
    assert targets(wins) == ids[1:]
    assert all(len(w.input_ids) <= length for w in wins)
    assert [w.input_ids[0] for w in wins] == ids[:n][::stride][:len(wins)]  # a window starts every stride tokens


def test_windows_of_a_small_case_by_hand():
    wins = windows(list(range(10)), 4, 3)
    assert [w.input_ids for w in wins] == [[0, 1, 2, 3], [3, 4, 5, 6], [6, 7, 8, 9]]
    assert [w.labels for w in wins] == [[0, 1, 2, 3], [IGNORE, 4, 5, 6], [IGNORE, 7, 8, 9]]
    wins = windows(list(range(8)), 4, 2)
    assert [w.labels for w in wins] == [[0, 1, 2, 3], [IGNORE, IGNORE, 4, 5], [IGNORE, IGNORE, 6, 7]]


@pytest.mark.parametrize("stride", [0, 64, 100])
def test_a_stride_that_would_skip_tokens_is_refused(stride):
    with pytest.raises(UserError, match=rf"data\.text_stride={stride} with data\.max_length=64.*1 to 63"):
        stride_for(64, stride)
    assert stride_for(64, None) == 63


def corpus(path, n_lines: int, line_chars: int, seed: int = 0):
    """A plain-text file of ``n_lines`` long lines and no blank line: one paragraph, one document."""
    rng = random.Random(seed)
    words = ["stream", "window", "token", "corpus", "river", "delta", "mouth", "silt", "bank", "ford"]
    lines = []
    for _ in range(n_lines):
        line = ""
        while len(line) < line_chars:
            line += rng.choice(words) + " "
        lines.append(line[:line_chars])
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


@pytest.mark.slow
def test_a_one_megabyte_corpus_trains_every_token(tmp_path, tokenizer):
    """The newcomer's case: 1 MB of 30 long lines was one example of 64 tokens, then refused by the stop rule."""
    f = corpus(tmp_path / "book.txt", 30, 35_000)
    assert f.stat().st_size > 1_000_000
    whole = tokenizer(f.read_text(encoding="utf-8").strip("\n"))["input_ids"] + [tokenizer.eos_token_id]
    pv = build_preview(str(f), "auto", tokenizer, 64, False, n_show=2, data=DataConfig(eval_fraction=0))
    assert pv.shape == "text" and pv.n_records == 1
    assert pv.n_windows == -(-(len(whole) - 1) // 63)  # each window trains 63 new tokens, the last what is left
    assert pv.loss_tokens == len(whole) - 1  # every token but the document's first
    assert pv.total_tokens == len(whole) - 1 + pv.n_windows  # the context repeated: one token per window
    assert pv.problems == []  # no "would not learn to stop": that rule is for answers
    assert [ex["loc"] for ex in pv.examples] == [f"{f}[row 0] window {k} of {pv.n_windows}" for k in (1, 2)]
    assert any(f"1 document cut into {pv.n_windows:,} windows of up to 64 tokens" in n for n in pv.truncation_notes)


def test_text_records_longer_than_max_length_become_windows(tmp_path, tokenizer):
    texts = ["a" * 150, "short one", "b c " * 40]
    f = write_jsonl(tmp_path / "t.jsonl", [{"text": t} for t in texts])
    ex, stats = tokenize_file(str(f), DataConfig(max_length=32, text_stride=24), tokenizer, tmp_path / "c")
    assert stats.n_records == 3 and stats.n_truncated == 0 and stats.n_windows == len(ex)
    eos = tokenizer.eos_token_id
    for text in texts:  # each document's windows, in order, give back its tokens, each trained once
        doc = tokenizer(text)["input_ids"] + [eos]
        assert targets(windows(doc, 32, 24)) == doc[1:]
    stored = [(list(ids), list(labs)) for ids, labs in zip(ex.input_ids, ex.labels)]
    want = [(w.input_ids, w.labels) for t in texts for w in windows(tokenizer(t)["input_ids"] + [eos], 32, 24)]
    assert stored == want
    assert sum(ex.labels.loss_counts()) == sum(len(tokenizer(t)["input_ids"]) for t in texts)


def test_a_text_column_is_a_document_per_cell(tmp_path, tokenizer):
    f = write_jsonl(tmp_path / "t.jsonl", [{"body": "x" * 80, "id": 1}])
    ex, stats = tokenize_file(str(f), DataConfig(max_length=32, columns={"text": "body"}), tokenizer, tmp_path / "c")
    assert stats.shape == "text" and stats.n_records == 1 and len(ex) == 3  # 81 tokens: 32, then 31 + 31 new


def test_the_stop_rule_names_where_it_applies(tmp_path, tokenizer):
    f = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "p", "completion": "c"}])
    ex, _ = tokenize_file(str(f), DataConfig(max_length=32), tokenizer, tmp_path / "c")
    cut = type(ex)([list(x)[:-1] for x in ex.input_ids], [list(x)[:-1] for x in ex.labels])  # the end token gone
    [problem] = [p for p in check_training_data(cut, tokenizer, "prompt_completion", False)
                 if p.code == "stop-never-trained"]
    assert "a rule for chat and instruction answers, where a model must learn to stop; text data is exempt" \
        in problem.message
    text = type(ex)([[5, 6, 7]], [[5, 6, 7]])  # a window that does not end its document: no end token, no problem
    assert check_training_data(text, tokenizer, "text", False) == []


@pytest.mark.slow
def test_a_run_killed_mid_corpus_resumes_exactly(tiny_model_dir, tokenizer, tmp_path):
    f = corpus(tmp_path / "corpus.txt", 4, 700, seed=3)  # one document of 45 windows of 64 tokens
    data = (f, None)
    ex, _ = tokenize_file(str(f), DataConfig(max_length=64, eval_fraction=0), tokenizer, tmp_path / "c")
    assert 2 * 16 < round(len(ex) * 0.9) < 3 * 16  # 16 windows a step: the step-2 checkpoint is mid-corpus

    def cfg(out):
        c = config(tiny_model_dir, data, tmp_path / out, max_steps=4)
        c["data"]["eval_fraction"] = 0.1
        return c

    train(config_from_dict(cfg("straight")), quiet=True)
    killed = cfg("killed")
    assert run_worker(killed, {"kill_at_step": 3}) == -signal.SIGKILL
    train(config_from_dict(killed), RunOptions(resume=True), quiet=True)
    assert logged(tmp_path / "killed") == logged(tmp_path / "straight")
    assert adapter_bytes(tmp_path / "killed") == adapter_bytes(tmp_path / "straight")
