"""Chat templates of the 2025-26 families (Qwen3.5's thinking blocks, gpt-oss's Harmony channels, GLM-4.5, Llama 4,
Gemma 4), so masking is tested on what those templates really do without a download: Qwen3.5's and gpt-oss's are
the released ones (tests/data/templates), the others shapes written here with the structure of each family's turns,
tool calls and reasoning (GLM-4.5's renders as its released template on every conversation of
tests/test_family_chat.py)."""

from pathlib import Path

RELEASED = Path(__file__).parent / "data" / "templates"  # released templates, as llama.cpp keeps them (README.md)
# Qwen3.5 and gpt-oss: the released templates themselves (their thinking and channel rules are the point). Qwen3.5:
# a reply's reasoning kept in a think block for the turns after the last user query, none before it; the generation
# prompt opens the think block; tool calls as <tool_call><function=NAME><parameter=KEY> XML, results as user turns.
# gpt-oss's Harmony: a system header with the date, the system prompt and tools (TypeScript-like) as a developer
# message, replies on channels: reasoning on "analysis", the answer on "final" (<|return|> when it ends the
# conversation, <|end|> in history), tool calls on "commentary" to=functions.NAME ending <|call|>.
QWEN35 = (RELEASED / "Qwen-Qwen3.5-4B.jinja").read_text(encoding="utf-8")
HARMONY = (RELEASED / "openai-gpt-oss-120b.jinja").read_text(encoding="utf-8")

# Llama 4: header tokens around the role, <|eot|> after every turn; the tool list in a system turn of its own, tool
# calls as JSON, results as ipython turns.
LLAMA4 = (
    "{{ bos_token }}{% if tools %}<|header_start|>system<|header_end|>\n\nYou have access to these functions; call "
    "one as JSON {\"name\": ..., \"parameters\": ...}.{% for t in tools %}{{ '\\n' }}{{ t | tojson }}{% endfor %}"
    "<|eot|>{% endif %}{% for m in messages %}"
    "<|header_start|>{{ 'ipython' if m['role'] == 'tool' else m['role'] }}<|header_end|>\n\n"
    "{% if m.get('tool_calls') %}{% for c in m['tool_calls'] %}"
    "{\"name\": \"{{ c['function']['name'] }}\", \"parameters\": {{ c['function']['arguments'] | tojson }}}"
    "{% endfor %}{% else %}{{ m['content'] | trim }}{% endif %}<|eot|>"
    "{% endfor %}{% if add_generation_prompt %}<|header_start|>assistant<|header_end|>\n\n{% endif %}"
)

# Gemma 4: <|turn>ROLE ... <turn|> (the assistant is "model"); a system turn of its own; tool declarations, calls
# and results in their own token pairs.
GEMMA4 = (
    "{{ bos_token }}{% if tools %}<|turn>system\n{% for t in tools %}<|tool>{{ t | tojson }}<tool|>{% endfor %}"
    "<turn|>\n{% endif %}{% for m in messages %}"
    "<|turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
    "{% if m['role'] == 'tool' %}<|tool_response>{{ m['content'] }}<tool_response|>"
    "{% else %}{{ (m['content'] or '') | trim }}{% endif %}"
    "{% for c in m.get('tool_calls') or [] %}<|tool_call>call:{{ c['function']['name'] }}"
    "{{ c['function']['arguments'] | tojson }}<tool_call|>{% endfor %}<turn|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|turn>model\n{% endif %}"
)

# GLM-4.5 (and 4.6, the same template): [gMASK]<sop>, role tokens opening each turn and nothing closing it (the model
# ends a reply by writing the next role token, <|user|> or <|observation|>, both stops in its generation config);
# the tool list as JSON lines in a system turn of its own with the XML call format spelled out; a reply's think
# block kept only after the last user turn (empty otherwise), its text stripped; calls as <tool_call>NAME then
# <arg_key>/<arg_value> pairs (string values as they are, others as JSON); consecutive results under one
# <|observation|>. The output of the real template on every conversation of tests/test_family_chat.py.
GLM45 = (
    "[gMASK]<sop>{% if tools %}<|system|>\n# Tools\n\nYou may call one or more functions to assist with the user "
    "query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    "{% for t in tools %}{{ t | tojson }}\n{% endfor %}</tools>\n\nFor each function call, output the function name "
    "and arguments within the following XML format:\n<tool_call>{function-name}\n<arg_key>{arg-key-1}</arg_key>\n"
    "<arg_value>{arg-value-1}</arg_value>\n<arg_key>{arg-key-2}</arg_key>\n<arg_value>{arg-value-2}</arg_value>\n"
    "...\n</tool_call>{% endif %}"
    "{% set ns = namespace(last_user=-1) %}"
    "{% for m in messages %}{% if m['role'] == 'user' %}{% set ns.last_user = loop.index0 %}{% endif %}"
    "{% endfor %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'assistant' %}<|assistant|>"
    "{% set content = m['content'] or '' %}{% set reasoning = m.get('reasoning_content') or '' %}"
    "{% if loop.index0 > ns.last_user and reasoning %}{{ '\\n<think>' + reasoning.strip() + '</think>' }}"
    "{% else %}{{ '\\n<think></think>' }}{% endif %}"
    "{% if content.strip() %}{{ '\\n' + content.strip() }}{% endif %}"
    "{% for c in m.get('tool_calls') or [] %}{{ '\\n<tool_call>' + c['function']['name'] }}"
    "{% for k, v in c['function']['arguments'].items() %}{{ '\\n<arg_key>' + k + '</arg_key>\\n<arg_value>' }}"
    "{{ v if v is string else v | tojson }}</arg_value>{% endfor %}{{ '\\n</tool_call>' }}{% endfor %}"
    "{% elif m['role'] == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}<|observation|>{% endif %}"
    "{{ '\\n<tool_response>\\n' + m['content'] + '\\n</tool_response>' }}"
    "{% else %}<|{{ m['role'] }}|>\n{{ m['content'] }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

# OLMo 3 Instruct, as Ollama's own OLMo 3 renderer writes it (model/renderers/olmo3.go, checked there against the
# released template; no copy of that template is at hand): ChatML turns; a default system prompt naming the tools or
# their absence, the tool list as JSON in <functions>; calls as NAME(key=JSON, ...) lines in <function_calls>;
# results as environment turns
OLMO3 = (
    "<|im_start|>system\n{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}"
    "{% if tools %}<functions>{{ tools | tojson }}</functions>{% endif %}"
    "{% else %}You are a helpful function-calling AI assistant. {% if tools %}You are provided with function "
    "signatures within <functions></functions> XML tags. You may call one or more functions to assist with the user "
    "query. Output any function calls within <function_calls></function_calls> XML tags. Do not make assumptions "
    "about what values to plug into functions.<functions>{{ tools | tojson }}</functions>"
    "{% else %}You do not currently have access to any functions. <functions></functions>{% endif %}{% endif %}"
    "<|im_end|>\n{% for m in messages %}{% if m['role'] == 'user' %}<|im_start|>user\n{{ m['content'] }}<|im_end|>\n"
    "{% elif m['role'] == 'assistant' %}<|im_start|>assistant\n{{ m['content'] or '' }}"
    "{% if m.get('tool_calls') %}<function_calls>{% for c in m['tool_calls'] %}{{ c['function']['name'] }}("
    "{% for k, v in c['function']['arguments'].items() %}{{ k }}={{ v | tojson }}{% if not loop.last %}, {% endif %}"
    "{% endfor %}){% if not loop.last %}{{ '\\n' }}{% endif %}{% endfor %}</function_calls>{% endif %}<|im_end|>\n"
    "{% elif m['role'] == 'tool' %}<|im_start|>environment\n{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
