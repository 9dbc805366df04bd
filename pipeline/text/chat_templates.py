"""Chat templates the serving side renders with when a checkpoint's own cannot: DeepSeek-V3's template
with its tool branches (:data:`DEEPSEEK_V3_TOOLS`), for a chat that carries tool calls or tool results
to a checkpoint whose template has no tool branches (the embedded model's,
pipeline.text.tokenizer.CHAT_TEMPLATE, is V3's without them).

It is DeepSeek-V3's ``tokenizer_config.json`` template: system prompts joined by blank lines; an
assistant message with ``tool_calls`` written as ``<｜tool▁calls▁begin｜>`` and one
``<｜tool▁call▁begin｜>TYPE<｜tool▁sep｜>NAME`` block per call (the arguments in a json fence), joined by
newlines, closed by ``<｜tool▁calls▁end｜><｜end▁of▁sentence｜>``; consecutive ``tool`` messages in one
``<｜tool▁outputs▁begin｜>`` ... ``<｜tool▁outputs▁end｜>`` block; an assistant's ``</think>`` reasoning
dropped; no generation prompt right after tool outputs (the model answers after them directly).
"""

_A, _U, _E = "<｜Assistant｜>", "<｜User｜>", "<｜end▁of▁sentence｜>"
_CALL = ("'<｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>' + tool['function']['name'] + '\\n' + '```json' "
         "+ '\\n' + tool['function']['arguments'] + '\\n' + '```' + '<｜tool▁call▁end｜>'")

DEEPSEEK_V3_TOOLS = (
    "{% if not add_generation_prompt is defined %}{% set add_generation_prompt = false %}{% endif %}"
    "{% set ns = namespace(is_first=false, is_tool=false, is_output_first=true, system_prompt='', is_first_sp=true) %}"
    "{%- for message in messages %}{%- if message['role'] == 'system' %}{%- if ns.is_first_sp %}"
    "{% set ns.system_prompt = ns.system_prompt + message['content'] %}{% set ns.is_first_sp = false %}"
    "{%- else %}{% set ns.system_prompt = ns.system_prompt + '\\n\\n' + message['content'] %}{%- endif %}"
    "{%- endif %}{%- endfor %}{{ bos_token }}{{ ns.system_prompt }}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'user' %}{%- set ns.is_tool = false -%}{{ '" + _U + "' + message['content'] }}"
    "{%- endif %}"
    "{%- if message['role'] == 'assistant' and message['tool_calls'] %}{%- set ns.is_tool = false -%}"
    "{%- set ns.is_first = false -%}"
    "{%- for tool in message['tool_calls'] %}{%- if not ns.is_first %}"
    "{%- if message['content'] is none %}{{ '" + _A + "<｜tool▁calls▁begin｜>' + " + _CALL + " }}"
    "{%- else %}{{ '" + _A + "' + message['content'] + '<｜tool▁calls▁begin｜>' + " + _CALL + " }}{%- endif %}"
    "{%- set ns.is_first = true -%}"
    "{%- else %}{{ '\\n' + " + _CALL + " }}{%- endif %}{%- endfor %}"
    "{{ '<｜tool▁calls▁end｜>" + _E + "' }}{%- endif %}"
    "{%- if message['role'] == 'assistant' and not message['tool_calls'] %}"
    "{%- if ns.is_tool %}{{ '<｜tool▁outputs▁end｜>' + message['content'] + '" + _E + "' }}"
    "{%- set ns.is_tool = false -%}"
    "{%- else %}{% set content = message['content'] %}"
    "{% if '</think>' in content %}{% set content = content.split('</think>')[-1] %}{% endif %}"
    "{{ '" + _A + "' + content + '" + _E + "' }}{%- endif %}{%- endif %}"
    "{%- if message['role'] == 'tool' %}{%- set ns.is_tool = true -%}{%- if ns.is_output_first %}"
    "{{ '<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>' + message['content'] + '<｜tool▁output▁end｜>' }}"
    "{%- set ns.is_output_first = false %}"
    "{%- else %}{{ '\\n<｜tool▁output▁begin｜>' + message['content'] + '<｜tool▁output▁end｜>' }}{%- endif %}"
    "{%- endif %}{%- endfor -%}"
    "{% if ns.is_tool %}{{ '<｜tool▁outputs▁end｜>' }}{% endif %}"
    "{% if add_generation_prompt and not ns.is_tool %}{{ '" + _A + "' }}{% endif %}"
)
