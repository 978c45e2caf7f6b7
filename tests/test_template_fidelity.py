"""Meaning never lost to a template (issue 46): a record's tool list, tool calls, system prompt and text must be in
what the model's chat template renders, or the record is refused with the reason and the fix; ``data.tools: drop``
trains without them, explicitly. Checked on each family's template shape (tests/family_fixtures.py), the demo model's
ChatML, the families' real templates (tests/data/templates) and, with -m real_model, SmolLM2-135M-Instruct's own."""

from __future__ import annotations

from pathlib import Path

import pytest

from rocktune.config import DataConfig
from rocktune.data import records
from rocktune.data.dataset import tokenize_file
from rocktune.data.encode import IGNORE, encode
from rocktune.errors import UserError
from tests.family_fixtures import TEMPLATES, Template, build_tokenizer
from tests.test_chat_data import OPENAI_TOOLS, SHAREGPT_TOOLS, real
from tests.test_ollama_templates import REAL

DATA = Path(__file__).parent / "data"
SYSTEM = {"messages": [{"role": "system", "content": "Answer in French."}, {"role": "user", "content": "Hi"},
                       {"role": "assistant", "content": "Bonjour."}]}
NO_LIST = {"messages": OPENAI_TOOLS["messages"]}  # calls without a tool list: the calls are what vanishes
TOOL_LIST = r"the model's chat template does not render the record's tool list \(get_weather\)"
CALL = r"messages\[1\] \(assistant\): the model's chat template does not render its call of 'get_weather'"
FIX = r"data\.tools: drop"


def _encode(rec: dict, tok, drop: bool = False):
    return encode(records.prepare([("r", rec)], "messages", drop_tools=drop)[0], "messages", tok, 4096, False, "r")


def _trained(tok, enc) -> str:
    return tok.decode([t for i, (t, lab) in enumerate(zip(enc.input_ids, enc.labels)) if lab != IGNORE and i > 0])


def _real(name: str):
    spec = REAL[name]
    if isinstance(spec, str):
        return real(spec)
    file, specials, eos, bos = spec
    return build_tokenizer(Template((DATA / "templates" / file).read_text(), specials, eos, eos, bos))


@pytest.mark.parametrize("family", sorted(f for f, t in TEMPLATES.items() if "tool_calls" not in t.text))
def test_a_family_template_without_tools_refuses_tool_records_and_drop_trains_the_text(family):
    tok = build_tokenizer(TEMPLATES[family])
    for rec in (OPENAI_TOOLS, SHAREGPT_TOOLS):
        with pytest.raises(UserError, match=f"^r: {TOOL_LIST}.*{FIX}"):
            _encode(rec, tok)
    with pytest.raises(UserError, match=f"^r: {CALL}.*{FIX}"):
        _encode(NO_LIST, tok)
    enc = _encode(OPENAI_TOOLS, tok, drop=True)
    text = tok.decode(enc.input_ids)
    assert "get_weather" not in text and "temp" not in text  # the list, the call and the result are gone
    assert _trained(tok, enc).startswith("It is 21 degrees.") and "Weather in Paris?" in text


@pytest.mark.parametrize("family", sorted(f for f, t in TEMPLATES.items() if t.system))
def test_a_family_template_that_takes_a_system_turn_passes(family):
    tok = build_tokenizer(TEMPLATES[family])
    assert _trained(tok, _encode(SYSTEM, tok)).startswith(TEMPLATES[family].reply_head + "Bonjour.")


def test_a_template_that_skips_the_system_turn_is_refused_naming_it():
    """As some Phi-3 releases' templates did: the system prompt silently left out of every rendering."""
    skips = Template("{% for m in messages %}{% if m['role'] != 'system' %}<|{{ m['role'] }}|>\n{{ m['content'] }}"
                     "<|end|>\n{% endif %}{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}",
                     ("<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"), "<|end|>", "<|end|>")
    with pytest.raises(UserError, match=r"^r: messages\[0\] \(system\): the model's chat template does not render "
                                        r"its system text"):
        _encode(SYSTEM, build_tokenizer(skips))


def test_a_template_that_edits_the_reply_away_is_refused():
    edits = Template("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['role'] != 'assistant' %}"
                     "{{ m['content'] }}{% endif %}<|im_end|>\n{% endfor %}"
                     "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
                     ("<|endoftext|>", "<|im_start|>", "<|im_end|>"), "<|im_end|>", "<|im_end|>")
    with pytest.raises(UserError, match=r"messages\[2\] \(assistant\).*does not render its text"):
        _encode(SYSTEM, build_tokenizer(edits))


def test_the_demo_models_template_refuses_tool_records(tokenizer, tmp_path):
    """The demo's tiny model (ChatML without tools): the issue's case, through the whole pipeline; nothing cached."""
    f = DATA / "openai_chat_tools.jsonl"
    listed = TOOL_LIST.replace("get_weather", "search_catalog, renew_loan, place_hold")
    with pytest.raises(UserError, match=f"openai_chat_tools.jsonl:1: {listed}.*{FIX}"):
        tokenize_file(str(f), DataConfig(), tokenizer, tmp_path / "c")
    assert not (tmp_path / "c").exists()


def test_drop_trains_the_text_turns_and_counts_what_it_left_empty(tokenizer, tmp_path):
    f = DATA / "openai_chat_tools.jsonl"
    ex, stats = tokenize_file(str(f), DataConfig(tools="drop", max_length=4096), tokenizer, tmp_path / "c")
    assert len(ex) == 5  # the third record only called a tool: nothing left to answer
    assert any("1 of 6 records" in n and "data.tools=drop" in n and "openai_chat_tools.jsonl:3" in n
               for n in stats.notes)
    trained = [_trained(tokenizer, _Row(ex, i)) for i in range(len(ex))]
    assert trained[0] == "Yes: one of our three copies is on the shelf at the Main branch right now.<|im_end|>\n"
    assert not any("search_catalog" in tokenizer.decode(ex.input_ids[i]) for i in range(len(ex)))
    # weight 0 on the turn that kept its text beside the dropped calls: still not trained
    assert trained[3] == "Main has both of its copies in; Harbour's only copy is out on loan.<|im_end|>\n"


class _Row:
    def __init__(self, ex, i):
        self.input_ids, self.labels = ex.input_ids[i], ex.labels[i]


@pytest.mark.parametrize("name", ["qwen2.5", "qwen3", "llama3.1", "mistral-nemo"])
def test_real_templates_with_tool_support_pass(name):
    tok = _real(name)
    for rec in (OPENAI_TOOLS, SHAREGPT_TOOLS):
        assert "get_weather" in _trained(tok, _encode(rec, tok))


@pytest.mark.parametrize("name,error", [("phi-3.5", TOOL_LIST), ("olmo-2", TOOL_LIST),
                                        ("granite-3.3", CALL)])  # Granite 3.3 shows the list, not the calls
def test_real_templates_without_tool_support_are_refused(name, error):
    with pytest.raises(UserError, match=f"^r: {error}.*{FIX}"):
        _encode(OPENAI_TOOLS, _real(name))


def test_llama31_drops_the_text_beside_a_call_and_is_refused():
    """Llama 3.1's template writes only the call of an assistant turn that has text too."""
    rec = {"messages": [OPENAI_TOOLS["messages"][0], {**OPENAI_TOOLS["messages"][1], "content": "Let me look."},
                        *OPENAI_TOOLS["messages"][2:]], "tools": OPENAI_TOOLS["tools"]}
    with pytest.raises(UserError, match=r"messages\[1\] \(assistant\).*does not render its text"):
        _encode(rec, _real("llama3.1"))


def test_openai_files_train_with_a_template_that_has_tools(tmp_path):
    """OpenAI's chat format (tools, calls with JSON-string arguments, weight 0) and its older functions format
    (functions, function_call, function results) with Qwen2.5's template: every call is trained."""
    tok = real("qwen2.5")
    ex, _ = tokenize_file(str(DATA / "openai_chat_tools.jsonl"), DataConfig(max_length=4096), tok, tmp_path / "c")
    assert len(ex) == 6 and '"name": "place_hold"' in _trained(tok, _Row(ex, 2))
    assert '"name": "search_catalog"' not in _trained(tok, _Row(ex, 4))  # that turn had weight 0
    ex, _ = tokenize_file(str(DATA / "openai_functions.jsonl"), DataConfig(max_length=4096), tok, tmp_path / "c")
    first = _trained(tok, _Row(ex, 0))
    assert '<tool_call>\n{"name": "renew_loan", "arguments": {"loan_id": "L-0457"}}\n</tool_call>' in first
    assert "another member has a hold" in tokenizer_text(tok, ex, 0) and "<tools>" in tokenizer_text(tok, ex, 0)


def tokenizer_text(tok, ex, i: int) -> str:
    return tok.decode(ex.input_ids[i])


@pytest.mark.real_model
def test_smollm2_template_refuses_tool_records(request):
    """SmolLM2-135M-Instruct's own tokenizer and template (from the demo-real extra's GGUF file, offline)."""
    from tests.test_demo_real import _real_model_wanted

    _real_model_wanted(request)
    from transformers import AutoTokenizer

    from rocktune.demo import gguf_model

    gguf = gguf_model.find_gguf()
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    with pytest.raises(UserError, match=f"^r: {TOOL_LIST}.*{FIX}"):
        _encode(OPENAI_TOOLS, tok)
    assert "get_weather" not in tok.decode(_encode(OPENAI_TOOLS, tok, drop=True).input_ids)
    assert _trained(tok, _encode(SYSTEM, tok)).startswith("Bonjour.")
    from rocktune.export.ollama import modelfile

    text, notes = modelfile("model.gguf", "chat", tok, None)  # its Ollama TEMPLATE: ChatML without tool blocks
    assert "<|im_start|>" in text and "<tools>" not in text and "<tool_call>" not in text and not notes


QWEN_FILE = DATA / "templates" / "Qwen-Qwen2.5-7B-Instruct.jinja"


def test_a_template_file_trains_tool_data_and_export_follows_it(tiny_model_dir, tmp_path):
    """The fix the refusal names, for the demo model (ChatML without tools): data.chat_template naming a ChatML
    tool-calling template. Training renders the calls with it; export's tokenizer, the merged model and the Ollama
    TEMPLATE follow the same template (its <tools> blocks included)."""
    from rocktune.config import config_from_dict
    from rocktune.export.ollama import modelfile
    from rocktune.export.source import load_tokenizer, resolve
    from rocktune.tasks import train
    from tests.conftest import tiny_run_config

    cfg = tiny_run_config(tiny_model_dir, DATA / "openai_chat_tools.jsonl", None, tmp_path / "out", max_steps=1,
                          micro_batch_size=2, grad_accum=1)
    # 1,869 tokens: the longest conversation whole (at 1,400 the cut removed six system prompts and tool lists)
    cfg["data"].update(max_length=1869, eval_fraction=0.2, chat_template=str(QWEN_FILE))
    train(config_from_dict(cfg), quiet=True)
    tok = load_tokenizer(resolve(str(tmp_path / "out")))
    assert tok.chat_template == QWEN_FILE.read_text()
    text, notes = modelfile("model.gguf", "chat", tok, None)
    assert "<tools>" in text and "<tool_call>" in text and not notes
    plain, _ = modelfile("model.gguf", "chat", load_tokenizer(resolve(str(tiny_model_dir))), None)
    assert "TEMPLATE" in plain and "<tools>" not in plain  # the demo's own ChatML: no tool blocks it never had


def test_a_template_file_that_is_missing_or_not_jinja_is_refused(tokenizer, tmp_path):
    from rocktune.config import load_config
    from rocktune.readers.template import use_template

    with pytest.raises(UserError, match=r"data.chat_template: .*must be auto, always, never, builtin-tools, or a chat "
                                        r"template file ending in \.jinja"):
        load_config(None, ["data.train_file=x.jsonl", "data.chat_template=chatml"])
    missing = load_config(None, ["data.train_file=x.jsonl", f"data.chat_template={tmp_path / 'none.jinja'}"])
    with pytest.raises(UserError, match=r"data.chat_template=.*none.jinja cannot be read"):
        use_template(tokenizer, missing.data.chat_template)


def test_qwen3_dropping_the_reasoning_of_an_earlier_turn_is_refused():
    """Qwen3's template keeps a <think> block only after the last user turn: the earlier turn's reasoning would be
    trained away. The last turn's is rendered and passes."""
    def turn(q, a):
        reply = f"<think>\nworking {a}\n</think>\n\n{a}"
        return [{"role": "user", "content": q}, {"role": "assistant", "content": reply}]
    tok = real("qwen3")
    assert "working A1" in _trained(tok, _encode({"messages": turn("Q1", "A1")}, tok))
    with pytest.raises(UserError, match=r"messages\[1\] \(assistant\).*does not render its text \(the reply renders "
                                        r"as 'A1<\|im_end\|>\\n'\)"):
        _encode({"messages": turn("Q1", "A1") + turn("Q2", "A2")}, tok)


def test_data_preview_refuses_the_tool_file_and_drop_previews_it(tiny_model_dir, capsys):
    """The newcomer's path with the demo model: preview stops with the reason and the fix (no "checks passed");
    the override it names, given to `data preview --data`, previews the text turns."""
    import json

    from rocktune.cli import main

    f = str(DATA / "openai_chat_tools.jsonl")
    assert main(["data", "preview", "--data", f, "--model", str(tiny_model_dir)]) != 0
    err = capsys.readouterr().err
    assert "does not render the record's tool list" in " ".join(err.split()) and "data.tools: drop" in err
    assert main(["data", "preview", "--data", f, "--model", str(tiny_model_dir), "data.tools=drop", "--json",
                 "--max-length", "2048"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["n_kept"] == 5 and not [p for p in out["problems"] if p["level"] == "error"]
    assert any("data.tools=drop" in n for n in out["truncation_notes"])
