"""A chat template's own default system prompt (Qwen2.5's "You are Qwen, created by Alibaba Cloud...", Granite's
"You are Granite...") is trained into every conversation that has none, so the model learns the identity it names
(issue 55 point 1): the data checks find it from the template alone and say it, with the way out; a template that
adds none, data with its own system prompts, and rocktune's built-in tool template give no warning."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rocktune.cli import main
from rocktune.data.checks import template_default_system
from tests.conftest import tiny_run_config, write_jsonl

TEMPLATES = Path(__file__).parent / "data" / "templates"
CHATS = [{"messages": [{"role": "user", "content": f"What is {i} + 1?"},
                       {"role": "assistant", "content": f"{i + 1}."}]} for i in range(6)]


@pytest.fixture
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.mark.parametrize("name, default", [
    ("Qwen-Qwen2.5-7B-Instruct.jinja", "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."),
    ("Qwen-Qwen3-0.6B.jinja", ""),
    ("meta-llama-Llama-3.1-8B-Instruct.jinja", ""),  # its date lines frame any system prompt: no default
    ("google-gemma-2-2b-it.jinja", ""),  # no system turn at all
    ("mistralai-Mistral-Nemo-Instruct-2407.jinja", ""),
])
def test_the_default_system_prompt_is_read_off_the_template(tokenizer, name, default):
    tokenizer.chat_template = (TEMPLATES / name).read_text()
    assert template_default_system(tokenizer) == default


def test_granites_default_names_granite(tokenizer):
    tokenizer.chat_template = (TEMPLATES / "ibm-granite-granite-3.3-2B-Instruct.jinja").read_text()
    assert "You are Granite" in template_default_system(tokenizer)


def _preview(tmp_path, model_dir, rows, *overrides) -> list[dict]:
    cfg = tiny_run_config(model_dir, write_jsonl(tmp_path / "chats.jsonl", rows), None, tmp_path / "out")
    cfg["data"]["chat_template"] = str(TEMPLATES / "Qwen-Qwen2.5-7B-Instruct.jinja")
    (tmp_path / "c.yaml").write_text(json.dumps(cfg))
    return [cfg, ["data", "preview", "-c", str(tmp_path / "c.yaml"), "--json", "-n", "0", *overrides]]


def test_the_preview_says_the_identity_a_borrowed_template_trains(tmp_path, tiny_model_dir, capsys):
    _, argv = _preview(tmp_path, tiny_model_dir, CHATS)
    assert main(argv) == 0
    problems = json.loads(capsys.readouterr().out)["problems"]
    said = [p for p in problems if p["code"] == "template-default-system"]
    assert len(said) == 1 and said[0]["level"] == "warning"
    assert "'You are Qwen, created by Alibaba Cloud." in said[0]["message"]
    assert "6 of the 6 checked" in said[0]["message"] and "data.chat_template: builtin-tools" in said[0]["message"]


def test_own_system_prompts_or_the_builtin_template_say_nothing(tmp_path, tiny_model_dir, capsys):
    with_system = [{"messages": [{"role": "system", "content": "You answer sums."}, *r["messages"]]} for r in CHATS]
    _, argv = _preview(tmp_path, tiny_model_dir, with_system)
    assert main(argv) == 0
    assert not [p for p in json.loads(capsys.readouterr().out)["problems"] if p["code"] == "template-default-system"]
    _, argv = _preview(tmp_path, tiny_model_dir, CHATS, "data.chat_template=builtin-tools")
    assert main(argv) == 0
    assert not [p for p in json.loads(capsys.readouterr().out)["problems"] if p["code"] == "template-default-system"]
