"""rocktune's built-in tool-calling template (issue 55 point 1): a tool set on a model whose template ignores tools
is refused with ``data.chat_template: builtin-tools`` as the fix; with it the preview passes, the tool list and the
calls are in the trained text, no identity or system prompt the data did not hold appears anywhere (the rendering,
the Modelfile), and the Ollama TEMPLATE renders a conversation as the Jinja text does."""

from __future__ import annotations

import json

import pytest

from rocktune import builtin_templates as bt
from rocktune.cli import main
from rocktune.data import records
from rocktune.data.encode import IGNORE, encode
from rocktune.errors import UserError
from rocktune.export import ollama_templates as ot
from rocktune.export.ollama import modelfile
from rocktune.readers.template import use_template
from tests.conftest import tiny_run_config, write_jsonl
from tests.family_fixtures import TEMPLATES, build_tokenizer
from tests.test_chat_data import OPENAI_TOOLS, SHAREGPT_TOOLS
from tests.test_ollama_templates import CONVERSATIONS, canonical, needs_go, render_go  # noqa: F401 (fixture)

SHAPES = {"chatml": "chatml", "llama3": "llama3", "gemma": "gemma"}  # family fixture -> built-in shape
IDENTITY = ("You are", "Qwen", "Alibaba", "assistant named", "created by")


def _builtin(family: str):
    return use_template(build_tokenizer(TEMPLATES[family]), bt.NAME)


def _rec(raw: dict) -> dict:
    return records.prepare([("r", raw)], "messages")[0]


@pytest.mark.parametrize("family", sorted(SHAPES))
def test_builtin_template_trains_the_tool_list_and_the_calls(family):
    tok = _builtin(family)
    assert tok.chat_template.startswith(bt.TAG % SHAPES[family])
    for raw in (OPENAI_TOOLS, SHAREGPT_TOOLS):
        enc = encode(_rec(raw), "messages", tok, 4096, False, "r")
        text = tok.decode(enc.input_ids)
        trained = tok.decode([t for i, (t, lab) in enumerate(zip(enc.input_ids, enc.labels)) if lab != IGNORE and i])
        assert '"name": "get_weather", "description": "Weather of a city"' in text  # the tool list, as prompt
        assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in trained
        assert "It is 21 degrees." in trained and '{"temp": 21}' in text and '{"temp": 21}' not in trained
        assert not any(word in text for word in IDENTITY)


@pytest.mark.parametrize("family", sorted(SHAPES))
def test_builtin_template_adds_no_system_turn_the_data_did_not_have(family):
    tok = _builtin(family)
    plain = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]
    text = tok.apply_chat_template(plain, tokenize=False)
    own = build_tokenizer(TEMPLATES[family]).apply_chat_template(plain, tokenize=False)
    assert text == own  # a conversation without tools renders exactly as the model's own template renders it
    with_system = tok.apply_chat_template([{"role": "system", "content": "Be terse."}, *plain], tokenize=False)
    assert with_system.count("Be terse.") == 1 and not any(word in with_system for word in IDENTITY)


def test_builtin_template_refuses_a_turn_format_it_does_not_come_in():
    with pytest.raises(UserError, match=r"data.chat_template=builtin-tools: .*chatml, llama3, gemma.*data.tools: drop"):
        use_template(build_tokenizer(TEMPLATES["mistral"]), bt.NAME)


@pytest.mark.parametrize("family", sorted(SHAPES))
def test_modelfile_of_the_builtin_template_has_its_template_and_no_system(family):
    tok = _builtin(family)
    text, notes = modelfile("model.gguf", "chat", tok, None)
    assert ot.family_of(tok.chat_template) == f"{bt.NAME}:{SHAPES[family]}" and not notes
    assert f'TEMPLATE """{bt.ollama(bt.SHAPES[list(SHAPES).index(family)])}"""' in text
    assert "SYSTEM" not in text and not any(word in text for word in IDENTITY)


@needs_go
@pytest.mark.parametrize("family", sorted(SHAPES))
@pytest.mark.parametrize("conv", CONVERSATIONS, ids=[c[0] for c in CONVERSATIONS])
def test_ollama_template_renders_as_the_builtin_jinja(render_go, family, conv):  # noqa: F811 (the fixture)
    _, messages, tools = conv
    tok = _builtin(family)
    want = tok.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    if tok.bos_token and want.startswith(tok.bos_token):
        want = want[len(tok.bos_token):]  # llama.cpp's tokenizer adds it
    family_name = ot.family_of(tok.chat_template)
    assert canonical(render_go(ot.template_for(family_name), messages, tools)) == canonical(want)


def test_tool_set_on_a_template_without_tools_is_refused_and_the_fix_works(tmp_path, tiny_model_dir, capsys):
    """The demo model's ChatML ignores tools: the preview refuses the set naming the one-line fix; applying it,
    the preview passes and shows the tools and the call in the tokens, with no identity line."""
    data = write_jsonl(tmp_path / "tools.jsonl", [OPENAI_TOOLS] * 4)
    cfg = tiny_run_config(tiny_model_dir, data, None, tmp_path / "out")
    (tmp_path / "c.yaml").write_text(json.dumps(cfg))
    assert main(["data", "preview", "-c", str(tmp_path / "c.yaml"), "--json"]) == 2
    err = capsys.readouterr().err
    assert "does not render the record's tool list (get_weather)" in err and "data.chat_template: builtin-tools" in err
    assert "Qwen" not in err
    assert main(["data", "preview", "-c", str(tmp_path / "c.yaml"), "data.chat_template=builtin-tools",
                 "data.max_length=1024", "--json", "-n", "1"]) == 0
    pv = json.loads(capsys.readouterr().out)
    assert pv["problems"] == [] and pv["n_kept"] == 4
    text = "".join(run[0] for run in pv["examples"][0]["runs"])
    trained = "".join(run[0] for run in pv["examples"][0]["runs"] if run[1])
    assert "<tools>" in text and '"name": "get_weather"' in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in trained
    assert not any(word in text for word in IDENTITY)


@pytest.mark.real_model
def test_smollm2_with_the_builtin_template_trains_tools_without_its_default_identity(request):
    """SmolLM2-135M-Instruct's own template ignores tools and writes "You are a helpful AI assistant named SmolLM"
    into a conversation without a system prompt; the built-in template keeps its ChatML turns and neither."""
    from tests.test_demo_real import _real_model_wanted

    _real_model_wanted(request)
    from transformers import AutoTokenizer

    from rocktune.demo import gguf_model

    gguf = gguf_model.find_gguf()
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    user = [{"role": "user", "content": "Who are you?"}]
    assert "SmolLM" in tok.apply_chat_template(user, tokenize=False)  # its own template's default
    tok = use_template(tok, bt.NAME)
    enc = encode(_rec(OPENAI_TOOLS), "messages", tok, 4096, False, "r")
    text = tok.decode(enc.input_ids)
    trained = tok.decode([t for i, (t, lab) in enumerate(zip(enc.input_ids, enc.labels)) if lab != IGNORE and i])
    assert "<tools>" in text and '"arguments": {"city": "Paris"}' in trained and "It is 21 degrees." in trained
    assert "SmolLM" not in text and not any(word in text for word in IDENTITY)
    assert tok.apply_chat_template(user, tokenize=False, add_generation_prompt=True) == \
        "<|im_start|>user\nWho are you?<|im_end|>\n<|im_start|>assistant\n"


def test_a_run_trained_with_the_builtin_template_exports_it_without_a_system_line(tiny_model_dir, tmp_path):
    """Trained end to end through data.chat_template: builtin-tools: the run's tokenizer (what generate and export
    load) carries the built-in template, a question to the model renders with no system turn, and the Modelfile has
    the built-in TEMPLATE and no SYSTEM."""
    from rocktune.config import config_from_dict
    from rocktune.export.source import load_tokenizer, resolve
    from rocktune.tasks import train

    data = write_jsonl(tmp_path / "tools.jsonl", [OPENAI_TOOLS] * 6)
    cfg = tiny_run_config(tiny_model_dir, data, None, tmp_path / "out", max_steps=1, micro_batch_size=2,
                          grad_accum=1)
    cfg["data"].update(max_length=700, eval_fraction=0.0, chat_template=bt.NAME)
    train(config_from_dict(cfg), quiet=True)
    tok = load_tokenizer(resolve(str(tmp_path / "out")))
    assert tok.chat_template == bt.jinja(bt.SHAPES[0])  # ChatML turns, as the demo model's own template
    asked = tok.apply_chat_template([{"role": "user", "content": "Who are you?"}], tokenize=False,
                                    add_generation_prompt=True)
    assert asked == "<|im_start|>user\nWho are you?<|im_end|>\n<|im_start|>assistant\n"
    text, notes = modelfile("model.gguf", "chat", tok, None)
    assert f'TEMPLATE """{bt.ollama(bt.SHAPES[0])}"""' in text and "SYSTEM" not in text and not notes


def test_a_preference_pair_with_tools_is_refused_with_the_builtin_fix_and_the_fix_works():
    """DPO's pairs: the same refusal names the same one-line fix, and with it the call is the trained answer."""
    from rocktune.demo.tiny import build_tokenizer as tiny_tokenizer
    from rocktune.tasks.preference.pairs import encode_pair, read_pair
    from tests.test_preference_formats import _tool_pair

    pair = read_pair(_tool_pair(), "r0")
    with pytest.raises(UserError, match=r"r0: .*does not render the pair's tool list.*data.chat_template: builtin"):
        encode_pair(pair, tiny_tokenizer(), 2048, "prompt", "r0")
    tok = use_template(tiny_tokenizer(), bt.NAME)
    ids, labels = encode_pair(pair, tok, 2048, "prompt", "r0").chosen
    assert "<tools>" in tok.decode(ids) and not any(word in tok.decode(ids) for word in IDENTITY)
    assert tok.decode([t for t, lab in zip(ids, labels) if lab != IGNORE]) == (
        '<tool_call>\n{"name": "lookup_plant", "arguments": {"name": "snake plant"}}\n</tool_call><|im_end|>\n')
