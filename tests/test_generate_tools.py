"""generate --file with tools and --compare (issue 55, point 6): the line's tools go through the run's chat template,
base and adapter answer side by side, and a template that would drop the tools is refused before a weight loads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from rocktune.cli import main
from tests.export_fixtures import build_model, make_run
from tests.test_generate import argmax_loop

QWEN_TEMPLATE = Path(__file__).parent / "data" / "templates" / "Qwen-Qwen2.5-7B-Instruct.jinja"
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city now.",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]
ASK = [{"role": "user", "content": "What is the weather in Oslo?"}]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """The tiny Qwen2 with a context that holds Qwen2.5's tool preamble in its small vocabulary's tokens."""
    out = build_model(tmp_path_factory.mktemp("tools") / "base", "qwen2")
    cfg = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**cfg, "max_position_embeddings": 4096}))  # rotary: no table
    return out


def tool_run(run: Path, base: Path, template: Path | None):
    """A chat run (data.chat_template: ``template``) with random LoRA weights; returns its PeftModel."""
    model = make_run(run, base, ["q_proj", "v_proj"], data_format="messages")
    cfg = {"model": {"name_or_path": str(base)}, "data": {"format": "messages"}}
    if template is not None:
        cfg["data"]["chat_template"] = str(template)
    for f in (run / "config.yaml", run / "adapter" / "rocktune_config.yaml"):
        f.write_text(yaml.safe_dump(cfg))
    return model


def answer(model, tok, text: str, n: int = 12) -> str:
    ids = tok(text, add_special_tokens=False)["input_ids"]
    stops = {tok.eos_token_id, tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")}
    return tok.decode(argmax_loop(model, ids, stops, n), skip_special_tokens=True)


def test_file_tools_reach_the_template_and_compare_answers_side_by_side(base, tmp_path, capsys):
    from transformers import AutoTokenizer

    model = tool_run(tmp_path / "run", base, QWEN_TEMPLATE)
    tok = AutoTokenizer.from_pretrained(base)
    jinja = QWEN_TEMPLATE.read_text()
    with_tools = tok.apply_chat_template(ASK, tools=TOOLS, chat_template=jinja, tokenize=False,
                                         add_generation_prompt=True)
    without = tok.apply_chat_template(ASK, chat_template=jinja, tokenize=False, add_generation_prompt=True)
    assert "get_weather" in with_tools and "get_weather" not in without
    lines = [{"messages": ASK, "tools": TOOLS}, {"messages": ASK},
             {"messages": ASK, "tools": json.dumps(TOOLS)}]  # LLaMA-Factory's JSON string of the list
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps(x) + "\n" for x in lines))
    assert main(["generate", str(tmp_path / "run"), "--file", str(prompts), "--compare", "--max-new-tokens", "12",
                 "--device", "cpu"]) == 0
    rows = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    with model.disable_adapter():
        base_with, base_without = answer(model, tok, with_tools), answer(model, tok, without)
    tuned_with, tuned_without = answer(model, tok, with_tools), answer(model, tok, without)
    assert [(r["base_output"], r["output"]) for r in rows] == \
        [(base_with, tuned_with), (base_without, tuned_without), (base_with, tuned_with)]
    assert [r["messages"] for r in rows] == [ASK] * 3 and rows[0]["tools"] == TOOLS  # the line, given back
    assert tuned_with != base_with  # the adapter is on for "output", off for "base_output"


def test_tools_the_template_would_drop_are_refused_before_loading(base, tmp_path, capsys, monkeypatch):
    import rocktune.export.generate as generate

    tool_run(tmp_path / "run", base, None)  # the base's own ChatML template ignores tools
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"messages": ASK}) + "\n" + json.dumps({"messages": ASK, "tools": TOOLS}) + "\n")
    monkeypatch.setattr(generate, "load", lambda *a: pytest.fail("the model was loaded before the refusal"))
    assert main(["generate", str(tmp_path / "run"), "--file", str(prompts), "--device", "cpu"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert f"{prompts}:2: the chat template does not render the line's tools (get_weather)" in err


def test_tools_on_a_raw_run_and_compare_without_prompts_are_refused(base, tmp_path, capsys):
    make_run(tmp_path / "raw", base, ["q_proj"])  # prompt_completion: prompted as raw text
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "add 3 4 =", "tools": TOOLS}) + "\n")
    assert main(["generate", str(tmp_path / "raw"), "--file", str(prompts), "--device", "cpu"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert f"{prompts}:1: the line gives 'tools'" in err and "--template raw" in err
    assert main(["generate", str(tmp_path / "raw"), "--chat", "--compare", "--device", "cpu"]) == 2
    assert "give it --prompt TEXT or --file PROMPTS.jsonl" in " ".join(capsys.readouterr().err.split())
