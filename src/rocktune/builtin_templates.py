"""rocktune's own tool-calling chat template, in the turn format of the model it is used with.

Many chat models' templates ignore ``tools=`` (SmolLM2's ChatML, Llama 3.0's headers, Gemma's turns), so a
tool-calling set cannot be trained through them. ``data.chat_template: builtin-tools`` renders it through this
template instead: the model's own turn markers (found by the marker its template writes), a tool list in the
system turn (Gemma, which has none: at the start of the first user turn), each call as
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` after the reply's text, and each tool result in a turn
of its own. It adds no words the user did not write but the tool list's two framing sentences: no system prompt,
no identity ("You are ..."), so a model trained through it never learns to be someone else.

The Jinja text (training, preview, generate) and the Ollama TEMPLATE (export) are both built here from one
``Shape``, so the two render a conversation alike (tests/test_tool_template.py renders both). Standard library
only: read by the template reader (readers/template.py) and the Ollama export.
"""

from __future__ import annotations

from dataclasses import dataclass

NAME = "builtin-tools"  # the data.chat_template value that selects it
TAG = "{#- rocktune builtin-tools: %s -#}"  # first line of each Jinja text: how export recognises it
INTRO = "Functions you can call, each given as a JSON schema:\n"
HOWTO = ("To call a function, write <tool_call>{\"name\": <function name>, \"arguments\": <arguments as a JSON "
         "object>}</tool_call>, one block per call. A function's result comes back in a tool turn.")


@dataclass(frozen=True)
class Shape:
    name: str
    marker: str  # text only this turn format's templates contain
    open: str  # a turn's start; {role} is the role's name
    close: str  # a turn's end
    stop: str  # the end-of-turn token (Ollama's stop)
    bos: bool = False  # the model's template writes bos_token first
    system: bool = True  # the format has a system turn (Gemma's has not: the head goes into the first user turn)
    assistant: str = "assistant"  # the assistant role's name in the turn header
    tool: str = "tool"  # the role a tool result's turn is written under


SHAPES = (
    Shape("chatml", "<|im_start|>", "<|im_start|>{role}\n", "<|im_end|>\n", "<|im_end|>"),
    Shape("llama3", "<|start_header_id|>", "<|start_header_id|>{role}<|end_header_id|>\n\n", "<|eot_id|>",
          "<|eot_id|>", bos=True),
    Shape("gemma", "<start_of_turn>", "<start_of_turn>{role}\n", "<end_of_turn>\n", "<end_of_turn>", bos=True,
          system=False, assistant="model", tool="user"),
)


def shape_of(own_template: str | None) -> Shape | None:
    """The turn format of a model's own chat template, by its marker; None when it is none of ``SHAPES``."""
    return next((s for s in SHAPES if own_template and s.marker in own_template), None)


def _q(text: str) -> str:
    """``text`` as a Jinja string literal."""
    return "'" + text.replace("\\", "\\\\").replace("\n", "\\n").replace("'", "\\'") + "'"


def jinja(shape: Shape) -> str:
    """The template's Jinja text for ``shape``."""
    def turn(role: str, body: str) -> str:
        return f"{_q(shape.open.format(role=role))} ~ {body} ~ {_q(shape.close)}"

    head = (
        "{%- set ns = namespace(reply='', head='', first=true) -%}"
        "{%- if messages and messages[0]['role'] == 'system' -%}{%- set ns.head = messages[0]['content'] -%}"
        "{%- endif -%}"
        "{%- if tools -%}{%- if ns.head -%}{%- set ns.head = ns.head ~ '\\n\\n' -%}{%- endif -%}"
        f"{{%- set ns.head = ns.head ~ {_q(INTRO)} ~ '<tools>' -%}}"
        "{%- for t in tools -%}{%- set ns.head = ns.head ~ '\\n' ~ (t | tojson) -%}{%- endfor -%}"
        f"{{%- set ns.head = ns.head ~ '\\n</tools>\\n\\n' ~ {_q(HOWTO)} -%}}{{%- endif -%}}"
        + ("{{- bos_token -}}" if shape.bos else "")
        + (f"{{%- if ns.head -%}}{{{{- {turn('system', 'ns.head')} -}}}}{{%- endif -%}}" if shape.system else "")
    )
    user = "m['content']" if shape.system else \
        "((ns.head ~ '\\n\\n') if (ns.first and ns.head) else '') ~ m['content']"
    result = "m['content']" if shape.tool == "tool" else "'<tool_response>\\n' ~ m['content'] ~ '\\n</tool_response>'"
    call = ("'<tool_call>\\n{\"name\": ' ~ (c['function']['name'] | tojson) ~ ', \"arguments\": ' ~ "
            "(c['function']['arguments'] if c['function']['arguments'] is string else "
            "(c['function']['arguments'] | tojson)) ~ '}\\n</tool_call>'")
    body = (
        "{%- for m in messages -%}"
        "{%- if loop.first and m['role'] == 'system' -%}"
        "{%- elif m['role'] == 'user' -%}"
        f"{{{{- {turn('user', user)} -}}}}{{%- set ns.first = false -%}}"
        "{%- elif m['role'] == 'assistant' -%}"
        "{%- set ns.reply = m['content'] or '' -%}"
        "{%- for c in m['tool_calls'] or [] -%}"
        f"{{%- set ns.reply = ns.reply ~ ('\\n' if ns.reply else '') ~ {call} -%}}"
        "{%- endfor -%}"
        f"{{{{- {turn(shape.assistant, 'ns.reply')} -}}}}"
        "{%- elif m['role'] == 'tool' -%}"
        f"{{{{- {turn(shape.tool, result)} -}}}}"
        "{%- else -%}"
        f"{{{{- {turn('system' if shape.system else 'user', user)} -}}}}"
        "{%- endif -%}"
        "{%- endfor -%}"
        f"{{%- if add_generation_prompt -%}}{{{{- {_q(shape.open.format(role=shape.assistant))} -}}}}{{%- endif -%}}"
    )
    return TAG % shape.name + head + body


def ollama(shape: Shape) -> str:
    """The same template in Ollama's Go-template language (over .System, .Tools and .Messages); the BOS is left to
    llama.cpp's tokenizer, as for every family."""
    o = {r: shape.open.format(role=r) for r in ("system", "user", shape.assistant, shape.tool)}
    head = ('{{ if .System }}{{ .System }}{{ if .Tools }}\n\n{{ end }}{{ end }}'
            '{{ if .Tools }}' + INTRO + '<tools>{{ range .Tools }}\n{{ . }}{{ end }}\n</tools>\n\n' + HOWTO
            + '{{ end }}')
    system = '{{ if or .System .Tools }}' + o["system"] + head + shape.close + '{{ end }}' if shape.system else \
        '{{ $first := true }}'
    user = '{{ .Content }}' if shape.system else \
        '{{ if and $first (or $.System $.Tools) }}' + head.replace('.System', '$.System').replace(
            '.Tools', '$.Tools') + '\n\n{{ end }}{{ $first = false }}{{ .Content }}'
    result = '{{ .Content }}' if shape.tool == "tool" else '<tool_response>\n{{ .Content }}\n</tool_response>'
    return (
        system + '{{ $prev := "" }}{{ range $i, $m := .Messages }}'
        '{{ if eq .Role "user" }}' + o["user"] + user + shape.close +
        '{{ else if eq .Role "assistant" }}' + o[shape.assistant] + '{{ .Content }}'
        '{{ range $j, $c := .ToolCalls }}{{ if or $j $m.Content }}\n{{ end }}<tool_call>\n{"name": '
        '"{{ $c.Function.Name }}", "arguments": {{ $c.Function.Arguments }}}\n</tool_call>{{ end }}' + shape.close +
        '{{ else if eq .Role "tool" }}' + o[shape.tool] + result + shape.close +
        '{{ end }}{{ $prev = .Role }}{{ end }}'
        '{{ if ne $prev "assistant" }}' + o[shape.assistant] + '{{ end }}'
    )
