"""Truncation judged by what it removes (issue 55 point 2): an example whose cut to data.max_length removes its
system prompt, its tool list or part of its last answer is a check failure naming the max_length that keeps it
(or left out with data.lossy_truncation=drop, or trained as cut with keep); a cut of older turns or of a long
prompt's start is the cut working as meant and passes. Applying the suggested max_length, the preview passes."""

from __future__ import annotations

import json

import pytest

from rocktune.cli import main
from rocktune.config import DataConfig
from rocktune.data.dataset import prepare_data
from rocktune.data.preview import build_preview
from rocktune.errors import UserError
from tests.conftest import tiny_run_config, write_jsonl

SYSTEM = "You are the flight controller of a survey drone. Keep answers short and safe. " * 4
TOOLS = [{"type": "function", "function": {"name": f"set_{k}", "description": f"Set the drone's {k}.",
                                           "parameters": {"type": "object", "properties": {k: {"type": "number"}}}}}
         for k in ("altitude", "heading", "speed")]


def _drone(i: int, extra: int = 0) -> dict:
    """A conversation with a system prompt and a tool list, ~700 tokens in the tiny byte-level tokenizer."""
    return {"messages": [{"role": "system", "content": SYSTEM + "x" * extra},
                         {"role": "user", "content": f"Climb to {100 + i} metres."},
                         {"role": "assistant", "content": f"Climbing to {100 + i} metres now."}], "tools": TOOLS}


@pytest.fixture
def tok(tiny_model_dir):
    """The demo model's tokenizer with the built-in tool template (its own ChatML ignores tools)."""
    from transformers import AutoTokenizer

    from rocktune.readers.template import use_template

    return use_template(AutoTokenizer.from_pretrained(tiny_model_dir), "builtin-tools")


def _codes(pv) -> list[tuple[str, str]]:
    return [(p["level"], p["code"]) for p in pv.problems]


def test_a_cut_that_removes_the_system_prompt_and_tools_fails_and_the_suggested_length_passes(tmp_path, tok):
    data = str(write_jsonl(tmp_path / "drone.jsonl", [_drone(i, extra=10 * i) for i in range(6)]))
    pv = build_preview(data, "auto", tok, 256, False)
    assert _codes(pv) == [("error", "truncation-loses")]
    assert pv.n_truncated == 6 and pv.uncut["over"] == 6 and pv.uncut["min"] > 256
    assert pv.needed == pv.uncut["max"]  # the longest of them: the max_length that keeps every one whole
    msg = pv.problems[0]["message"]
    assert "6 lose their system prompt or tool list" in msg and f"data.max_length={pv.needed} keeps" in msg
    assert "drone.jsonl:1" in msg
    fixed = build_preview(data, "auto", tok, pv.needed, False)  # the suggested fix, applied
    assert fixed.problems == [] and fixed.n_truncated == 0 and fixed.n_kept == 6


def test_train_stops_before_the_cache_is_written_and_drop_and_keep_do_what_they_say(tmp_path, tok):
    rows = [_drone(i) for i in range(3)] + [{"messages": [{"role": "user", "content": f"hi {i}"},
                                                          {"role": "assistant", "content": "hello"}]}
                                            for i in range(5)]
    data = str(write_jsonl(tmp_path / "mixed.jsonl", rows))
    d = DataConfig(train_file=data, max_length=128, eval_fraction=0.0)
    with pytest.raises(UserError, match=r"3 examples are longer than data.max_length=128 .*3 lose their system "
                                        r"prompt or tool list .*data.max_length=\d+ keeps every one"):
        prepare_data(d, tok, tmp_path / "cache", 0)
    assert not any((tmp_path / "cache").glob("*/meta.json"))
    train, _, stats = prepare_data(d.model_copy(update={"lossy_truncation": "drop"}), tok, tmp_path / "c2", 0)
    assert len(train) == 5 and stats.n_dropped == 0  # the three left out, said so, not called empty
    assert any("were left out (data.lossy_truncation=drop)" in n for n in stats.notes)
    train, _, stats = prepare_data(d.model_copy(update={"lossy_truncation": "keep"}), tok, tmp_path / "c3", 0)
    assert len(train) == 8 and max(train.lengths()) == 128
    assert any(n.startswith("warning: 3 examples are longer") for n in stats.notes)


def test_a_cut_answer_fails_but_a_long_prompt_losing_its_start_passes(tmp_path, tokenizer):
    long_prompt = [{"prompt": "context " * 60 + f"question {i}?", "completion": " answer"} for i in range(4)]
    pv = build_preview(str(write_jsonl(tmp_path / "p.jsonl", long_prompt)), "auto", tokenizer, 64, False)
    assert pv.n_truncated == 4 and pv.problems == []  # the prompt's end stays next to the answer: as meant
    long_answer = [{"prompt": "q?", "completion": " long answer" * 20} for _ in range(4)]
    pv = build_preview(str(write_jsonl(tmp_path / "a.jsonl", long_answer)), "auto", tokenizer, 64, False)
    assert _codes(pv)[0] == ("error", "truncation-loses") and "4 lose part of their last answer" in \
        pv.problems[0]["message"]
    multi = [{"messages": [m for k in range(6) for m in ({"role": "user", "content": f"question {k} " * 4},
                                                         {"role": "assistant", "content": f"answer {k}"})]}] * 3
    pv = build_preview(str(write_jsonl(tmp_path / "m.jsonl", multi)), "auto", tokenizer, 96, False)
    assert pv.n_truncated == 3 and pv.problems == []  # older turns dropped, no system prompt: not judged


def test_preview_prints_the_lengths_before_the_cut_and_the_length_that_keeps_them(tmp_path, tiny_model_dir, capsys):
    data = write_jsonl(tmp_path / "drone.jsonl", [_drone(i) for i in range(3)])
    cfg = tiny_run_config(tiny_model_dir, data, None, tmp_path / "out")
    (tmp_path / "c.yaml").write_text(json.dumps(cfg))
    assert main(["data", "preview", "-c", str(tmp_path / "c.yaml"), "data.chat_template=builtin-tools", "-n", "0"]) == 1
    out = " ".join(capsys.readouterr().out.split())
    assert "before the cut" in out and "keeps them whole" in out  # rows of the summary table (its cells wrap)
    assert "error 3 examples are longer than data.max_length=64" in out and "checks passed" not in out


def test_an_eval_file_is_judged_too(tmp_path, tok):
    short = [{"messages": [{"role": "user", "content": f"hi {i}"}, {"role": "assistant", "content": "hello"}]}
             for i in range(4)]
    d = DataConfig(train_file=str(write_jsonl(tmp_path / "t.jsonl", short)), max_length=128,
                   eval_file=str(write_jsonl(tmp_path / "e.jsonl", [_drone(0), _drone(1)])))
    with pytest.raises(UserError, match=r"e\.jsonl: 2 examples are longer than data.max_length=128"):
        prepare_data(d, tok, tmp_path / "cache", 0)


def test_drop_that_leaves_nothing_names_the_max_length_and_it_works(tmp_path, tok):
    d = DataConfig(train_file=str(write_jsonl(tmp_path / "d.jsonl", [_drone(0), _drone(1)])), max_length=128,
                   eval_fraction=0.0, lossy_truncation="drop")
    with pytest.raises(UserError, match=r"data.lossy_truncation=drop left out every example.*data.max_length=(\d+) "
                                        r"keeps them whole") as err:
        prepare_data(d, tok, tmp_path / "cache", 0)
    needed = int(str(err.value).split("data.max_length=")[-1].split()[0])
    train, _, _ = prepare_data(d.model_copy(update={"max_length": needed}), tok, tmp_path / "cache", 0)
    assert len(train) == 2 and max(train.lengths()) == needed
