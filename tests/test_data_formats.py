"""Instruction records through the chat template (data.chat_template), plain text files (data.text_split), and
what export and generate take from them (issue 38)."""

from __future__ import annotations

import pytest

from rocktune.config import DataConfig
from rocktune.data.dataset import tokenize_file
from rocktune.data.encode import ALPACA_NO_INPUT, IGNORE
from rocktune.errors import UserError
from rocktune.export import style
from tests.conftest import write_jsonl

ALPACA = {"instruction": "Add.", "input": "1 and 2", "output": "3", "system": "Be exact."}
PC = {"prompt": "reverse abc =", "completion": " cba"}


def rows_of(ex, tokenizer) -> list[tuple[str, str]]:
    """(the whole example, its trained tokens) as text, per example."""
    return [(tokenizer.decode(list(ids)), tokenizer.decode([t for i, (t, lab) in enumerate(zip(ids, labs))
                                                            if lab != IGNORE and i > 0]))
            for ids, labs in zip(ex.input_ids, ex.labels)]


def chat_text(tokenizer, msgs) -> str:
    return tokenizer.apply_chat_template(msgs, tokenize=False)


@pytest.mark.parametrize("setting,rec,templated", [
    ("auto", ALPACA, True), ("always", ALPACA, True), ("never", ALPACA, False),
    ("auto", PC, False), ("always", PC, True), ("never", PC, False)])
def test_chat_template_setting_for_instruction_records(tmp_path, tokenizer, setting, rec, templated):
    f = write_jsonl(tmp_path / "d.jsonl", [rec])
    ex, stats = tokenize_file(str(f), DataConfig(max_length=512, chat_template=setting), tokenizer, tmp_path / "c")
    [(text, trained)] = rows_of(ex, tokenizer)
    if not templated:
        assert stats.shape in ("alpaca", "prompt_completion") and "<|im_start|>" not in text
        assert trained == (rec.get("output") or rec["completion"]) + "<|endoftext|>"
        if "instruction" in rec:  # the unused system column is named, not silently dropped
            assert text.startswith(ALPACA_NO_INPUT.split("\n")[0][:20])
            assert any("'system' (1 of 1 records)" in n for n in stats.notes)
        return
    user = "Add.\n1 and 2" if "instruction" in rec else "reverse abc ="
    msgs = ([{"role": "system", "content": "Be exact."}] if "system" in rec else []) + [
        {"role": "user", "content": user}, {"role": "assistant", "content": rec.get("output") or rec["completion"]}]
    assert stats.shape == "messages" and text == chat_text(tokenizer, msgs)
    assert trained == msgs[-1]["content"] + "<|im_end|>\n"
    assert any(f"rendered through the model's chat template (data.chat_template={setting};" in n
               for n in stats.notes)


def test_alpaca_history_becomes_earlier_turns(tmp_path, tokenizer):
    rec = {"instruction": "And 2+2?", "output": "4", "history": [["1+1?", "2"]]}
    ex, _ = tokenize_file(str(write_jsonl(tmp_path / "d.jsonl", [rec])), DataConfig(max_length=512), tokenizer,
                          tmp_path / "c")
    [(text, trained)] = rows_of(ex, tokenizer)
    assert text == chat_text(tokenizer, [{"role": "user", "content": "1+1?"}, {"role": "assistant", "content": "2"},
                                         {"role": "user", "content": "And 2+2?"},
                                         {"role": "assistant", "content": "4"}])
    assert trained == "2<|im_end|>\n4<|im_end|>\n"


def test_always_without_a_template_is_refused(tmp_path, tiny_model_dir):
    from transformers import AutoTokenizer

    bare = AutoTokenizer.from_pretrained(tiny_model_dir)
    bare.chat_template = None
    f = write_jsonl(tmp_path / "d.jsonl", [ALPACA])
    with pytest.raises(UserError, match="data.chat_template=always, but this tokenizer has no chat template"):
        tokenize_file(str(f), DataConfig(max_length=512, chat_template="always"), bare, tmp_path / "c")


@pytest.mark.parametrize("split,want", [
    ("document", ["para one\nline two\n\n\npara two\n", "# Title\n\nbody\n"]),
    ("paragraph", ["para one\nline two", "para two", "# Title", "body"]),
    ("line", ["para one", "line two", "para two", "# Title", "body"]),
    ("auto", ["para one\nline two\n\n\npara two\n", "# Title\n\nbody\n"]),  # a folder: a document per file
])
def test_text_folder_split(tmp_path, tokenizer, split, want):
    folder = tmp_path / "corpus"
    (folder / "sub").mkdir(parents=True)
    (folder / "a.txt").write_text("para one\nline two\n\n\npara two\n")
    (folder / "sub" / "b.md").write_text("# Title\n\nbody\n")
    (folder / "notes.json").write_text("{}")  # not text: not read
    ex, stats = tokenize_file(str(folder), DataConfig(max_length=512, text_split=split), tokenizer, tmp_path / "c")
    assert stats.shape == "text" and "(text, " in stats.source
    # every token is trained, the first one excepted (nothing precedes it)
    assert rows_of(ex, tokenizer) == [(t + "<|endoftext|>", t[1:] + "<|endoftext|>") for t in want]


def test_single_text_file_splits_by_paragraph(tmp_path, tokenizer):
    f = tmp_path / "book.txt"
    f.write_text("Chapter 1\n\nIt was a dark night.\n\n\n")
    ex, _ = tokenize_file(str(f), DataConfig(max_length=512), tokenizer, tmp_path / "c")
    assert [t for t, _ in rows_of(ex, tokenizer)] == ["Chapter 1<|endoftext|>", "It was a dark night.<|endoftext|>"]


@pytest.mark.parametrize("name,content,error", [
    ("empty.md", b"", r"empty\.md is empty"),
    ("latin1.txt", "caf\u00e9\n".encode("latin-1"), r"latin1\.txt: cannot be read as UTF-8 text.*save it as UTF-8"),
])
def test_broken_text_file_is_refused(tmp_path, tokenizer, name, content, error):
    f = tmp_path / name
    f.write_bytes(content)
    with pytest.raises(UserError, match=error):
        tokenize_file(str(f), DataConfig(max_length=512), tokenizer, tmp_path / "c")


@pytest.mark.parametrize("rec,data,want", [
    (ALPACA, {}, "chat"), (ALPACA, {"chat_template": "never"}, "alpaca"), (PC, {}, "raw"),
    (PC, {"chat_template": "always"}, "chat"),
    ({"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]}, {}, "chat")])
def test_export_and_generate_follow_what_was_trained(tmp_path, tokenizer, rec, data, want):
    f = write_jsonl(tmp_path / "d.jsonl", [rec])
    assert style.resolve_style("auto", {"data": {"train_file": str(f), **data}}, tokenizer) == want


def test_text_files_export_as_raw(tmp_path, tokenizer):
    (tmp_path / "a.txt").write_text("x")
    assert style.resolve_style("auto", {"data": {"train_file": str(tmp_path / "a.txt")}}, tokenizer) == "raw"
    assert style.resolve_style("auto", {"data": {"train_file": str(tmp_path)}}, tokenizer) == "raw"


@pytest.mark.parametrize("data,error", [
    ({"roles": {"bot": "robot"}}, r"data\.roles\.bot: Input should be 'system', 'user', 'assistant', 'tool' or "
                                  r"'function_call' \(got 'robot'\)"),
    ({"chat_template": "sometimes"}, r"data\.chat_template: .*must be auto, always, never, builtin-tools, or a chat "
                                     r"template file ending in \.jinja"),
    ({"text_split": "sentence"}, r"data\.text_split: Input should be"),
])
def test_new_data_settings_are_checked(data, error):
    from rocktune.config import config_from_dict

    with pytest.raises(UserError, match=error):
        config_from_dict({"data": data})
