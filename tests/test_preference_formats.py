"""OpenAI's preference format, nested data.columns, and pairs that teach nothing (issue 46).

The OpenAI file (tests/data/openai_preference.jsonl) is written in OpenAI's published shape: ``input.messages`` (a
system or developer turn, content as a string or text parts), an empty ``tools`` list, ``preferred_output`` and
``non_preferred_output``. It must read as TRL's conversational pairs read; pairs without signal are named with their
kind, count and rows, dropped while a minority and refused as a majority (``preference.no_signal``).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from rocktune.config import DataConfig
from rocktune.tasks.preference import signal as pair_signal
from rocktune.data.rows import read_rows
from rocktune.tasks.preference.pairs import PairText, encode_kinds, encode_screened, read_pair
from rocktune.errors import UserError
from tests.conftest import write_jsonl

OPENAI = Path(__file__).parent / "data" / "openai_preference.jsonl"
SYSTEM = "You answer questions about caring for houseplants in two or three sentences."


def _rows(path: Path, **data) -> list:
    d = DataConfig(train_file=str(path), **data)
    return read_rows(str(path), d, path.parent / "unused-cache", "data.train_file")


def test_openai_rows_read_as_trl_conversational_pairs():
    rows = [r for _, r in _rows(OPENAI)]
    first = read_pair(rows[0], "r0")
    assert first == PairText(
        [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "How often should I water a snake plant?"}],
        [{"role": "assistant", "content": rows[0]["preferred_output"][0]["content"]}],
        [{"role": "assistant", "content": "Water it every day so it never dries out."}], True)
    assert read_pair(rows[3], "r3").prompt[0] == {"role": "system", "content": SYSTEM}  # developer: the system role
    parts = read_pair(rows[4], "r4")  # content as text parts, on both sides of the pair
    assert parts.prompt[1]["content"] == "What soil suits a cactus?"
    assert parts.chosen[0]["content"].startswith("A gritty")


def test_nested_columns_map_openai_fields_like_the_native_reader():
    mapped = _rows(OPENAI, columns={"prompt": "input.messages", "chosen": "preferred_output",
                                    "rejected": "non_preferred_output"})
    assert [read_pair(r, "x") for _, r in mapped] == [read_pair(r, "x") for _, r in _rows(OPENAI)]
    with pytest.raises(UserError, match=r"data.columns maps to \['input.prompt'\].*nested field is named with dots"):
        _rows(OPENAI, columns={"prompt": "input.prompt"})


def test_nested_columns_reach_an_sft_conversation_in_parquet(tmp_path, tokenizer):
    """data.columns with a dotted name through datasets (parquet): a struct's field, as datasets' flatten names it."""
    import datasets

    from rocktune.data.dataset import tokenize_file

    rows = [{"input": {"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]},
             "id": i} for i in range(3)]
    f = tmp_path / "d.parquet"
    datasets.Dataset.from_list(rows).to_parquet(str(f))
    ex, stats = tokenize_file(str(f), DataConfig(columns={"messages": "input.messages"}), tokenizer, tmp_path / "c")
    assert len(ex) == 3 and tokenizer.decode(ex.input_ids[2]).endswith("<|im_start|>assistant\na2<|im_end|>\n")
    assert "messages<-input.messages" in stats.source


def _tool_pair() -> dict:
    """An OpenAI pair whose preferred answer calls a tool from input.tools, the other answers without it."""
    row = json.loads(OPENAI.read_text().splitlines()[0])
    row["input"]["tools"] = [{"type": "function", "function": {
        "name": "lookup_plant", "description": "Care sheet of a plant",
        "parameters": {"type": "object", "properties": {"name": {"type": "string"}}}}}]
    row["preferred_output"] = [{"role": "assistant", "content": None, "tool_calls": [{
        "id": "call_p1", "type": "function", "function": {"name": "lookup_plant",
                                                          "arguments": json.dumps({"name": "snake plant"})}}]}]
    return row


def test_a_pair_with_tools_renders_them_or_is_refused(tokenizer):
    """input.tools and a tool call in an answer go to the chat template; a template that drops either is refused
    (meaning never lost), as in SFT."""
    from rocktune.tasks.preference.pairs import encode_pair
    from tests.test_chat_data import real

    pair = read_pair(_tool_pair(), "r0")
    assert pair.tools[0]["function"]["name"] == "lookup_plant"
    qwen = real("qwen2.5")
    enc = encode_pair(pair, qwen, 2048, "prompt", "r0")
    ids, labels = enc.chosen
    assert "<tools>" in qwen.decode(ids) and "lookup_plant" in qwen.decode(ids[:labels.count(-100)])
    assert qwen.decode([t for t, lab in zip(ids, labels) if lab != -100]) == (
        '<tool_call>\n{"name": "lookup_plant", "arguments": {"name": "snake plant"}}\n</tool_call><|im_end|>\n')
    with pytest.raises(UserError, match=r"r0: the model's chat template does not render the pair's tool list "
                                        r"\(lookup_plant\)"):
        encode_pair(pair, tokenizer, 2048, "prompt", "r0")
    no_list = dataclasses.replace(pair, tools=None)
    with pytest.raises(UserError, match=r"r0: messages\[0\] \(assistant\): the model's chat template does not "
                                        r"render its call of 'lookup_plant'"):
        encode_pair(no_list, tokenizer, 2048, "prompt", "r0")
    with pytest.raises(UserError, match=r"r1: the pair has a 'tools' list but its prompt and answers are text"):
        read_pair({"prompt": "q", "chosen": "a", "rejected": "b", "tools": pair.tools}, "r1")
    with pytest.raises(UserError, match=r"r2: OpenAI's preference format needs .*\(missing "
                                        r"\['non_preferred_output'\]\)"):
        read_pair({"input": {"messages": []}, "preferred_output": []}, "r2")


def test_sft_names_an_openai_preference_file_and_the_task_to_use(tokenizer, tmp_path):
    from rocktune.data.dataset import tokenize_file

    with pytest.raises(UserError, match=r"openai_preference.jsonl:1: the record is a preference pair \(OpenAI's "
                                        r"'preferred_output' and 'non_preferred_output'\).*task=dpo"):
        tokenize_file(str(OPENAI), DataConfig(), tokenizer, tmp_path / "c")


PROMPT = [{"role": "user", "content": "Name a prime."}]
GOOD, BAD = [{"role": "assistant", "content": "Seven."}], [{"role": "assistant", "content": "Nine."}]
KINDS = {
    "identical": {"prompt": PROMPT, "chosen": GOOD, "rejected": GOOD},
    "whitespace": {"prompt": "Name a prime:", "chosen": " Seven.", "rejected": " Seven. \n"},
    # conversational pairs that share no prompt: each answer follows a different question
    "no-prompt": {"chosen": PROMPT + GOOD, "rejected": [{"role": "user", "content": "Name an even number."}] + BAD},
    "cut": {"prompt": "Name a prime:", "chosen": " Seven, as it happens" + "!" * 40 + " yes",
            "rejected": " Seven, as it happens" + "!" * 40 + " no"},
}


def _pairs(tmp_path, n_good: int, bad: list[str]) -> list:
    rows = [{"prompt": PROMPT, "chosen": GOOD, "rejected": BAD}] * n_good + [KINDS[k] for k in bad]
    return _rows(write_jsonl(tmp_path / "p.jsonl", rows))


def test_each_kind_without_signal_is_named(tmp_path, tokenizer):
    rows = _pairs(tmp_path, 1, list(KINDS))
    kinds = [k for _, k in encode_kinds(rows, tokenizer, 48, "end")]
    assert kinds == [None, "identical", "whitespace", "no-prompt", "cut"]
    found = pair_signal.summary([(where, k) for (where, _), k in zip(rows, kinds)])
    assert found["no-prompt"] == {"count": 1, "rows": [f"{tmp_path / 'p.jsonl'}:4"]}


def test_a_few_are_dropped_with_a_warning_and_most_are_refused(tmp_path, tokenizer):
    d = DataConfig(max_length=256)
    rows = _pairs(tmp_path, 5, ["identical", "identical"])
    pairs, _, notes = encode_screened(rows, tokenizer, d, "auto", "p.jsonl")
    assert len(pairs) == 5
    assert notes == [f"warning: 2 of 7 pairs of p.jsonl carry no preference signal: 2 where chosen and rejected are "
                     f"the same ({tmp_path / 'p.jsonl'}:6, {tmp_path / 'p.jsonl'}:7); they were dropped "
                     "(preference.no_signal=auto; refuse stops instead)"]
    with pytest.raises(UserError, match=r"2 of 7 pairs .* Refused \(preference.no_signal=refuse\)"):
        encode_screened(rows, tokenizer, d, "refuse", "p.jsonl")
    most = _pairs(tmp_path, 1, ["identical", "whitespace"])
    with pytest.raises(UserError, match=r"2 of 3 pairs of p.jsonl carry no preference signal: 1 where chosen and "
                                        r"rejected are the same .*; 1 where .* only in whitespace .* Refused \(most "
                                        r"of the file\).*preference.no_signal=drop"):
        encode_screened(most, tokenizer, d, "auto", "p.jsonl")
    assert len(encode_screened(most, tokenizer, d, "drop", "p.jsonl")[0]) == 1
    with pytest.raises(UserError, match=r"Refused \(every pair\)"):
        encode_screened(_pairs(tmp_path, 0, ["identical"]), tokenizer, d, "drop", "p.jsonl")


def test_data_preview_with_data_honours_task_dpo_and_reports_the_pairs(tmp_path, tiny_model_dir, capsys):
    """`rocktune data preview --data FILE --model M task=dpo` previews pairs (the override was ignored before)."""
    from rocktune.cli import main

    assert main(["data", "preview", "--data", str(OPENAI), "--model", str(tiny_model_dir), "task=dpo", "--json",
                 "data.max_length=512"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["n_pairs"] == 6 and out["max_length"] == 512 and out["no_signal"] == {} and out["problems"] == []
    bad = write_jsonl(tmp_path / "same.jsonl", [KINDS["identical"]] * 3)
    assert main(["data", "preview", "--data", str(bad), "--model", str(tiny_model_dir), "task=dpo", "--json"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["no_signal"]["identical"]["count"] == 3 and out["problems"][0]["level"] == "error"
