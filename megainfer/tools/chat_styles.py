"""Chat templates in the Qwen3 and DeepSeek-V3 styles, for tiny test checkpoints (written
here, shaped like the real ones): system prompt, the ``tools`` list and its calling
instructions, assistant turns with their ``tool_calls``, ``tool`` results, the generation
prompt (Qwen3: an empty think block with ``enable_thinking=false``; DeepSeek-V3.1's way:
``<think>`` opened with ``thinking=true``, else ``</think>``). Each style's special tokens: ``STYLES[name]``."""
from __future__ import annotations

NL = "{{ '\\n' }}"

QWEN3 = (
    "{%- if tools %}<|im_start|>system" + NL
    + "{%- if messages[0].role == 'system' %}{{ messages[0].content }}" + NL + NL
    + "{%- endif %}# Tools" + NL + "You may call one or more functions. Signatures:" + NL
    + "<tools>{%- for tool in tools %}" + NL + "{{ tool | tojson }}{%- endfor %}" + NL
    + "</tools>" + NL + "For each call, return a JSON object within <tool_call></tool_call>:"
    + NL + '<tool_call>{"name": <function-name>, "arguments": <args-json-object>}</tool_call>'
    + "<|im_end|>" + NL
    + "{%- elif messages[0].role == 'system' %}<|im_start|>system" + NL
    + "{{ messages[0].content }}<|im_end|>" + NL + "{%- endif %}"
    + "{%- for m in messages %}"
    + "{%- if m.role == 'system' %}"
    + "{%- elif m.role == 'tool' %}<|im_start|>user" + NL + "<tool_response>" + NL
    + "{{ m.content }}" + NL + "</tool_response><|im_end|>" + NL
    + "{%- elif m.role == 'assistant' %}<|im_start|>assistant" + NL + "{{ m.content or '' }}"
    + "{%- for tc in m.tool_calls or [] %}" + NL + '<tool_call>{"name": "{{ tc.function.name }}'
    + '", "arguments": {% if tc.function.arguments is string %}{{ tc.function.arguments }}'
    + "{% else %}{{ tc.function.arguments | tojson }}{% endif %}}</tool_call>{%- endfor %}"
    + "<|im_end|>" + NL
    + "{%- else %}<|im_start|>{{ m.role }}" + NL + "{{ m.content }}<|im_end|>" + NL
    + "{%- endif %}{%- endfor %}"
    + "{%- if add_generation_prompt %}<|im_start|>assistant" + NL
    + "{%- if enable_thinking is defined and not enable_thinking %}<think>" + NL + NL
    + "</think>" + NL + NL + "{%- endif %}{%- endif %}")

DEEPSEEK_V3 = (
    "{{ bos_token }}{%- for m in messages %}{%- if m.role == 'system' %}{{ m.content }}"
    + "{%- endif %}{%- endfor %}"
    + "{%- if tools %}" + NL + NL + "## Tools" + NL + "You have access to these tools:"
    + "{%- for tool in tools %}" + NL + NL + "### {{ tool.function.name }}" + NL
    + "Description: {{ tool.function.description or '' }}" + NL
    + "Parameters: {{ tool.function.parameters | tojson }}{%- endfor %}" + NL + NL
    + "Call them as: <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME"
    + NL + "```json" + NL + "ARGUMENTS" + NL + "```<｜tool▁call▁end｜><｜tool▁calls▁end｜>"
    + "{%- endif %}"
    + "{%- for m in messages %}"
    + "{%- if m.role == 'user' %}<｜User｜>{{ m.content }}"
    + "{%- elif m.role == 'assistant' %}<｜Assistant｜>{{ m.content or '' }}"
    + "{%- if m.tool_calls %}<｜tool▁calls▁begin｜>{%- for tc in m.tool_calls %}"
    + "<｜tool▁call▁begin｜>function<｜tool▁sep｜>{{ tc.function.name }}" + NL + "```json"
    + NL + "{% if tc.function.arguments is string %}{{ tc.function.arguments }}{% else %}"
    + "{{ tc.function.arguments | tojson }}{% endif %}" + NL
    + "```<｜tool▁call▁end｜>{%- endfor %}<｜tool▁calls▁end｜>{%- endif %}"
    + "<｜end▁of▁sentence｜>"
    + "{%- elif m.role == 'tool' %}<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>"
    + "{{ m.content }}<｜tool▁output▁end｜><｜tool▁outputs▁end｜>"
    + "{%- endif %}{%- endfor %}"
    + "{%- if add_generation_prompt %}<｜Assistant｜>"
    + "{%- if thinking is defined and thinking %}<think>{%- else %}</think>{%- endif %}"
    + "{%- endif %}")

# name: (template, special tokens [pad, bos, eos, ...] (ids 0, 1, 2, ...), added tokens the
# decoded text keeps (the reasoning and tool-call markers))
STYLES = {
    "qwen3": (QWEN3, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
              ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>",
               "</tool_response>"]),
    "deepseek_v3": (DEEPSEEK_V3, ["<｜pad｜>", "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>",
                                  "<｜User｜>", "<｜Assistant｜>"],
                    ["<think>", "</think>", "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>",
                     "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>",
                     "<｜tool▁outputs▁begin｜>", "<｜tool▁outputs▁end｜>",
                     "<｜tool▁output▁begin｜>", "<｜tool▁output▁end｜>"]),
}
