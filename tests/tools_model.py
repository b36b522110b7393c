"""A test checkpoint: the embedded tiny model (its weights and tokenizer, linked) with a chat
template that renders tools and tool calls the way Hermes and Qwen templates do (tools in the
system turn, each call `<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>`, tool
results as `<tool_response>` turns; each tool as its name and parameter names only, which keeps
prompts within the tiny model's 512 tokens), so the worker reports tool_call_format "hermes". The
tiny model was never trained on that format: it writes a call only where a grammar makes it
(tool_choice required or named, or a test's own grammar beside tool_choice auto)."""
from __future__ import annotations

import json
import pathlib

from tests.support import MODEL_DIR

HERMES_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if tools %}<|system|>\n"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}\n{% endif %}"
    "Tools:{% for tool in tools %} {{ tool['function']['name'] }}("
    "{{ tool['function']['parameters']['properties'] | list | join(', ') }}){% endfor %}\n"
    "Call: <tool_call>\n{\"name\": NAME, \"arguments\": ARGS}\n</tool_call>{{ eos_token }}\n"
    "{%- elif messages[0]['role'] == 'system' %}<|system|>\n{{ messages[0]['content'] }}"
    "{{ eos_token }}\n{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'system' %}"
    "{%- elif message['role'] == 'tool' %}<|tool|>\n<tool_response>\n{{ message['content'] }}"
    "\n</tool_response>{{ eos_token }}\n"
    "{%- elif message['role'] == 'assistant' and message['tool_calls'] %}<|assistant|>\n"
    "{% if message['content'] %}{{ message['content'] }}\n{% endif %}"
    "{%- for call in message['tool_calls'] %}<tool_call>\n{\"name\": "
    "{{ call['function']['name'] | tojson }}, \"arguments\": "
    "{{ call['function']['arguments'] | tojson }}}\n</tool_call>{% endfor %}{{ eos_token }}\n"
    "{%- else %}<|{{ message['role'] }}|>\n{{ message['content'] | trim }}{{ eos_token }}\n"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|assistant|>\n{% endif %}")


def make_tools_model(root: pathlib.Path) -> pathlib.Path:
    """The checkpoint directory under root (weights and tokenizer.json linked)."""
    out = root / "tiny-llama-tools"
    out.mkdir(parents=True, exist_ok=True)
    for f in MODEL_DIR.iterdir():
        if f.name != "tokenizer_config.json" and not (out / f.name).exists():
            (out / f.name).symlink_to(f)
    config = json.loads((MODEL_DIR / "tokenizer_config.json").read_text())
    config["chat_template"] = HERMES_TEMPLATE
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return out
