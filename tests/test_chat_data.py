"""Chat and tool-calling data as the ecosystem writes it (issue 38), tokenised with real chat templates.

Each format is a row of a table: the record as another tool writes it, the template it is rendered with, and the
text of every run of trained tokens. The tokens must equal the template's own rendering of the conversation (with
``tools=``), token by token, and the trained positions must be exactly those runs; the broken variant of each format
is refused with the row and the fix.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rocktune.config import DataConfig
from rocktune.data import records
from rocktune.data.dataset import tokenize_file
from rocktune.data.encode import IGNORE, encode
from rocktune.errors import UserError
from tests.conftest import write_jsonl
from tests.family_fixtures import Template, build_tokenizer

TEMPLATES = Path(__file__).parent / "data" / "templates"
CHATML = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
SPECS = {
    "qwen2.5": ("Qwen-Qwen2.5-7B-Instruct.jinja", CHATML, "<|im_end|>", None),
    "qwen3": ("Qwen-Qwen3-0.6B.jinja", CHATML, "<|im_end|>", None),
    "llama3.1": ("meta-llama-Llama-3.1-8B-Instruct.jinja",
                 ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
                  "<|eom_id|>", "<|python_tag|>"), "<|eot_id|>", "<|begin_of_text|>"),
    "mistral-nemo": ("mistralai-Mistral-Nemo-Instruct-2407.jinja",
                     ("<s>", "</s>", "[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]",
                      "[TOOL_RESULTS]", "[/TOOL_RESULTS]"), "</s>", "<s>"),
}
_TOKENIZERS: dict = {}


def real(name: str):
    """A byte-level tokenizer carrying the model's real chat template and special tokens."""
    if name not in _TOKENIZERS:
        file, specials, eos, bos = SPECS[name]
        _TOKENIZERS[name] = build_tokenizer(Template((TEMPLATES / file).read_text(), specials, eos, eos, bos))
    return _TOKENIZERS[name]


WEATHER = {"name": "get_weather", "description": "Weather of a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
# LLaMA-Factory's tool-calling ShareGPT (its glaive_toolcall demo's layout): tools as a JSON string
SHAREGPT_TOOLS = {"conversations": [
    {"from": "human", "value": "Weather in Paris?"},
    {"from": "function_call", "value": json.dumps({"name": "get_weather", "arguments": {"city": "Paris"}})},
    {"from": "observation", "value": '{"temp": 21}'},
    {"from": "gpt", "value": "It is 21 degrees."}], "tools": json.dumps([WEATHER])}
# the same conversation as OpenAI / HF messages: arguments as a JSON string, content null on the call
OPENAI_TOOLS = {"messages": [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call00001", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call00001", "content": '{"temp": 21}'},
    {"role": "assistant", "content": "It is 21 degrees."}], "tools": [{"type": "function", "function": WEATHER}]}
QWEN_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>\n'

FORMATS = [
    # (id, template, record, data.roles, the trained runs)
    ("sharegpt", "qwen2.5", {"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello!"}],
                             "system": "Be brief."}, {}, ["Hello!<|im_end|>\n"]),
    ("sharegpt-multi-turn", "qwen2.5", {"conversations": [
        {"from": "system", "value": "S"}, {"from": "human", "value": "Q1"}, {"from": "gpt", "value": "A1"},
        {"from": "human", "value": "Q2"}, {"from": "gpt", "value": "A2"}]}, {}, ["A1<|im_end|>\n", "A2<|im_end|>\n"]),
    ("sharegpt-mapped-tags", "qwen2.5", {"conversations": [{"from": "customer", "value": "Hi"},
                                                          {"from": "bot", "value": "Yes?"}]},
     {"customer": "user", "bot": "assistant"}, ["Yes?<|im_end|>\n"]),
    ("sharegpt-tools", "qwen2.5", SHAREGPT_TOOLS, {}, [QWEN_CALL, "It is 21 degrees.<|im_end|>\n"]),
    ("openai-tools", "qwen2.5", OPENAI_TOOLS, {}, [QWEN_CALL, "It is 21 degrees.<|im_end|>\n"]),
    ("openai-tools-qwen3", "qwen3", OPENAI_TOOLS, {},
     [QWEN_CALL, "<think>\n\n</think>\n\nIt is 21 degrees.<|im_end|>\n"]),
    ("openai-tools-llama3.1", "llama3.1", OPENAI_TOOLS, {},
     ['{"name": "get_weather", "parameters": {"city": "Paris"}}<|eot_id|>', "It is 21 degrees.<|eot_id|>"]),
    ("openai-tools-mistral", "mistral-nemo", OPENAI_TOOLS, {},
     ['[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "call00001"}]</s>',
      "It is 21 degrees.</s>"]),
    # ShareGPT has no call ids; Mistral's template pairs calls and results by nine-character ids: given in order
    ("sharegpt-tools-mistral", "mistral-nemo", SHAREGPT_TOOLS, {},
     ['[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "call00001"}]</s>',
      "It is 21 degrees.</s>"]),
    ("sharegpt-tools-llama3.1", "llama3.1", SHAREGPT_TOOLS, {},
     ['{"name": "get_weather", "parameters": {"city": "Paris"}}<|eot_id|>', "It is 21 degrees.<|eot_id|>"]),
    ("parallel-calls", "qwen2.5", {"messages": [
        {"role": "user", "content": "Paris and Rome?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
            {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Rome"}}}]},
        {"role": "tool", "content": '{"temp": 21}'}, {"role": "tool", "content": '{"temp": 25}'},
        {"role": "assistant", "content": "21 and 25."}], "tools": [WEATHER]}, {},
     ['Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n<tool_call>\n'
      '{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call><|im_end|>\n', "21 and 25.<|im_end|>\n"]),
    ("content-parts", "qwen2.5", {"messages": [
        {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "Hello"}]}]}, {}, ["Hello<|im_end|>\n"]),
    ("loss-weight-0", "qwen2.5", {"messages": [
        {"role": "user", "content": "Q1"}, {"role": "assistant", "content": "bad answer", "loss_weight": 0},
        {"role": "user", "content": "Q2"}, {"role": "assistant", "content": "A2", "loss_weight": 1}]}, {},
     ["A2<|im_end|>\n"]),
    ("axolotl-weight-0", "qwen2.5", {"conversations": [
        {"from": "human", "value": "Q1"}, {"from": "gpt", "value": "A1", "weight": 0},
        {"from": "human", "value": "Q2"}, {"from": "gpt", "value": "A2"}]}, {}, ["A2<|im_end|>\n"]),
]


def trained_runs(tokenizer, enc) -> list[str]:
    """The text of each run of consecutive loss-bearing tokens (a label at position 0 is never trained)."""
    runs, cur = [], []
    for i, (tok, lab) in enumerate(zip(enc.input_ids, enc.labels)):
        if lab != IGNORE and i > 0:
            assert lab == tok
            cur.append(tok)
        elif cur:
            runs.append(tokenizer.decode(cur))
            cur = []
    return runs + ([tokenizer.decode(cur)] if cur else [])


def own_tokens(tokenizer, chat: dict) -> list[int]:
    """The conversation as the template itself renders and tokenises it."""
    text = tokenizer.apply_chat_template(chat["messages"], tools=chat.get("tools"), tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("fmt,template,rec,roles,runs", FORMATS, ids=[f[0] for f in FORMATS])
def test_format_trains_the_template_rendering_on_the_replies_only(fmt, template, rec, roles, runs):
    tok = real(template)
    chat = records.prepare([("x", rec)], "messages", roles)[0]
    enc = encode(chat, "messages", tok, 4096, False, "x")
    assert enc.input_ids == own_tokens(tok, chat)
    assert trained_runs(tok, enc) == runs
    untrained = tok.decode([t for t, lab in zip(enc.input_ids, enc.labels) if lab == IGNORE])
    if "tools" in chat:  # the tool list and the tool's result are context, never trained
        assert "Weather of a city" in untrained and "temp" in untrained
        assert not any("Weather of a city" in r or "temp" in r for r in runs)


def test_sharegpt_and_openai_tool_records_are_the_same_conversation():
    tok = real("qwen2.5")
    a, b = records.prepare([("a", SHAREGPT_TOOLS), ("b", OPENAI_TOOLS)], "messages")
    ea, eb = (encode(c, "messages", tok, 4096, False, "x") for c in (a, b))
    assert (ea.input_ids, ea.labels) == (eb.input_ids, eb.labels)


BROKEN = [
    ("unknown-tag", {"conversations": [{"from": "bot", "value": "x"}]},
     r"conversations\[0\] has the role tag 'bot'.*data\.roles: \{bot: assistant\}"),
    ("no-assistant", {"conversations": [{"from": "human", "value": "x"}]}, r"no assistant turn"),
    ("image-part", {"messages": [{"role": "user", "content": [{"type": "text", "text": "see"},
                                                             {"type": "image_url", "image_url": {"url": "a.png"}}]},
                                 {"role": "assistant", "content": "ok"}]},
     r"x: messages\[0\]\.content\[1\] is a 'image_url' part.*cannot take images"),
    ("function-call-not-json", {"conversations": [{"from": "human", "value": "q"},
                                                  {"from": "function_call", "value": "get_weather(Paris)"}]},
     r"function_call turn whose value is not JSON"),
    ("tools-not-json", {**SHAREGPT_TOOLS, "tools": "[{oops"}, r"'tools' is a string that is not JSON"),
    ("arguments-not-json", {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": "{city: Paris}"}}]}]},
     r"the arguments of 'f' are not JSON"),
    ("system-twice", {"system": "S", "conversations": [{"from": "system", "value": "T"},
                                                       {"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]},
     r"'system' column and its conversation starts with a system turn"),
    ("fractional-loss-weight", {"messages": [{"role": "user", "content": "q"},
                                             {"role": "assistant", "content": "a", "loss_weight": 0.5}]},
     r"loss_weight=0\.5; rocktune honours a per-message weight of 0 or 1"),
    ("weight-on-user", {"messages": [{"role": "user", "content": "q", "loss_weight": 1},
                                     {"role": "assistant", "content": "a"}]}, r"data\.train_on_prompt=true"),
    ("kto-label", {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
                   "label": False}, r"KTO-style 'label'.*undesirable ones included"),
    ("kto-tag", {"prompt": "q", "completion": "a", "kto_tag": True}, r"KTO-style 'kto_tag'"),
    ("preference-pair", {"prompt": "q", "completion": "a", "chosen": "a", "rejected": "b"},
     r"preference pair.*DPO/ORPO.*\{completion: chosen\} \(the 'prompt' stays the question"),
    ("record-weight", {"prompt": "q", "completion": "a", "weight": 2.0}, r"weight=2\.0; rocktune weights every"),
    ("trl-conversational-preference", {"prompt": [{"role": "user", "content": "q"}],
                                       "chosen": [{"role": "assistant", "content": "a"}],
                                       "rejected": [{"role": "assistant", "content": "b"}]}, r"preference pair"),
]


@pytest.mark.parametrize("case,rec,error", BROKEN, ids=[b[0] for b in BROKEN])
def test_broken_variant_is_refused_with_the_row_and_the_fix(case, rec, error):
    with pytest.raises(UserError, match=error) as info:
        records.prepare([("x", rec)], records.detect_shape([("x", rec)], "auto"))
    assert str(info.value).startswith("x:")


def test_a_tool_call_cut_by_max_length_is_not_trained():
    tok = real("qwen2.5")
    chat = records.prepare([("x", OPENAI_TOOLS)], "messages")[0]
    text = tok.decode(encode(chat, "messages", tok, 4096, False, "x").input_ids)

    def tokens_before(marker: str) -> int:
        return len(tok(text[:text.index(marker)], add_special_tokens=False)["input_ids"])

    call_at = tokens_before('<tool_call>\n{"name": "get_weather"')
    # data.truncation=end cuts inside the call: its start stays as context, none of it is trained
    enc = encode(chat, "messages", tok, call_at + 10, False, "x", truncation="end")
    assert tok.decode(enc.input_ids).endswith('assistant\n<tool_call') and trained_runs(tok, enc) == []
    # data.truncation=prompt: the oldest prompt goes first, then the end is cut, inside the 82-token call
    enc = encode(chat, "messages", tok, 60, False, "x", truncation="prompt")
    assert enc.truncated and enc.completion_cut and '{"name": "get_weather"' in tok.decode(enc.input_ids)
    assert trained_runs(tok, enc) == []
    # a cut after the call keeps the whole call trained (the plain reply is cut, as any reply is)
    enc = encode(chat, "messages", tok, tokens_before("It is") + 3, False, "x", truncation="end")
    assert trained_runs(tok, enc) == [QWEN_CALL, "It "]


@pytest.mark.parametrize("streaming", [False, True])
def test_pipeline_equals_the_reference_and_names_unused_keys(tmp_path, streaming):
    """Through datasets (Arrow unifies the tool-call structs across rows), the batched encoder and the cache: the
    rows equal the per-record reference, and keys the shape does not use are named with their counts."""
    tok = real("qwen2.5")
    rows = [dict(SHAREGPT_TOOLS, id=i) for i in range(3)] + [
        {"conversations": [{"from": "human", "value": f"Q{i}"}, {"from": "gpt", "value": f"A{i}"}], "id": 9,
         "source": "web"} for i in range(2)]
    f = write_jsonl(tmp_path / "d.jsonl", rows)
    ex, stats = tokenize_file(str(f), DataConfig(max_length=4096, streaming=streaming), tok, tmp_path / "cache")
    want = [encode(c, "messages", tok, 4096, False, "x")
            for c in records.prepare([("x", r) for r in rows], "messages")]
    assert [list(r) for r in ex.input_ids] == [w.input_ids for w in want]
    assert [list(r) for r in ex.labels] == [w.labels for w in want]
    assert stats.shape == "messages"
    note = next(n for n in stats.notes if "does not use" in n)
    assert "'id' (5 of 5 records), 'source' (2 of 5 records)" in note


def test_pipeline_refuses_kto_data_naming_the_line(tmp_path):
    rows = [{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}], "label": True},
            {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "b"}], "label": False}]
    f = write_jsonl(tmp_path / "kto.jsonl", rows)
    with pytest.raises(UserError, match=r"kto\.jsonl:1: the record has a KTO-style 'label'"):
        tokenize_file(str(f), DataConfig(max_length=256), real("qwen2.5"), tmp_path / "cache")


def test_columns_map_a_renamed_conversation(tmp_path):
    """LLaMA-Factory's dataset_info `columns: {messages: dialog}`: data.columns does the same."""
    rows = [{"dialog": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Yo"}]}]
    f = write_jsonl(tmp_path / "d.jsonl", rows)
    tok = real("qwen2.5")
    ex, _ = tokenize_file(str(f), DataConfig(max_length=256, columns={"conversations": "dialog"}), tok,
                          tmp_path / "cache")
    assert tok.decode([t for t, lab in zip(ex.input_ids[0], ex.labels[0]) if lab != IGNORE]) == "Yo<|im_end|>\n"


def test_preview_shows_the_trained_tool_call(tmp_path):
    from rocktune.data.preview import build_preview

    tok = real("qwen2.5")
    f = write_jsonl(tmp_path / "d.jsonl", [SHAREGPT_TOOLS, dict(SHAREGPT_TOOLS, id=1)])
    pv = build_preview(str(f), "auto", tok, 4096, False, n_show=1, data=DataConfig(eval_fraction=0))
    trained = "".join(text for text, is_trained, _ in pv.examples[0]["runs"] if is_trained)
    assert trained == QWEN_CALL + "It is 21 degrees.<|im_end|>\n"
    assert pv.shape == "messages" and not [p for p in pv.problems if p["level"] == "error"]
    assert any("'id' (1 of 2 records)" in n for n in pv.truncation_notes)


@pytest.mark.parametrize("template", ["qwen2.5", "llama3.1"])
def test_batched_encoder_equals_the_reference_on_tool_conversations(template):
    """The batched encoder (numpy truncation) and the per-record reference agree on tool conversations at every
    cut, the unfinished-call rule included."""
    from rocktune.data import fastencode

    tok = real(template)
    chats = records.prepare([(f"r{i}", r) for i, r in enumerate([SHAREGPT_TOOLS, OPENAI_TOOLS, FORMATS[1][2]])],
                            "messages")
    layout = fastencode.chat_layout(tok)
    for ml in (24, 60, 120, 200, 300, 4096):
        for cut in ("prompt", "end"):
            settings = fastencode.EncodeSettings("messages", ml, False, cut)
            got = fastencode.encode_many(chats, tok, settings, ["x"] * len(chats), layout)
            assert got == [encode(c, "messages", tok, ml, False, "x", cut) for c in chats], (ml, cut)


def test_train_on_sharegpt_tool_data_end_to_end(tiny_model_dir, tmp_path):
    """`rocktune train` on LLaMA-Factory-style tool-calling ShareGPT data with a model carrying Qwen2.5's template:
    the run completes, its notes name the unused keys, and export/generate prompt it with the chat template."""
    import shutil

    from rocktune.config import config_from_dict
    from rocktune.export import style
    from rocktune.tasks import train
    from tests.conftest import tiny_run_config

    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    shutil.copy(TEMPLATES / "Qwen-Qwen2.5-7B-Instruct.jinja", model / "chat_template.jinja")
    rows = [dict(SHAREGPT_TOOLS, id=i) for i in range(8)]
    cfg = tiny_run_config(model, write_jsonl(tmp_path / "train.jsonl", rows), None, tmp_path / "out", max_steps=2,
                          micro_batch_size=2, grad_accum=1)
    cfg["data"].update(max_length=1200, eval_fraction=0.25)
    train(config_from_dict(cfg), quiet=True)
    info = json.loads((tmp_path / "out" / "run_info.json").read_text())
    assert (tmp_path / "out" / "adapter" / "adapter_config.json").is_file()
    assert any("'id' (8 of 8 records)" in n for n in info["notes"])
    from transformers import AutoTokenizer

    assert style.resolve_style("auto", cfg, AutoTokenizer.from_pretrained(model)) == "chat"
