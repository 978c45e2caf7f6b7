"""The Ollama TEMPLATE of every family renders a prompt as the family's Hugging Face chat template does (issue 38).

Ollama's side is rendered by Go's text/template the way Ollama's server executes a TEMPLATE
(``tests/data/ollama_render.go``: its option, functions, message collation and fields); the Hugging Face side by
``apply_chat_template`` with the generation prompt. Each family is checked with the shape of its template in
``tests/family_fixtures.py`` and, where llama.cpp keeps one, the model's real template (``tests/data/templates``),
on a table of conversations: single and multi-turn, with and without a system prompt (where the template takes
one), with tools and tool results (where it has them); the 2025-26 families' TEMPLATEs also on a tool with every
parameter type their tool lists spell out, calls with several arguments and replies' reasoning (Ollama's .Thinking).
The strings must be equal, except that JSON is compared as JSON (Ollama writes it compactly, Jinja's ``tojson`` with
spaces) and the BOS a Jinja template writes is left to the tokenizer. Skipped, with the reason, where Go is not
installed.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from rocktune.export import ollama_templates as ot
from rocktune.export.ollama import renders_tools
from tests.family_fixtures import TEMPLATES as SHAPES
from tests.family_fixtures import Template, build_tokenizer
from tests.family_templates import OLMO3
from tests.test_chat_data import SPECS, WEATHER, real

GO = shutil.which("go")


def _go_version() -> tuple[int, int]:
    """Go's version; text/template's and/or stop at the first decisive argument from Go 1.18 (as in the Go that
    Ollama is built with), which the TEMPLATEs rely on."""
    found = re.search(r"go(\d+)\.(\d+)", subprocess.run([GO, "version"], capture_output=True, text=True).stdout)
    return (int(found.group(1)), int(found.group(2))) if found else (0, 0)


needs_go = pytest.mark.skipif(GO is None or _go_version() < (1, 18), reason="Go 1.18 or newer is not installed "
                              "(apt-get install golang): the TEMPLATEs are rendered with Go's text/template, as Ollama "
                              "renders them")
DATA = Path(__file__).parent / "data"
REAL = {
    **{name: name for name in SPECS},  # qwen2.5, qwen3, llama3.1, mistral-nemo (tests/test_chat_data.py)
    "gemma-2": ("google-gemma-2-2b-it.jinja", ("<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>"), "<end_of_turn>",
                "<bos>"),
    "phi-3.5": ("microsoft-Phi-3.5-mini-instruct.jinja",
                ("<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"), "<|endoftext|>", None),
    "olmo-2": ("allenai-OLMo-2-1124-7B-SFT.jinja", ("<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>"),
               "<|endoftext|>", "<|endoftext|>"),
    "granite-3.3": ("ibm-granite-granite-3.3-2B-Instruct.jinja",
                    ("<|end_of_text|>", "<|start_of_role|>", "<|end_of_role|>"), "<|end_of_text|>", None),
    # the 2025-26 families' released templates (Qwen3.5's and gpt-oss's are also the matrix's shapes)
    "glm-4.6": ("zai-org-GLM-4.6.jinja", SHAPES["glm4.5"].specials, "<|endoftext|>", None),
    "granite-4.0": ("ibm-granite-granite-4.0.jinja", ("<|end_of_text|>", "<|start_of_role|>", "<|end_of_role|>"),
                    "<|end_of_text|>", None),
    "gemma-4": ("google-gemma-4-31B-it.jinja", SHAPES["gemma4"].specials + ("<|channel>", "<channel|>", '<|"|>'),
                "<turn|>", "<bos>"),
}
TOOL = {"type": "function", "function": WEATHER}
CALL = {"role": "assistant", "content": "", "tool_calls": [
    {"id": "call00001", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}
RESULT = {"role": "tool", "tool_call_id": "call00001", "content": '{"temp": 21}'}
CONVERSATIONS = [
    # (id, messages, tools)
    ("user", [{"role": "user", "content": "Hi there"}], None),
    ("system-user", [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}], None),
    ("multi-turn", [{"role": "user", "content": "Q1"}, {"role": "assistant", "content": "A1"},
                    {"role": "user", "content": "Q2"}], None),
    ("system-multi-turn", [{"role": "system", "content": "S"}, {"role": "user", "content": "Q1"},
                           {"role": "assistant", "content": "A1"}, {"role": "user", "content": "Q2"}], None),
    ("tools", [{"role": "user", "content": "Weather in Paris?"}], [TOOL]),
    ("system-tools", [{"role": "system", "content": "S"}, {"role": "user", "content": "Weather in Paris?"}], [TOOL]),
    ("tool-result", [{"role": "user", "content": "Weather in Paris?"}, CALL, RESULT], [TOOL]),
    ("text-and-call", [{"role": "user", "content": "Weather in Paris?"}, {**CALL, "content": "Let me look."}, RESULT],
     [TOOL]),
    ("two-calls-two-results", [{"role": "user", "content": "Paris and Rome?"}, {**CALL, "tool_calls": [
        CALL["tool_calls"][0], {"id": "call00002", "type": "function",
                                "function": {"name": "get_weather", "arguments": {"city": "Rome"}}}]},
        RESULT, {"role": "tool", "tool_call_id": "call00002", "content": '{"temp": 25}'},
        {"role": "assistant", "content": "21 and 25."}, {"role": "user", "content": "Thanks"}], [TOOL]),
]
# For the 2025-26 families: every parameter type their tool lists spell out, and a reply's reasoning under both keys,
# as rocktune hands it to a template (Qwen's and GLM's read reasoning_content, gpt-oss's thinking; Ollama's message
# has Thinking).
THOUGHT = "Check the tool."
TRACE = [{"role": "system", "content": "S"}, {"role": "user", "content": "Weather in Paris for 2 days?"},
         {**CALL, "tool_calls": [{"id": "call00001", "type": "function", "function": {
             "name": "get_weather", "arguments": {"city": "Paris", "days": 2}}}],
          "reasoning_content": THOUGHT, "thinking": THOUGHT}, RESULT]
# a tool whose parameters take each type the templates spell out (Harmony's TypeScript, Gemma 4's declarations),
# named in alphabetical order: Ollama hands a template a map, which Go ranges over in key order
RICH_TOOL = {"type": "function", "function": {
    "name": "forecast", "description": "Forecast for a city", "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "description": "the city"}, "days": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "units": {"type": "string", "enum": ["c", "f"], "description": "degrees"}}, "required": ["city", "days"]}}}
RICH_CALL = {"role": "assistant", "content": "", "tool_calls": [{"id": "call00001", "type": "function", "function": {
    "name": "forecast", "arguments": {"city": "Paris", "days": 2, "tags": ["rain", "wind"], "units": "c"}}}]}
REASONING = [
    ("rich-tool-call", [{"role": "user", "content": "Forecast?"}, RICH_CALL,
                        {"role": "tool", "tool_call_id": "call00001", "content": "rain"}], [RICH_TOOL, TOOL]),
    ("thinking-multi-turn", [{"role": "user", "content": "Q1"}, {"role": "assistant", "content": "A1",
                             "reasoning_content": "R1", "thinking": "R1"}, {"role": "user", "content": "Q2"}], None),
    ("thinking-call", TRACE, [TOOL]),
    ("thinking-call-answer-query", [*TRACE, {"role": "assistant", "content": "Sunny.", "reasoning_content": "Done.",
                                             "thinking": "Done."}, {"role": "user", "content": "Thanks"}], [TOOL]),
]
# the 2025-26 families, their TEMPLATEs checked on tools and reasoning too (export/ollama_recent.py)
RECENT = {"qwen3.5", "harmony", "glm4.5", "llama4", "glm-4.6", "granite-4.0", "gemma-4", "olmo3-instruct"}
# shapes whose family's TEMPLATE follows the released template instead (checked on it above)
RELEASE_ONLY = {"gemma4": "the gemma4 shape is rocktune's sketch of Gemma 4's turns; the TEMPLATE follows the released "
                          "template (gemma-4)"}
# Shapes whose newlines Jinja's trim_blocks removes after a block tag ("{% endif %}\n"), unlike the models' own
# templates, which write them inside strings: the TEMPLATE follows the models (OLMo 2's and SmolLM3's turns end in
# a newline).
TRIMMED = {"olmo2": "the olmo2 shape loses its newlines to trim_blocks; OLMo 2's own template writes them",
           "chatml-generation": "the SmolLM3 shape loses a newline to trim_blocks; SmolLM3's own template writes it"}
# the families whose templates take a tool list (the others' Jinja templates ignore tools)
WITH_TOOLS = {"qwen2.5", "qwen3", "llama3.1", "mistral-nemo", "granite-3.3", *RECENT}


# shapes of released templates not at hand, checked here only (the matrix's olmo3 row has plain ChatML)
OTHER_SHAPES = {"olmo3-instruct": Template(OLMO3, ("<|endoftext|>", "<|im_start|>", "<|im_end|>"), "<|im_end|>",
                                           "<|im_end|>")}


def _tokenizer(name: str):
    if name in SHAPES or name in OTHER_SHAPES:
        return build_tokenizer(SHAPES.get(name) or OTHER_SHAPES[name])
    if name in SPECS:
        return real(name)
    file, specials, eos, bos = REAL[name]
    return build_tokenizer(Template((DATA / "templates" / file).read_text(), specials, eos, eos, bos))


@pytest.fixture(scope="module")
def render_go(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("go")
    env = {**os.environ, "GOCACHE": str(tmp / "cache"), "GOPATH": str(tmp / "path"), "GO111MODULE": "off"}
    subprocess.run([GO, "build", "-o", str(tmp / "render"), str(DATA / "ollama_render.go")], check=True, env=env,
                   capture_output=True)

    def run(template: str, messages: list[dict], tools) -> str:
        out = subprocess.run([str(tmp / "render")], input=json.dumps({"template": template, "messages": messages,
                                                                     "tools": tools}),
                             capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
        return out.stdout
    return run


def canonical(text: str) -> str:
    """Every JSON object or array in ``text`` rewritten compactly with sorted keys."""
    out, i, decoder = [], 0, json.JSONDecoder()
    while i < len(text):
        if text[i] in "{[":
            try:
                value, end = decoder.raw_decode(text, i)
            except ValueError:
                pass
            else:
                if isinstance(value, (dict, list)) and value:
                    out.append(json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False))
                    i = end
                    continue
        out.append(text[i])
        i += 1
    return "".join(out)


CASES = [(t, c) for t in [*SHAPES, *REAL, *OTHER_SHAPES] for c in CONVERSATIONS]
CASES += [(t, c) for t in sorted(RECENT) for c in REASONING]


@needs_go
@pytest.mark.parametrize("template,conv", CASES, ids=[f"{t}-{c[0]}" for t, c in CASES])
def test_ollama_template_renders_as_the_hf_template(render_go, template, conv):
    from jinja2.exceptions import TemplateError

    _, messages, tools = conv
    if tools and template not in WITH_TOOLS:
        pytest.skip(f"the {template} chat template has no tools")
    if template in TRIMMED:
        pytest.skip(TRIMMED[template])
    if template in RELEASE_ONLY:
        pytest.skip(RELEASE_ONLY[template])
    if template == "granite-3.3" and tools and messages[0]["role"] != "system":
        pytest.skip("Granite's default system prompt names today's date and changes with tools; the Modelfile's "
                    "SYSTEM is the one without tools, as rendered on the day of the export")
    tok = _tokenizer(template)
    try:
        want = tok.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    except TemplateError as exc:  # Gemma's and Mistral's refuse a system turn, Mistral a tool call without an id
        pytest.skip(f"the {template} chat template refuses this conversation ({exc})")
    if tok.bos_token and want.startswith(tok.bos_token):
        want = want[len(tok.bos_token):]  # llama.cpp's tokenizer adds it (add_bos_token)
    family = ot.family_of(tok.chat_template)
    assert family is not None, template
    user = tok.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False, add_generation_prompt=False)
    sent = list(messages)
    default = ot.FAMILIES[family].system
    if default and not any(m["role"] == "system" for m in messages):  # the Modelfile's SYSTEM, as Ollama adds it
        found = re.search(default, user, re.DOTALL)
        sent = ([{"role": "system", "content": found.group(1)}] if found else []) + sent
    got = render_go(ot.template_for(family, user, renders_tools(tok)), sent, tools)
    assert canonical(got) == canonical(want)


@pytest.mark.parametrize("template", [*SHAPES, *REAL, *OTHER_SHAPES])
def test_modelfile_has_the_family_template_and_stop(template):
    from rocktune.export.ollama import modelfile

    tok = _tokenizer(template)
    family = ot.family_of(tok.chat_template)
    text, notes = modelfile("model.gguf", "chat", tok, None)
    user = tok.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False)
    assert f'TEMPLATE """{ot.template_for(family, user, renders_tools(tok))}"""' in text and not notes
    # tool blocks only where the Jinja template has them
    assert ("<tools>" in text) == (template in ("qwen2.5", "qwen3", "qwen3.5", "glm4.5", "glm-4.6", "granite-4.0"))
    # the end of a turn, and what else ends a reply (GLM-4.5's next role tokens, Harmony's <|call|>)
    assert all(f'PARAMETER stop "{s}"' in text for s in (ot.FAMILIES[family].stop, *ot.FAMILIES[family].more_stops))
    want = {"qwen2.5": "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."}.get(template)
    assert (f'SYSTEM "{want}"' in text) if want else ("SYSTEM" not in text or template == "granite-3.3")


@pytest.mark.parametrize(("template", "stops"), [
    ("glm4.5", ("<|user|>", "<|observation|>")), ("glm-4.6", ("<|user|>", "<|observation|>")),
    ("harmony", ("<|return|>", "<|call|>")), ("gemma-4", ("<turn|>", "<|tool_response>"))])
def test_where_a_reply_ends_ollama_stops(template, stops):
    """GLM-4.5's replies end with the next turn's role token (<|user|>, <|observation|> after a call: what training
    trains as their end), gpt-oss's calls with <|call|>, Gemma 4's calls with <|tool_response>: each is a stop of the
    Modelfile, so Ollama ends a reply where the model was trained to end it."""
    from rocktune.export.ollama import modelfile

    text, _ = modelfile("model.gguf", "chat", _tokenizer(template), None)
    assert all(f'PARAMETER stop "{s}"' in text for s in stops)
