"""Ollama TEMPLATEs of the 2025-26 families (Qwen3.5, gpt-oss's Harmony, GLM-4.5, Granite 4, Gemma 4, Llama 4,
OLMo 3), tools included: each renders system, user and assistant turns, the tool list (``.Tools``), a reply's tool
calls (``.ToolCalls``), tool results and, where the template keeps it, a reply's reasoning (``.Thinking``) as the
family's released Hugging Face template does (``tests/test_ollama_templates.py`` compares the two on conversations
with and without tools).

What Ollama's template data cannot carry is left as the template's default and said in docs/export.md: Go's text
templates have no string trimming (the Jinja templates strip replies; these write them as given), Ollama hands a
template a call's arguments and a tool's parameters as maps, which Go ranges over in key order (the Jinja templates
keep the order they were given), and a parameter's ``default`` or ``nullable`` never reaches a template.
"""

from __future__ import annotations

PREV = '{{ $prev := "" }}'


def _upper(expr: str) -> str:
    """A JSON-schema type name in capitals, as Gemma 4's ``| upper`` writes it (Ollama's templates have no upper)."""
    names = ("string", "number", "integer", "boolean", "array", "object", "null")
    return "".join(f'{{{{ {"if" if k == 0 else "else if"} eq (printf "%s" {expr}) "{n}" }}}}{n.upper()}'
                   for k, n in enumerate(names)) + "{{ end }}"


# the index of the last user turn ($lastUser): the Jinja templates keep a reply's reasoning only after it
LAST_USER = ('{{ $lastUser := -1 }}{{ range $i, $m := .Messages }}{{ if eq .Role "user" }}{{ $lastUser = $i }}'
             '{{ end }}{{ end }}')
# a call's argument value: strings as they are, everything else as JSON (GLM-4.5's and Qwen3.5's XML calls)
ARG = '{{ if eq (printf "%T" $v) "string" }}{{ $v }}{{ else }}{{ json $v }}{{ end }}'

# GLM-4.5 (its released template, as 4.6 ships it): [gMASK]<sop> (the template writes it; the GGUF adds no BOS),
# the tool list as JSON lines in a system turn of its own, role tokens opening turns and none closing them, a reply's
# think block (empty before the last user turn), calls as <tool_call>NAME with <arg_key>/<arg_value> pairs, a run of
# results under one <|observation|>
GLM45 = (
    '[gMASK]<sop>{{ if .Tools }}<|system|>\n# Tools\n\nYou may call one or more functions to assist with the user '
    'query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>\n'
    '{{ range .Tools }}{{ . }}\n{{ end }}</tools>\n\nFor each function call, output the function name and arguments '
    'within the following XML format:\n<tool_call>{function-name}\n<arg_key>{arg-key-1}</arg_key>\n'
    '<arg_value>{arg-value-1}</arg_value>\n<arg_key>{arg-key-2}</arg_key>\n<arg_value>{arg-value-2}</arg_value>\n'
    '...\n</tool_call>{{ end }}' + LAST_USER + PREV +
    '{{ range $i, $m := .Messages }}'
    '{{ if eq .Role "system" }}<|system|>\n{{ .Content }}'
    '{{ else if eq .Role "user" }}<|user|>\n{{ .Content }}'
    '{{ else if eq .Role "assistant" }}<|assistant|>'
    '{{ if and (gt $i $lastUser) .Thinking }}\n<think>{{ .Thinking }}</think>{{ else }}\n<think></think>{{ end }}'
    '{{ if .Content }}\n{{ .Content }}{{ end }}'
    '{{ range .ToolCalls }}\n<tool_call>{{ .Function.Name }}{{ range $k, $v := .Function.Arguments }}'
    '\n<arg_key>{{ $k }}</arg_key>\n<arg_value>' + ARG + '</arg_value>{{ end }}\n</tool_call>{{ end }}'
    '{{ else if eq .Role "tool" }}{{ if ne $prev "tool" }}<|observation|>{{ end }}'
    '\n<tool_response>\n{{ .Content }}\n</tool_response>'
    '{{ end }}{{ $prev = .Role }}{{ end }}'
    '{{ if ne $prev "assistant" }}<|assistant|>{{ end }}'
)

# Qwen3.5 (its released template): the tool list and the call format in the system turn, the system prompt after
# them; a reply after the last user turn in a think block (the generation prompt opens it, closed at once when
# thinking is off), earlier ones without; calls as <tool_call><function=NAME><parameter=KEY> XML; results as
# <tool_response> blocks of one user turn
QWEN35_TOOLS = (
    "# Tools\n\nYou have access to the following functions:\n\n<tools>{{ range .Tools }}\n{{ . }}{{ end }}\n</tools>"
    "\n\nIf you choose to call a function ONLY reply in the following format with NO suffix:\n\n<tool_call>\n"
    "<function=example_function_name>\n<parameter=example_parameter_1>\nvalue_1\n</parameter>\n"
    "<parameter=example_parameter_2>\nThis is the value for the second parameter\nthat can span\nmultiple lines\n"
    "</parameter>\n</function>\n</tool_call>\n\n<IMPORTANT>\nReminder:\n- Function calls MUST follow the specified "
    "format: an inner <function=...></function> block must be nested within <tool_call></tool_call> XML tags\n"
    "- Required parameters MUST be specified\n- You may provide optional reasoning for your function call in natural "
    "language BEFORE the function call, but NOT after\n- If there is no function call available, answer the question "
    "like normal with your current knowledge and do not tell the user about function calls\n</IMPORTANT>"
)
QWEN35 = (
    '{{ if .Tools }}<|im_start|>system\n' + QWEN35_TOOLS + '{{ if .System }}\n\n{{ .System }}{{ end }}<|im_end|>\n'
    '{{ else if .System }}<|im_start|>system\n{{ .System }}<|im_end|>\n{{ end }}' + LAST_USER + PREV +
    '{{ range $i, $m := .Messages }}{{ $rest := slice $.Messages $i }}'
    '{{ if eq .Role "user" }}<|im_start|>user\n{{ .Content }}<|im_end|>\n'
    '{{ else if eq .Role "assistant" }}<|im_start|>assistant\n'
    '{{ if gt $i $lastUser }}<think>\n{{ .Thinking }}\n</think>\n\n{{ end }}{{ .Content }}'
    '{{ range $j, $c := .ToolCalls }}{{ if $j }}\n{{ else if $m.Content }}\n\n{{ end }}'
    '<tool_call>\n<function={{ .Function.Name }}>\n{{ range $k, $v := .Function.Arguments }}<parameter={{ $k }}>\n'
    '{{ $t := printf "%T" $v }}{{ if or (eq $t "map[string]interface {}") (eq $t "[]interface {}") }}{{ json $v }}'
    '{{ else }}{{ $v }}{{ end }}\n</parameter>\n{{ end }}</function>\n</tool_call>{{ end }}<|im_end|>\n'
    '{{ else if eq .Role "tool" }}{{ if and $prev (ne $prev "tool") }}<|im_start|>user{{ end }}'
    '\n<tool_response>\n{{ .Content }}\n</tool_response>'
    '{{ if or (eq (len $rest) 1) (ne (index $rest 1).Role "tool") }}<|im_end|>\n{{ end }}'
    '{{ end }}{{ $prev = .Role }}{{ end }}'
    '{{ if ne $prev "assistant" }}<|im_start|>assistant\n'
    '{{ if and $.IsThinkSet (not $.Think) }}<think>\n\n</think>\n\n{{ else }}<think>\n{{ end }}{{ end }}'
)

# gpt-oss's Harmony (its released template): the system header with today's date and the reasoning effort (Ollama's
# think level, else medium); the system prompt and the tools, TypeScript-like, in a developer message; past answers
# on the final channel (their analysis dropped); a call on the commentary channel to=functions.NAME, its analysis
# kept until a final answer follows, and its result from functions.NAME as a JSON string
def _ts_type(p: str) -> str:
    """A parameter's TypeScript type as Harmony's template writes it: unions, enums, primitive arrays."""
    t = f'(printf "%s" {p}.Type)'
    return (
        f'{{{{ if gt (len {p}.Type) 1 }}}}{{{{ range $n, $u := {p}.Type }}}}{{{{ if $n }}}} | {{{{ end }}}}{{{{ $u }}}}'
        f'{{{{ end }}}}'
        f'{{{{ else if eq {t} "array" }}}}{{{{ $it := "" }}}}{{{{ with {p}.Items }}}}'
        '{{ $it = printf "%v" (index . "type") }}'
        '{{ end }}{{ if eq $it "string" }}string[]{{ else if or (eq $it "number") (eq $it "integer") }}number[]'
        '{{ else if eq $it "boolean" }}boolean[]{{ else }}any[]{{ end }}'
        f'{{{{ else if and (eq {t} "string") {p}.Enum }}}}{{{{ range $n, $e := {p}.Enum }}}}{{{{ if $n }}}} | '
        '{{ end }}"{{ $e }}"{{ end }}'
        f'{{{{ else if eq {t} "string" }}}}string{{{{ else if or (eq {t} "number") (eq {t} "integer") }}}}number'
        f'{{{{ else if eq {t} "boolean" }}}}boolean{{{{ else if eq {t} "object" }}}}object'
        '{{ else }}any{{ end }}'
    )


HARMONY_TOOLS = (
    '# Tools\n\n## functions\n\nnamespace functions {\n\n{{ range .Tools }}// {{ .Function.Description }}\n'
    'type {{ .Function.Name }} = {{ if .Function.Parameters.Properties }}(_: {\n'
    '{{ $required := .Function.Parameters.Required }}{{ range $name, $p := .Function.Parameters.Properties }}'
    '{{ if $p.Description }}// {{ $p.Description }}\n{{ end }}{{ $name }}'
    '{{ $needed := false }}{{ range $required }}{{ if eq . $name }}{{ $needed = true }}{{ end }}{{ end }}'
    '{{ if not $needed }}?{{ end }}: ' + _ts_type("$p") + ',\n{{ end }}}) => any;\n\n'
    '{{ else }}() => any;\n\n{{ end }}{{ end }}} // namespace functions'
)
HARMONY = (
    '<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\nKnowledge cutoff: 2024-06\n'
    'Current date: {{ currentDate }}\n\nReasoning: {{ if $.ThinkLevel }}{{ $.ThinkLevel }}{{ else }}medium{{ end }}'
    '\n\n# Valid channels: analysis, commentary, final. Channel must be included for every message.'
    "{{ if .Tools }}\nCalls to these tools must go to the commentary channel: 'functions'.{{ end }}<|end|>"
    '{{ if or .System .Tools }}<|start|>developer<|message|>'
    '{{ if .System }}# Instructions\n\n{{ .System }}\n\n{{ end }}'
    '{{ if .Tools }}' + HARMONY_TOOLS + '{{ end }}<|end|>{{ end }}' + PREV + '{{ $call := "" }}'
    '{{ range $i, $m := .Messages }}'
    '{{ if eq .Role "user" }}<|start|>user<|message|>{{ .Content }}<|end|>'
    '{{ else if and (eq .Role "assistant") .ToolCalls }}'
    '{{ $final := false }}{{ range $j, $n := $.Messages }}{{ if and (gt $j $i) (eq $n.Role "assistant") '
    '(not $n.ToolCalls) }}{{ $final = true }}{{ end }}{{ end }}'
    '{{ if not $final }}{{ if .Content }}<|start|>assistant<|channel|>analysis<|message|>{{ .Content }}<|end|>'
    '{{ else if .Thinking }}<|start|>assistant<|channel|>analysis<|message|>{{ .Thinking }}<|end|>{{ end }}{{ end }}'
    '{{ with index .ToolCalls 0 }}{{ $call = .Function.Name }}<|start|>assistant to=functions.{{ .Function.Name }}'
    '<|channel|>commentary json<|message|>{{ .Function.Arguments }}<|call|>{{ end }}'
    '{{ else if eq .Role "assistant" }}<|start|>assistant<|channel|>final<|message|>{{ .Content }}<|end|>'
    '{{ $call = "" }}'
    '{{ else if eq .Role "tool" }}<|start|>functions.{{ $call }} to=assistant<|channel|>commentary<|message|>'
    '{{ json .Content }}<|end|>'
    '{{ end }}{{ $prev = .Role }}{{ end }}'
    '{{ if ne $prev "assistant" }}<|start|>assistant{{ end }}'
)

# Granite 4 (its released 4.0 template): one system turn with the system prompt, the tool list and the call format,
# or the template's default prompt when there is neither (written here, so the Modelfile has no SYSTEM that would
# come back with tools); calls as <tool_call> JSON after the reply's text, results as <tool_response> blocks of one
# user turn
GRANITE4_TOOLS = (
    'You are a helpful assistant with access to the following tools. You may call one or more tools to assist with '
    'the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>'
    '{{ range .Tools }}\n{{ . }}{{ end }}\n</tools>\n\nFor each tool call, return a json object with function name and '
    'arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": '
    '<args-json-object>}\n</tool_call>. If a tool does not exist in the provided list of tools, notify the user that '
    'you do not have the ability to fulfill the request.'
)
GRANITE4_DEFAULT = "You are a helpful assistant. Please ensure responses are professional, accurate, and safe."
GRANITE4 = (
    '{{ $system := "" }}{{ range $i, $m := .Messages }}{{ if and (eq $i 0) (eq .Role "system") }}'
    '{{ $system = .Content }}{{ end }}{{ end }}<|start_of_role|>system<|end_of_role|>'
    '{{ if .Tools }}{{ if $system }}{{ $system }}\n\n{{ end }}' + GRANITE4_TOOLS +
    '{{ else if $system }}{{ $system }}{{ else }}' + GRANITE4_DEFAULT + '{{ end }}<|end_of_text|>\n' + PREV +
    '{{ range $i, $m := .Messages }}{{ $rest := slice $.Messages $i }}'
    '{{ if or (eq .Role "user") (and (eq .Role "system") $i) }}<|start_of_role|>{{ .Role }}<|end_of_role|>'
    '{{ .Content }}<|end_of_text|>\n'
    '{{ else if eq .Role "assistant" }}<|start_of_role|>assistant<|end_of_role|>{{ .Content }}'
    '{{ range $j, $c := .ToolCalls }}{{ if or $j $m.Content }}\n{{ end }}<tool_call>\n{"name": "{{ .Function.Name }}", '
    '"arguments": {{ .Function.Arguments }}}\n</tool_call>{{ end }}<|end_of_text|>\n'
    '{{ else if eq .Role "tool" }}{{ if ne $prev "tool" }}<|start_of_role|>user<|end_of_role|>{{ end }}'
    '\n<tool_response>\n{{ .Content }}\n</tool_response>'
    '{{ if or (eq (len $rest) 1) (ne (index $rest 1).Role "tool") }}<|end_of_text|>\n{{ end }}'
    '{{ end }}{{ $prev = .Role }}{{ end }}'
    '{{ if ne $prev "assistant" }}<|start_of_role|>assistant<|end_of_role|>{{ end }}'
)


# Gemma 4 (its released template): a system turn with the system prompt and each tool's declaration in Gemma's own
# notation (keys in order, strings in <|"|> quotes, types in capitals; parameters of scalar, enum and scalar-array
# types); a call as <|tool_call>call:NAME{key:value}<tool_call|> followed, inside the same model turn, by its results
# (<|tool_response>response:NAME{value:...}<tool_response|>, the name found by the call's id) and the answer; a
# call without results ends the turn with <|tool_response>; the generation prompt opens an empty thought channel
# unless thinking is on
def _gemma_value(v: str) -> str:
    """A value in Gemma's notation: strings quoted with <|"|>, objects and lists one level deep."""
    scalar = '{{ if eq (printf "%T" VAL) "string" }}<|"|>{{ VAL }}<|"|>{{ else }}{{ VAL }}{{ end }}'
    return (f'{{{{ $t := printf "%T" {v} }}}}{{{{ if eq $t "map[string]interface {{}}" }}}}{{{{ "{{" }}}}'
            f'{{{{ $cc := false }}}}{{{{ range $nn, $k := {v} }}}}{{{{ if $cc }}}},{{{{ end }}}}{{{{ $cc = true }}}}'
            '{{ $nn }}:' + scalar.replace("VAL", "$k") + '{{ end }}{{ "}" }}'
            f'{{{{ else if eq $t "[]interface {{}}" }}}}[{{{{ range $nn, $k := {v} }}}}{{{{ if $nn }}}},{{{{ end }}}}'
            + scalar.replace("VAL", "$k") + '{{ end }}]{{ else }}' + scalar.replace("VAL", v) + '{{ end }}')


GEMMA4_PARAMS = (
    '{{ $first := true }}{{ range $name, $p := .Function.Parameters.Properties }}'
    '{{ if not (or (eq $name "description") (eq $name "type") (eq $name "properties") (eq $name "required") '
    '(eq $name "nullable")) }}{{ if not $first }},{{ end }}{{ $first = false }}{{ $name }}:{{ "{" }}'
    '{{ $comma := false }}{{ if $p.Description }}description:<|"|>{{ $p.Description }}<|"|>{{ $comma = true }}{{ end }}'
    '{{ if and (eq (printf "%s" $p.Type) "string") $p.Enum }}{{ if $comma }},{{ end }}{{ $comma = true }}enum:['
    '{{ range $n, $e := $p.Enum }}{{ if $n }},{{ end }}<|"|>{{ $e }}<|"|>{{ end }}]{{ end }}'
    '{{ if and (eq (printf "%s" $p.Type) "array") $p.Items }}{{ if $comma }},{{ end }}{{ $comma = true }}'
    'items:{{ "{" }}'
    '{{ with $p.Items }}{{ with index . "type" }}type:<|"|>' + _upper(".") + '<|"|>{{ end }}{{ end }}{{ "}" }}{{ end }}'
    '{{ if $comma }},{{ end }}type:<|"|>' + _upper("$p.Type") + '<|"|>{{ "}" }}{{ end }}{{ end }}'
)
GEMMA4_TOOL = (
    '<|tool>declaration:{{ .Function.Name }}{{ "{" }}description:<|"|>{{ .Function.Description }}<|"|>'
    '{{ with .Function.Parameters }}{{ if or .Properties .Required .Type }},parameters:{{ "{" }}'
    '{{ if .Properties }}properties:{{ "{" }}{{ end }}{{ end }}{{ end }}'
    '{{ if .Function.Parameters.Properties }}' + GEMMA4_PARAMS + '{{ "}" }},{{ end }}'
    '{{ with .Function.Parameters }}{{ if .Required }}required:[{{ range $n, $r := .Required }}{{ if $n }},{{ end }}'
    '<|"|>{{ $r }}<|"|>{{ end }}],{{ end }}{{ if .Type }}type:<|"|>' + _upper(".Type") + '<|"|>{{ "}" }}{{ end }}'
    '{{ end }}{{ "}" }}<tool|>'
)
GEMMA4 = (
    '{{ $system := "" }}{{ $skip := -1 }}{{ range $i, $m := .Messages }}{{ if and (eq $i 0) (eq .Role "system") }}'
    '{{ $system = .Content }}{{ $skip = 0 }}{{ end }}{{ end }}'
    '{{ if or $.Think .Tools (eq $skip 0) }}<|turn>system\n{{ if $.Think }}<|think|>\n{{ end }}{{ $system }}'
    '{{ range .Tools }}' + GEMMA4_TOOL + '{{ end }}<turn|>\n{{ end }}' + LAST_USER + PREV +
    '{{ $kind := "" }}{{ $lastRole := "" }}'
    '{{ range $i, $m := .Messages }}{{ if and (ne .Role "tool") (ne $i $skip) }}{{ $kind = "" }}'
    '{{ if not (and (eq .Role "assistant") (eq $lastRole "assistant")) }}'
    '<|turn>{{ if eq .Role "assistant" }}model{{ else }}{{ .Role }}{{ end }}\n{{ end }}'
    '{{ if and .Thinking (gt $i $lastUser) .ToolCalls }}<|channel>thought\n{{ .Thinking }}\n<channel|>{{ end }}'
    '{{ range .ToolCalls }}<|tool_call>call:{{ .Function.Name }}{{ "{" }}'
    '{{ $c := false }}{{ range $n, $v := .Function.Arguments }}{{ if $c }},{{ end }}{{ $c = true }}{{ $n }}:'
    + _gemma_value("$v") + '{{ end }}{{ "}" }}<tool_call|>{{ $kind = "tool_call" }}{{ end }}'
    '{{ $answered := false }}{{ if .ToolCalls }}{{ $stop := false }}{{ range $j, $f := $.Messages }}'
    '{{ if and (gt $j $i) (not $stop) }}{{ if ne $f.Role "tool" }}{{ $stop = true }}{{ else }}'
    '{{ $name := "unknown" }}{{ if $f.ToolName }}{{ $name = $f.ToolName }}{{ end }}'
    '{{ range $m.ToolCalls }}{{ if eq .ID $f.ToolCallID }}{{ $name = .Function.Name }}{{ end }}{{ end }}'
    '<|tool_response>response:{{ $name }}{{ "{" }}value:<|"|>{{ $f.Content }}<|"|>{{ "}" }}<tool_response|>'
    '{{ $answered = true }}{{ $kind = "tool_response" }}{{ end }}{{ end }}{{ end }}{{ end }}'
    '{{ .Content }}'
    '{{ if and (eq $kind "tool_call") (not $answered) }}<|tool_response>'
    '{{ else if not (and $answered (not .Content)) }}<turn|>\n{{ end }}'
    '{{ $lastRole = .Role }}{{ end }}{{ $prev = .Role }}{{ end }}'
    '{{ if and (ne $prev "assistant") (ne $kind "tool_call") (ne $kind "tool_response") }}<|turn>model\n'
    '{{ if not $.Think }}<|channel>thought\n<channel|>{{ end }}{{ end }}'
)

# Llama 4 (rocktune's shape of its turns, tests/family_templates.py: no copy of the released template is at hand to
# check against): header tokens, <|eot|> after each turn, the tool list in a system turn of its own, calls as
# {"name", "parameters"} JSON, results as ipython turns
LLAMA4 = (
    '{{ if .Tools }}<|header_start|>system<|header_end|>\n\nYou have access to these functions; call one as JSON '
    '{"name": ..., "parameters": ...}.{{ range .Tools }}\n{{ . }}{{ end }}<|eot|>{{ end }}' + PREV +
    '{{ range .Messages }}<|header_start|>{{ if eq .Role "tool" }}ipython{{ else }}{{ .Role }}{{ end }}<|header_end|>'
    '\n\n{{ if .ToolCalls }}{{ range .ToolCalls }}{"name": "{{ .Function.Name }}", "parameters": '
    '{{ .Function.Arguments }}}{{ end }}{{ else }}{{ .Content }}{{ end }}<|eot|>{{ $prev = .Role }}{{ end }}'
    '{{ if ne $prev "assistant" }}<|header_start|>assistant<|header_end|>\n\n{{ end }}'
)

# OLMo 3 Instruct (as Ollama's own OLMo 3 renderer writes it; its released template is not at hand): ChatML turns, a
# default system prompt naming the tools or their absence (written here, so the Modelfile has no SYSTEM), the tool
# list as JSON in <functions>, calls as NAME(key=JSON, ...) lines in <function_calls>, results as environment turns
OLMO3_TOOLS = (
    "You are provided with function signatures within <functions></functions> XML tags. You may call one or more "
    "functions to assist with the user query. Output any function calls within <function_calls></function_calls> XML "
    "tags. Do not make assumptions about what values to plug into functions."
)
OLMO3 = (
    '{{ $system := "" }}{{ $given := false }}{{ range $i, $m := .Messages }}{{ if and (eq $i 0) (eq .Role "system") }}'
    '{{ $system = .Content }}{{ $given = true }}{{ end }}{{ end }}<|im_start|>system\n'
    '{{ if $given }}{{ $system }}{{ if .Tools }}<functions>{{ .Tools }}</functions>{{ end }}'
    '{{ else }}You are a helpful function-calling AI assistant. {{ if .Tools }}' + OLMO3_TOOLS +
    '<functions>{{ .Tools }}</functions>{{ else }}You do not currently have access to any functions. '
    '<functions></functions>{{ end }}{{ end }}<|im_end|>\n' + PREV +
    '{{ range .Messages }}{{ if eq .Role "user" }}<|im_start|>user\n{{ .Content }}<|im_end|>\n'
    '{{ else if eq .Role "assistant" }}<|im_start|>assistant\n{{ .Content }}'
    '{{ if .ToolCalls }}<function_calls>{{ range $j, $tc := .ToolCalls }}{{ if $j }}\n{{ end }}{{ .Function.Name }}('
    '{{ $c := false }}{{ range $k, $v := .Function.Arguments }}{{ if $c }}, {{ end }}{{ $c = true }}{{ $k }}='
    '{{ json $v }}{{ end }}){{ end }}</function_calls>{{ end }}<|im_end|>\n'
    '{{ else if eq .Role "tool" }}<|im_start|>environment\n{{ .Content }}<|im_end|>\n'
    '{{ end }}{{ $prev = .Role }}{{ end }}{{ if ne $prev "assistant" }}<|im_start|>assistant\n{{ end }}'
)
