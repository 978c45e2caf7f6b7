"""Advice that does not mislead (issue 55 problem 6 / point 7): each refusal names the setting that fixes it, and each
suggested fix is applied here and the preview (or the config load) then goes on: near-miss config keys, a record
shape rocktune does not know (data.columns), a preference file given to supervised fine-tuning (the fix keeps the
question with its answer)."""

from __future__ import annotations

import json

import pytest

from rocktune.cli import main
from rocktune.config import load_config
from rocktune.errors import UserError
from tests.conftest import write_jsonl


@pytest.mark.parametrize("given,hint,fixed", [
    ("training.learning_rate=1e-4", "did you mean 'lr'?", "training.lr=1e-4"),
    ("learning_rate=1e-4", "did you mean 'training.lr'?", "training.lr=1e-4"),
    ("training.max_seq_length=512", "did you mean 'data.max_length'?", "data.max_length=512"),
    ("training.gradient_accumulation_steps=4", "did you mean 'grad_accum'?", "training.grad_accum=4"),
    ("lora.lora_alpha=8", "did you mean 'alpha'?", "lora.alpha=8"),
    ("training.max_length=512", "did you mean 'data.max_length'?", "data.max_length=512"),
])
def test_near_miss_keys_get_the_key_they_meant(given, hint, fixed):
    with pytest.raises(UserError, match=f"unknown key '{given.split('=')[0]}'; {hint}"):
        load_config(None, [given, "data.train_file=d.jsonl"])
    cfg = load_config(None, [fixed, "data.train_file=d.jsonl"])  # the hint, applied
    section, key = fixed.split("=")[0].split(".")
    assert getattr(getattr(cfg, section), key) == pytest.approx(float(fixed.split("=")[1]))


def _preview(data, model, *more) -> int:
    return main(["data", "preview", "--data", str(data), "--model", str(model), "-n", "1", "--json", *more])


def test_unknown_record_shape_names_data_columns_and_the_mapping_works(tmp_path, tiny_model_dir, capsys):
    data = write_jsonl(tmp_path / "qa.jsonl", [{"question": f"add {i} {i} =", "answer": f" {2 * i}"}
                                               for i in range(4)])
    assert _preview(data, tiny_model_dir) == 2
    err = capsys.readouterr().err
    assert "unknown record shape" in err and "data.columns" in err and "'conversations'" in err
    assert _preview(data, tiny_model_dir, "data.columns={prompt: question, completion: answer}") == 0
    pv = json.loads(capsys.readouterr().out)
    assert pv["problems"] == [] and pv["n_kept"] == 4


def test_preference_pairs_in_sft_get_advice_that_keeps_the_question(tmp_path, tiny_model_dir, capsys):
    implicit = [{"chosen": [{"role": "user", "content": f"q{i}?"}, {"role": "assistant", "content": "yes"}],
                 "rejected": [{"role": "user", "content": f"q{i}?"}, {"role": "assistant", "content": "no"}]}
                for i in range(4)]
    data = write_jsonl(tmp_path / "trl.jsonl", implicit)
    assert _preview(data, tiny_model_dir) == 2
    assert "data.columns: {messages: chosen}" in capsys.readouterr().err
    assert _preview(data, tiny_model_dir, "data.columns={messages: chosen}") == 0  # the advice, applied
    pv = json.loads(capsys.readouterr().out)
    text = "".join(run[0] for run in pv["examples"][0]["runs"])
    assert pv["problems"] == [] and "q0?" in text and "yes" in text  # the question kept with its answer

    openai = [{"input": {"messages": [{"role": "user", "content": f"q{i}?"}]},
               "preferred_output": [{"role": "assistant", "content": "yes"}],
               "non_preferred_output": [{"role": "assistant", "content": "no"}]} for i in range(4)]
    data = write_jsonl(tmp_path / "openai.jsonl", openai)
    assert _preview(data, tiny_model_dir) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "task: dpo" in err and "{messages: preferred_output}" not in err
    assert "r['input']['messages'] + r['preferred_output']" in err
    joined = [{"messages": r["input"]["messages"] + r["preferred_output"]} for r in openai]  # the .map it advises
    assert _preview(write_jsonl(tmp_path / "joined.jsonl", joined), tiny_model_dir) == 0
    pv = json.loads(capsys.readouterr().out)
    text = "".join(run[0] for run in pv["examples"][0]["runs"])
    assert pv["problems"] == [] and "q0?" in text and "yes" in text
    assert _preview(data, tiny_model_dir, "task=dpo") == 0  # the other advice: DPO takes the file as it is


def test_a_record_missing_a_key_names_data_columns_and_the_mapping_works(tmp_path, tiny_model_dir, capsys):
    data = write_jsonl(tmp_path / "pa.jsonl", [{"prompt": f"add {i} {i} =", "answer": f" {2 * i}"} for i in range(4)])
    assert _preview(data, tiny_model_dir) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "record is missing 'completion'" in err and "data.columns: {completion: <its column>}" in err
    assert _preview(data, tiny_model_dir, "data.columns={completion: answer}") == 0
    assert json.loads(capsys.readouterr().out)["problems"] == []
