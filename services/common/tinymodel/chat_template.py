"""The tiny model's chat template: ChatML turns with Hermes-style tools.

Layout (what the model sees and must learn to produce):

    <|im_start|>system\n{system}\n\n# Tools ... <tools>\n{tool JSON}\n...</tools> ...<|im_end|>\n
    <|im_start|>user\n{text}<|im_end|>\n
    <|im_start|>assistant\n{text}<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call><|im_end|>\n
    <|im_start|>tool\n<tool_response>\n{result}\n</tool_response><|im_end|>\n
    <|im_start|>assistant\n                       (with add_generation_prompt)

Tools, when given, are listed in the system turn (a system turn is created if the conversation has
none). An assistant message's `tool_calls` (OpenAI shape, or bare {"name", "arguments"}) are rendered
as `<tool_call>` blocks; a string `arguments` is copied verbatim so a call the model sampled renders
back to the same text, a mapping is serialised with `tojson`. `developer` is treated as `system`.
Content may be a string, None, or a list of OpenAI text parts.
"""

from __future__ import annotations

CHAT_TEMPLATE = (
    "{%- macro text(content) -%}"
    "{%- if content is string -%}{{- content -}}"
    "{%- elif content is iterable -%}"
    "{%- for part in content -%}{%- if part.type == 'text' -%}{{- part.text -}}{%- endif -%}{%- endfor -%}"
    "{%- endif -%}"
    "{%- endmacro -%}"
    "{%- set ns = namespace(system=none, first=0) -%}"
    "{%- if messages and messages[0].role in ['system', 'developer'] -%}"
    "{%- set ns.system = messages[0].content -%}{%- set ns.first = 1 -%}"
    "{%- endif -%}"
    "{%- if tools -%}"
    "{{- '<|im_start|>system\\n' -}}"
    "{%- if ns.system -%}{{- text(ns.system) -}}{{- '\\n\\n' -}}{%- endif -%}"
    "{{- '# Tools\\n\\nYou can call the functions described below. Each is given as a JSON signature '"
    " + 'inside <tools></tools>:\\n<tools>' -}}"
    "{%- for tool in tools -%}{{- '\\n' -}}{{- tool | tojson -}}{%- endfor -%}"
    "{{- '\\n</tools>\\n\\nTo call a function, reply with a JSON object holding its name and arguments '"
    " + 'between <tool_call></tool_call> tags, one block per call:\\n<tool_call>\\n'"
    ' + \'{"name": <function name>, "arguments": <JSON object of arguments>}\\n</tool_call><|im_end|>\\n\' -}}'
    "{%- elif ns.system is not none -%}"
    "{{- '<|im_start|>system\\n' -}}{{- text(ns.system) -}}{{- '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- for message in messages[ns.first:] -%}"
    "{%- if message.role == 'assistant' -%}"
    "{{- '<|im_start|>assistant\\n' -}}{{- text(message.content) -}}"
    "{%- for call in message.tool_calls or [] -%}"
    "{%- set fn = call.function if call.function is defined else call -%}"
    "{%- if message.content or not loop.first -%}{{- '\\n' -}}{%- endif -%}"
    "{{- '<tool_call>\\n{\"name\": ' -}}{{- fn.name | tojson -}}{{- ', \"arguments\": ' -}}"
    "{%- if fn.arguments is string -%}{{- fn.arguments -}}"
    "{%- else -%}{{- (fn.arguments or {}) | tojson -}}{%- endif -%}"
    "{{- '}\\n</tool_call>' -}}"
    "{%- endfor -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- elif message.role == 'tool' -%}"
    "{{- '<|im_start|>tool\\n<tool_response>\\n' -}}{{- text(message.content) -}}"
    "{{- '\\n</tool_response><|im_end|>\\n' -}}"
    "{%- else -%}"
    "{{- '<|im_start|>' -}}{{- 'system' if message.role == 'developer' else message.role -}}{{- '\\n' -}}"
    "{{- text(message.content) -}}{{- '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)
