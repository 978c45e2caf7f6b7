"""Multi-turn chat on every chat template rocktune is tested with: the family matrix's (tests/family_fixtures.py's
TEMPLATES) and every released template under tests/data/templates. Conversations of 1, 2 and 4 turns, with and
without a system turn, with and without a tool call and its result between turns, with and without reasoning on the
replies. Each must encode to exactly the template's own rendering (``apply_chat_template``, with the end token
data/turnend.py appends where a template writes none: GLM), train every reply's text and call, each reply a span of
its own, and no user, system or tool text; the batched pipeline (``fastencode``: the one-rendering layout where it
applies) must give the same tokens and labels. What a template cannot render is skipped here, with the reason, and
``test_what_a_template_cannot_render_is_refused`` shows rocktune refusing it.

gpt-oss's Harmony template was refused on every multi-turn conversation (a past reply's end was taken as "<|", the
common start of <|end|> and <|return|>) and Phi-3.5's trained that "<|" as two bytes of text (its tokens were not the
template's); this matrix is what keeps that class of bug from hiding again."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from rocktune.data import fastencode, turnend
from rocktune.data.chat import to_chat
from rocktune.data.encode import encode
from rocktune.errors import UserError
from tests.family_fixtures import TEMPLATES, Template, build_tokenizer, trained_spans
from tests.family_templates import RELEASED

CHATML = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
GRANITE = ("<|end_of_text|>", "<|start_of_role|>", "<|end_of_role|>")
PHI = ("<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>")
# released template -> (specials, eos, bos), or the matrix template whose special tokens it takes
OWN = {
    "Qwen-Qwen2.5-7B-Instruct.jinja": (CHATML, "<|im_end|>", None),
    "Qwen-Qwen3-0.6B.jinja": (CHATML, "<|im_end|>", None),
    "meta-llama-Llama-3.1-8B-Instruct.jinja": (("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                                                "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>", "<|python_tag|>"),
                                               "<|eot_id|>", "<|begin_of_text|>"),
    "mistralai-Mistral-Nemo-Instruct-2407.jinja": (("<s>", "</s>", "[INST]", "[/INST]", "[TOOL_CALLS]",
                                                    "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]",
                                                    "[/TOOL_RESULTS]"), "</s>", "<s>"),
    "google-gemma-2-2b-it.jinja": (("<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>"), "<end_of_turn>", "<bos>"),
    "microsoft-Phi-3.5-mini-instruct.jinja": (PHI + ("<|end|>",), "<|endoftext|>", None),
    "allenai-OLMo-2-1124-7B-SFT.jinja": (PHI, "<|endoftext|>", "<|endoftext|>"),
    "ibm-granite-granite-3.3-2B-Instruct.jinja": (GRANITE, "<|end_of_text|>", None),
    "ibm-granite-granite-4.0.jinja": (GRANITE, "<|end_of_text|>", None),
}
LIKE = {"Qwen-Qwen3.5-4B.jinja": ("qwen3.5", ()), "openai-gpt-oss-120b.jinja": ("harmony", ()),
        "zai-org-GLM-4.6.jinja": ("glm4.5", ()),
        "google-gemma-4-31B-it.jinja": ("gemma4", ("<|channel>", "<channel|>", '<|"|>', "<|think|>"))}


def _released(file: str) -> Template:
    text = (RELEASED / file).read_text(encoding="utf-8")
    if file in OWN:
        specials, eos, bos = OWN[file]
        return Template(text, specials, eos, eos, bos)
    key, more = LIKE[file]
    return replace(TEMPLATES[key], text=text, specials=TEMPLATES[key].specials + more)


# every template once: a released template the matrix uses as it is (Qwen3.5's, gpt-oss's) under its matrix name
CASES = {f"shape:{key}": t for key, t in TEMPLATES.items()}
CASES |= {f"released:{f}": _released(f) for f in sorted({**OWN, **LIKE})
          if _released(f).text not in {t.text for t in TEMPLATES.values()}}

NO_SYSTEM = {  # case -> why the template cannot take a system turn
    "shape:mistral": "the template has no system role (it raises)",
    "shape:gemma": "the template has no system role (it raises)",
    "released:google-gemma-2-2b-it.jinja": "Gemma 2's template raises 'System role not supported'",
    "released:mistralai-Mistral-Nemo-Instruct-2407.jinja": "Mistral Nemo's template writes the system prompt into "
    "the conversation's last message only when that is a user turn: a conversation ending on a reply loses it",
}
NO_TOOLS = {  # case -> why the template cannot train a tool call
    **{f"shape:{key}": "the matrix's shape of this family renders no tools" for key in
       ("chatml", "chatml-generation", "llama3", "mistral", "gemma", "phi3", "olmo2", "granite")},
    "released:allenai-OLMo-2-1124-7B-SFT.jinja": "OLMo 2's template ignores the tool list",
    "released:microsoft-Phi-3.5-mini-instruct.jinja": "Phi-3.5's template ignores the tool list",
    "released:ibm-granite-granite-3.3-2B-Instruct.jinja": "Granite 3.3's template renders the tool list, not calls",
    "released:google-gemma-2-2b-it.jinja": "Gemma 2's template has no tool role (it raises on a tool turn)",
}
NO_EARLY_TOOLS = {  # case -> why a tool call before the last user turn cannot be trained
    "released:mistralai-Mistral-Nemo-Instruct-2407.jinja": "Mistral Nemo's template writes the tool list before "
    "the last user turn only: a call in an earlier turn renders without it in the whole conversation",
}

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


def conversation(turns: int, system: bool, tools: bool, reasoning: bool) -> dict:
    """A record of ``turns`` user turns each answered; with ``tools`` the middle turn (the only one for 1 turn, the
    first of 2) calls a tool and answers after its result; with ``reasoning`` every reply and the call carry it."""
    msgs = [{"role": "system", "content": "System rule zebra."}] if system else []
    for k in range(turns):
        msgs.append({"role": "user", "content": f"Question {k} about walrus{k}?"})
        if tools and k == (turns - 1) // 2:
            call = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": f"Paris{k}"}}}
            msgs += [{"role": "assistant", "content": "", "tool_calls": [call]},
                     {"role": "tool", "name": "get_weather", "content": f"sunny{k} outside"}]
        msgs.append({"role": "assistant", "content": f"Answer {k} is heron{k}."})
    if reasoning:
        for k, m in enumerate(x for x in msgs if x["role"] == "assistant"):
            m["reasoning_content"] = f"Pondering step {k} quietly."
    return {"messages": msgs, **({"tools": TOOLS} if tools else {})}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    """The tokenizer of a case, built once: a model whose stops come from its generation config (GLM's <|user|> and
    <|observation|>) is loaded from a folder holding that file, as a real model is."""
    from transformers import AutoTokenizer

    built = {}

    def get(case: str):
        if case not in built:
            t = CASES[case]
            tok = build_tokenizer(t)
            if t.stops:
                folder = tmp_path_factory.mktemp("model")
                tok.save_pretrained(folder)
                stops = tok.convert_tokens_to_ids([t.eos, *t.stops])
                (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": stops}), encoding="utf-8")
                tok = AutoTokenizer.from_pretrained(folder)
            built[case] = (tok, fastencode.chat_layout(tok))
        return built[case]

    return get




def test_every_released_template_is_in_the_matrix():
    assert {p.name for p in RELEASED.glob("*.jinja")} == set(OWN) | set(LIKE)
    assert set(NO_SYSTEM) | set(NO_TOOLS) | set(NO_EARLY_TOOLS) <= set(CASES)


@pytest.mark.parametrize("reasoning", [False, True], ids=["plain", "reasoning"])
@pytest.mark.parametrize("tools", [False, True], ids=["no-tools", "tool-call"])
@pytest.mark.parametrize("system", [False, True], ids=["no-system", "system"])
@pytest.mark.parametrize("turns", [1, 2, 4])
@pytest.mark.parametrize("case", list(CASES))
def test_multi_turn_conversation_is_the_templates_rendering(tokenizer, case, turns, system, tools, reasoning):
    if system and case in NO_SYSTEM:
        pytest.skip(NO_SYSTEM[case])
    if tools and case in NO_TOOLS:
        pytest.skip(NO_TOOLS[case])
    if tools and turns > 1 and case in NO_EARLY_TOOLS:
        pytest.skip(NO_EARLY_TOOLS[case])
    tok, layout = tokenizer(case)
    chat = to_chat(conversation(turns, system, tools, reasoning), "row 1", {})
    msgs = chat["messages"]
    enc = encode(chat, "messages", tok, 8192, False, "row 1")

    own = tok.apply_chat_template(msgs, tokenize=True, return_dict=True, **({"tools": TOOLS} if tools else {}))
    appended = turnend.reply_end(tok).appended(msgs)  # GLM: the stop the template writes only when a turn follows
    assert enc.input_ids == list(own["input_ids"]) + ([tok.convert_tokens_to_ids(appended)] if appended else [])

    spans = trained_spans(tok, enc)
    replies = [m for m in msgs if m["role"] == "assistant"]
    assert len(spans) == len(replies), spans  # each reply trained, and on its own
    for reply, span in zip(replies, spans, strict=True):
        for call in reply.get("tool_calls", ()):
            assert "get_weather" in span and call["function"]["arguments"]["city"] in span, span
        assert reply["content"] in span, span
    trained = "".join(spans)
    assert not [m["content"] for m in msgs if m["role"] != "assistant" and m["content"] in trained]
    ends = set(turnend.reply_end(tok).ids(tok))
    assert ends & set(enc.labels), "the end of the conversation's last reply is trained"

    # the batched pipeline train runs (the one-rendering layout where the template allows it) gives the same
    batched = fastencode.encode_many([chat], tok, fastencode.EncodeSettings("messages", 8192, False), ["row 1"],
                                     layout)[0]
    assert (batched.input_ids, batched.labels) == (enc.input_ids, enc.labels)


REFUSED = [  # (case, conversation(turns, system, tools, reasoning), what the refusal says)
    *[(case, (2, True, False, False), r"no system role|System role not supported|messages\[0\] \(system\): the "
      r"model's chat template does not render its system text") for case in NO_SYSTEM],
    *[(case, (2, False, True, False), r"does not render the record's tool list|does not render its call of "
      r"'get_weather'|roles must alternate") for case in NO_TOOLS],
    *[(case, (2, False, True, False), r"messages\[1\] \(assistant\): the chat template renders the conversation up "
      r"to this turn differently once later turns follow .*\[AVAILABLE_TOOLS\].* Give each assistant turn a record "
      r"of its own") for case in NO_EARLY_TOOLS],
]


@pytest.mark.parametrize(("case", "shape", "said"), REFUSED,
                         ids=[f"{c}-{'system' if s[1] else 'tools'}" for c, s, _ in REFUSED])
def test_what_a_template_cannot_render_is_refused(tokenizer, case, shape, said):
    """Each combination skipped above is refused, never trained as if the template had rendered it."""
    tok, _ = tokenizer(case)
    with pytest.raises(UserError, match=said):
        encode(to_chat(conversation(*shape), "row 1", {}), "messages", tok, 8192, False, "row 1")
