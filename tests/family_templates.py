"""Chat-template shapes of the 2025-26 families (Qwen3.5's thinking blocks, gpt-oss's Harmony channels, GLM-4.5,
Llama 4, Gemma 4): written here with the structure of each family's turns, tool calls and reasoning, so masking is
tested on what those templates really do without a download. Not copies of hub files."""

# Qwen3.5 / Qwen3 thinking ChatML: a reply's reasoning (``reasoning_content``, or a <think> block at the start of its
# content) is kept only for the turns after the last user query and stripped from earlier ones; the last reply
# always opens a think block (empty when it has no reasoning). Tool calls as <tool_call> JSON, results as user turns.
QWEN35 = (
    "{% set ns = namespace(last_user=-1) %}"
    "{% for m in messages %}{% if m['role'] == 'user' %}{% set ns.last_user = loop.index0 %}{% endif %}"
    "{% endfor %}"
    "{% if tools %}<|im_start|>system\n"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}\n\n{% endif %}"
    "# Tools\n<tools>{% for t in tools %}{{ '\\n' }}{{ t | tojson }}{% endfor %}{{ '\\n' }}</tools>"
    "<|im_end|>\n{% endif %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'system' %}{% if not tools %}<|im_start|>system\n{{ m['content'] }}<|im_end|>\n"
    "{% endif %}"
    "{% elif m['role'] == 'assistant' %}"
    "{% set content = m['content'] or '' %}{% set reasoning = m.get('reasoning_content') or '' %}"
    "{% if '</think>' in content %}"
    "{% set reasoning = content.split('</think>')[0].split('<think>')[-1].strip('\n') %}"
    "{% set content = content.split('</think>')[-1].lstrip('\n') %}{% endif %}"
    "<|im_start|>assistant\n"
    "{% if loop.index0 > ns.last_user and (loop.last or reasoning) %}"
    "<think>\n{{ reasoning.strip('\n') }}\n</think>\n\n{% endif %}{{ content }}"
    "{% for c in m.get('tool_calls') or [] %}{{ '\\n' }}<tool_call>\n"
    "{\"name\": \"{{ c['function']['name'] }}\", \"arguments\": {{ c['function']['arguments'] | tojson }}}"
    "\n</tool_call>{% endfor %}<|im_end|>\n"
    "{% elif m['role'] == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m['content'] }}\n</tool_response>"
    "<|im_end|>\n"
    "{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)

# gpt-oss's Harmony: a fixed system header, the user's system prompt and tools as a developer message, replies on
# channels: reasoning on "analysis", the answer on "final" (ending <|return|> when it is the conversation's last
# message, <|end|> in history), tool calls on "commentary" addressed to=functions.NAME ending <|call|>. Past turns
# keep only their final answer (their analysis is dropped), as the real template does.
HARMONY = (
    "<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\n"
    "Reasoning: {{ reasoning_effort | default('medium') }}\n\n"
    "# Valid channels: analysis, commentary, final. Channel must be included for every message.<|end|>"
    "{% set dev = messages[0]['content'] if messages and messages[0]['role'] == 'system' else '' %}"
    "{% if dev or tools %}<|start|>developer<|message|>"
    "{% if dev %}# Instructions\n\n{{ dev }}{% endif %}"
    "{% if tools %}{% if dev %}{{ '\\n' }}\n{% endif %}# Tools\n\n## functions\n\nnamespace functions {\n"
    "{% for t in tools %}{{ '\\n' }}// {{ t['function'].get('description', '') }}\ntype {{ t['function']['name'] }} = "
    "(_: {{ t['function'].get('parameters', {}) | tojson }}) => any;\n{% endfor %}{{ '\\n' }}} // namespace functions"
    "{% endif %}<|end|>{% endif %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'user' %}<|start|>user<|message|>{{ m['content'] }}<|end|>"
    "{% elif m['role'] == 'assistant' %}"
    "{% set thinking = m.get('thinking') or m.get('reasoning_content') or '' %}"
    "{% if m.get('tool_calls') %}"
    "{% if thinking %}<|start|>assistant<|channel|>analysis<|message|>{{ thinking }}<|end|>{% endif %}"
    "{% for c in m['tool_calls'] %}<|start|>assistant to=functions.{{ c['function']['name'] }}"
    "<|channel|>commentary json<|message|>{{ c['function']['arguments'] | tojson }}<|call|>{% endfor %}"
    "{% elif loop.last and not add_generation_prompt %}"
    "{% if thinking %}<|start|>assistant<|channel|>analysis<|message|>{{ thinking }}<|end|>{% endif %}"
    "<|start|>assistant<|channel|>final<|message|>{{ m['content'] }}<|return|>"
    "{% else %}<|start|>assistant<|channel|>final<|message|>{{ m['content'] }}<|end|>{% endif %}"
    "{% elif m['role'] == 'tool' %}<|start|>functions.{{ m.get('name') or 'tool' }} to=assistant"
    "<|channel|>commentary<|message|>{{ m['content'] }}<|end|>"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|start|>assistant{% endif %}"
)

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
