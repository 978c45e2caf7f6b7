"""Ollama TEMPLATEs (Go text/template, over Ollama's .System, .Messages and .Tools) for every family the GGUF export
supports, each written to render a prompt exactly as the family's Hugging Face chat template does.

Jinja cannot be translated in general, so a family is recognised by its markers and, where its templates differ
between releases, by the variant's own text (Llama 3.1's knowledge-date header, Mistral's space after [INST]).
Tool lists and tool calls are written where the family's template has them (Qwen's <tool_call>, Llama 3.1's
JSON calls and ipython turns, Mistral's [AVAILABLE_TOOLS]/[TOOL_CALLS], Granite's available_tools; the 2025-26
families' in ``export/ollama_recent.py``); Ollama prints JSON compactly in Go's key order where Jinja's ``tojson``
writes ``{"a": 1}``, the one difference ``tests/test_ollama_templates.py`` allows. A BOS the Jinja template writes is
left to the tokenizer: llama.cpp adds it from the GGUF's ``add_bos_token``.
"""

from __future__ import annotations

from dataclasses import dataclass

from rocktune import builtin_templates
from rocktune.export import ollama_recent as recent

PREV = '{{ $prev := "" }}'
GEN_UNLESS_ASSISTANT = '{{ if ne $prev "assistant" }}{gen}{{ end }}'

CHATML = (
    '{{ if or .System .Tools }}<|im_start|>system\n'
    '{{ if .System }}{{ .System }}{{ if .Tools }}\n\n{{ end }}{{ end }}'
    '{{ if .Tools }}# Tools\n\nYou may call one or more functions to assist with the user query.\n\n'
    'You are provided with function signatures within <tools></tools> XML tags:\n<tools>'
    '{{ range .Tools }}\n{{ . }}{{ end }}\n</tools>\n\n'
    'For each function call, return a json object with function name and arguments within <tool_call></tool_call> '
    'XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    '{{ end }}<|im_end|>\n{{ end }}'
    + PREV +
    '{{ range $i, $m := .Messages }}{{ $rest := slice $.Messages $i }}'
    '{{ if eq .Role "user" }}<|im_start|>user\n{{ .Content }}<|im_end|>\n'
    '{{ else if eq .Role "assistant" }}<|im_start|>assistant'
    '{{ if or .Content (not .ToolCalls) }}\n{{ .Content }}{{ end }}'
    '{{ range .ToolCalls }}\n<tool_call>\n{"name": "{{ .Function.Name }}", "arguments": {{ .Function.Arguments }}}'
    '\n</tool_call>{{ end }}<|im_end|>\n'
    '{{ else if eq .Role "tool" }}{{ if ne $prev "tool" }}<|im_start|>user{{ end }}'
    '\n<tool_response>\n{{ .Content }}\n</tool_response>'
    '{{ if or (eq (len $rest) 1) (ne (index $rest 1).Role "tool") }}<|im_end|>\n{{ end }}'
    '{{ end }}{{ $prev = .Role }}{{ end }}'
    + GEN_UNLESS_ASSISTANT.replace("{gen}", "<|im_start|>assistant\n")
)

# ChatML whose Jinja template has no tools (SmolLM2's, the demo model's): every turn as it comes, no tool blocks a
# model trained on it never saw
CHATML_PLAIN = (
    '{{ if .System }}<|im_start|>system\n{{ .System }}<|im_end|>\n{{ end }}' + PREV +
    '{{ range .Messages }}{{ if ne .Role "system" }}<|im_start|>{{ .Role }}\n{{ .Content }}<|im_end|>\n{{ end }}'
    '{{ $prev = .Role }}{{ end }}' + GEN_UNLESS_ASSISTANT.replace("{gen}", "<|im_start|>assistant\n")
)
# the variant of a family for a Jinja template that ignores tools= (one whose tool-less turns match it)
WITHOUT_TOOLS = {"chatml": CHATML_PLAIN}

# Llama 3 / 3.2-style header turns, no date header
LLAMA3 = (PREV + '{{ if .System }}<|start_header_id|>system<|end_header_id|>\n\n{{ .System }}<|eot_id|>{{ end }}'
          '{{ range .Messages }}{{ if ne .Role "system" }}<|start_header_id|>{{ .Role }}<|end_header_id|>\n\n'
          '{{ .Content }}<|eot_id|>{{ end }}{{ $prev = .Role }}{{ end }}'
          + GEN_UNLESS_ASSISTANT.replace("{gen}", "<|start_header_id|>assistant<|end_header_id|>\n\n"))

# Llama 3.1: a system header with the knowledge and (template default) date lines; tools go into the first user
# turn as JSON, a call is {"name", "parameters"}, a tool result is an ipython turn holding it as a JSON string
LLAMA31 = (
    '<|start_header_id|>system<|end_header_id|>\n\n{{ if .Tools }}Environment: ipython\n{{ end }}'
    'Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n{{ .System }}<|eot_id|>'
    + PREV + '{{ $first := true }}'
    '{{ range .Messages }}'
    '{{ if eq .Role "user" }}<|start_header_id|>user<|end_header_id|>\n\n'
    '{{ if and $.Tools $first }}Given the following functions, please respond with a JSON for a function call with '
    'its proper arguments that best answers the given prompt.\n\nRespond in the format {"name": function name, '
    '"parameters": dictionary of argument name and its value}.Do not use variables.\n\n'
    '{{ range $.Tools }}{{ . }}\n\n{{ end }}{{ end }}{{ $first = false }}{{ .Content }}<|eot_id|>'
    '{{ else if eq .Role "assistant" }}<|start_header_id|>assistant<|end_header_id|>\n\n'
    '{{ if .ToolCalls }}{{ range .ToolCalls }}{"name": "{{ .Function.Name }}", "parameters": '
    '{{ .Function.Arguments }}}{{ end }}{{ else }}{{ .Content }}{{ end }}<|eot_id|>'
    '{{ else if eq .Role "tool" }}<|start_header_id|>ipython<|end_header_id|>\n\n{{ json .Content }}<|eot_id|>'
    '{{ end }}{{ $prev = .Role }}{{ end }}'
    + GEN_UNLESS_ASSISTANT.replace("{gen}", "<|start_header_id|>assistant<|end_header_id|>\n\n")
)


def _mistral(space: str) -> str:
    """Mistral / Mixtral: [INST] turns (with or without a space after the marker, by release); the system prompt
    and the tool list go with the last user turn, as the v0.3 / Nemo templates put them."""
    return (
        '{{ $last := -1 }}{{ range $i, $m := .Messages }}{{ if eq .Role "user" }}{{ $last = $i }}{{ end }}{{ end }}'
        + PREV +
        '{{ range $i, $m := .Messages }}'
        '{{ if eq .Role "user" }}'
        '{{ if and $.Tools (eq $i $last) }}[AVAILABLE_TOOLS]{{ json $.Tools }}[/AVAILABLE_TOOLS]{{ end }}'
        f'[INST]{space}{{{{ if and $.System (eq (len (slice $.Messages $i)) 1) }}}}{{{{ $.System }}}}\n\n{{{{ end }}}}'
        '{{ .Content }}[/INST]'
        '{{ else if eq .Role "assistant" }}'
        '{{ if .ToolCalls }}[TOOL_CALLS][{{ range $j, $c := .ToolCalls }}{{ if $j }}, {{ end }}{"name": '
        '"{{ .Function.Name }}", "arguments": {{ .Function.Arguments }}, "id": "{{ .ID }}"}{{ end }}]</s>'
        '{{ else }}{{ .Content }}</s>{{ end }}'
        '{{ else if eq .Role "tool" }}[TOOL_RESULTS]{"content": {{ .Content }}, "call_id": "{{ .ToolCallID }}"}'
        '[/TOOL_RESULTS]'
        '{{ end }}{{ $prev = .Role }}{{ end }}'
    )


MISTRAL = _mistral(" ")
MISTRAL_NEMO = _mistral("")

# Gemma 2 / 3: user and model turns; Gemma 3 puts the system prompt at the start of the first user turn
GEMMA = (
    PREV + '{{ $first := true }}{{ range .Messages }}'
    '{{ if eq .Role "user" }}<start_of_turn>user\n{{ if and $first $.System }}{{ $.System }}\n\n{{ end }}'
    '{{ $first = false }}{{ .Content }}<end_of_turn>\n'
    '{{ else if eq .Role "assistant" }}<start_of_turn>model\n{{ .Content }}<end_of_turn>\n{{ end }}'
    '{{ $prev = .Role }}{{ end }}' + GEN_UNLESS_ASSISTANT.replace("{gen}", "<start_of_turn>model\n")
)

PHI3 = (PREV + '{{ if .System }}<|system|>\n{{ .System }}<|end|>\n{{ end }}'
        '{{ range .Messages }}{{ if eq .Role "user" }}<|user|>\n{{ .Content }}<|end|>\n'
        '{{ else if eq .Role "assistant" }}<|assistant|>\n{{ .Content }}<|end|>\n{{ end }}{{ $prev = .Role }}{{ end }}'
        + GEN_UNLESS_ASSISTANT.replace("{gen}", "<|assistant|>\n"))

OLMO2 = (PREV + '{{ if .System }}<|system|>\n{{ .System }}\n{{ end }}'
         '{{ range .Messages }}{{ if eq .Role "user" }}<|user|>\n{{ .Content }}\n'
         '{{ else if eq .Role "assistant" }}<|assistant|>\n{{ .Content }}<|endoftext|>\n{{ end }}'
         '{{ $prev = .Role }}{{ end }}' + GEN_UNLESS_ASSISTANT.replace("{gen}", "<|assistant|>\n"))

GRANITE = (
    '{{ if .System }}<|start_of_role|>system<|end_of_role|>{{ .System }}<|end_of_text|>\n{{ end }}'
    '{{ if .Tools }}<|start_of_role|>available_tools<|end_of_role|>{{ json .Tools }}<|end_of_text|>\n{{ end }}'
    + PREV + '{{ range .Messages }}{{ if ne .Role "system" }}<|start_of_role|>{{ .Role }}<|end_of_role|>'
    '{{ .Content }}<|end_of_text|>\n{{ end }}{{ $prev = .Role }}{{ end }}'
    + GEN_UNLESS_ASSISTANT.replace("{gen}", "<|start_of_role|>assistant<|end_of_role|>")
)

@dataclass(frozen=True)
class Family:
    marker: str  # text only this family's Jinja templates contain
    template: str
    stop: str  # the end-of-turn token, a stop for Ollama
    system: str | None = None  # a regex of the system turn the Jinja template inserts when there is none
    more_stops: tuple[str, ...] = ()  # other tokens a reply ends with (a tool call's end, the next turn's role)


FAMILIES = {
    # the 2025-26 families (export/ollama_recent.py), before ChatML, Granite and OLMo 2, whose markers they share
    "harmony": Family("<|channel|>", recent.HARMONY, "<|return|>", more_stops=("<|call|>",)),
    # a reply ends with the next turn's role token, the model's stops (data/turnend.py)
    "glm4.5": Family("[gMASK]<sop>", recent.GLM45, "<|user|>", more_stops=("<|observation|>",)),
    "llama4": Family("<|header_start|>", recent.LLAMA4, "<|eot|>"),
    # a call ends the model's turn with the opening of its result
    "gemma4": Family("<|turn>", recent.GEMMA4, "<turn|>", more_stops=("<|tool_response>",)),
    "qwen3.5": Family("<function=example_function_name>", recent.QWEN35, "<|im_end|>"),
    # OLMo 3 Instruct's template names <function_calls> in the default system prompt it writes (the TEMPLATE
    # writes it too); Qwen3-Next's template is Qwen3's: ChatML
    "olmo3": Family("<function_calls>", recent.OLMO3, "<|im_end|>"),
    # its default system prompt is written by the TEMPLATE (it gives way to the tool list), not as SYSTEM
    "granite4": Family("Please ensure responses are professional, accurate, and safe.", recent.GRANITE4,
                       "<|end_of_text|>"),
    "chatml": Family("<|im_start|>", CHATML, "<|im_end|>", r"<\|im_start\|>system\n(.*?)<\|im_end\|>"),
    "llama3.1": Family("Cutting Knowledge Date", LLAMA31, "<|eot_id|>"),
    "llama3": Family("<|start_header_id|>", LLAMA3, "<|eot_id|>",
                     r"<\|start_header_id\|>system<\|end_header_id\|>\n\n(.*?)<\|eot_id\|>"),
    "gemma": Family("<start_of_turn>", GEMMA, "<end_of_turn>"),
    "granite": Family("<|start_of_role|>", GRANITE, "<|end_of_text|>",
                      r"<\|start_of_role\|>system<\|end_of_role\|>(.*?)<\|end_of_text\|>"),
    "phi3": Family("<|end|>", PHI3, "<|end|>"),
    "olmo2": Family("<|assistant|>", OLMO2, "<|endoftext|>"),
    "mistral": Family("[INST]", MISTRAL, "</s>"),
}
# rocktune's own tool-calling template (data.chat_template: builtin-tools), recognised by its tag before the family
# whose turn markers it shares; its TEMPLATE is built from the same turn parts as its Jinja text, and it has no
# default system prompt, so the Modelfile gets no SYSTEM from it
FAMILIES = {**{f"{builtin_templates.NAME}:{s.name}": Family(builtin_templates.TAG % s.name, builtin_templates.ollama(s),
                                                            s.stop) for s in builtin_templates.SHAPES}, **FAMILIES}


def family_of(chat_template: str | None) -> str | None:
    """The family whose marker the Jinja template has (the order above decides between overlapping markers:
    Llama 3.1 before Llama 3, Phi-3 before OLMo 2)."""
    for name, fam in FAMILIES.items():
        if chat_template and fam.marker in chat_template:
            return name
    return None


def template_for(family: str, rendered_user: str | None = None, tools: bool = True) -> str:
    """The TEMPLATE of ``family``; ``rendered_user``: the Jinja template's rendering of one user turn "x", which
    tells Mistral's releases apart (a space after [INST] or not); ``tools``: whether the Jinja template renders
    ``tools=`` (SmolLM2's ChatML does not: its TEMPLATE must not carry Qwen's tool blocks)."""
    if family == "mistral" and rendered_user is not None and "[INST]x" in rendered_user:
        return MISTRAL_NEMO
    if not tools and family in WITHOUT_TOOLS:
        return WITHOUT_TOOLS[family]
    return FAMILIES[family].template
