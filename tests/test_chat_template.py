"""services.worker.api.chat_template renders what transformers' apply_chat_template renders, for
templates in the shapes instruct checkpoints ship (ChatML with whitespace control, Llama-3
headers, alternation checks with raise_exception, loop controls, named templates, a
chat_template.jinja file), and refuses what a template refuses."""
from __future__ import annotations

import json
import shutil

import pytest

from services.common.errors import InvalidArgument
from services.worker.api.chat_template import ChatTemplate, fallback
from tests.support import MODEL_DIR

CHATML = ("{%- for m in messages %}"
          "{%- if loop.first and m.role != 'system' %}<|im_start|>system\nBe brief.<|im_end|>\n"
          "{%- endif %}"
          "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
          "{%- endfor %}"
          "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}")
HEADERS = ("{{ bos_token }}{% for m in messages %}"
           "{% set text = '<|start_header_id|>' + m['role'] + '<|end_header_id|>\n\n'"
           " + m['content'] | trim + '<|eot_id|>' %}{{ text }}{% endfor %}"
           "{% if add_generation_prompt %}"
           "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")
ALTERNATING = ("{{ bos_token }}{% for message in messages %}"
               "{% if message['role'] == 'system' %}{% continue %}{% endif %}"
               "{% if (message['role'] == 'user') != (loop.index0 % 2 == (1 if messages[0]"
               "['role'] == 'system' else 0)) %}"
               "{{ raise_exception('roles must alternate user/assistant') }}{% endif %}"
               "{% if message['role'] == 'user' %}[INST] {{ message['content'] }} [/INST]"
               "{% else %}{{ message['content'] }}{{ eos_token }}{% endif %}{% endfor %}")
TOJSON = ("{% for m in messages %}{{ m | tojson }}\n{% endfor %}"
          "{% generation %}{{ 'go' }}{% endgeneration %}")
CHAT = [{"role": "system", "content": "You help."},
        {"role": "user", "content": "  Héllo, wörld!  "},
        {"role": "assistant", "content": "Hi."},
        {"role": "user", "content": "Weather?"}]


def checkpoint(tmp_path, template, as_file: bool = False):
    d = tmp_path / "ckpt"
    shutil.copytree(MODEL_DIR, d, ignore=shutil.ignore_patterns("*.safetensors"))
    config = json.loads((d / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    if as_file:
        (d / "chat_template.jinja").write_text(template)
        config["chat_template"] = "{{ 'overridden by the file' }}"
    elif template is not None:
        config["chat_template"] = template
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    return d


def hf_render(d, messages, add_generation_prompt=True):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(d).apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt)


@pytest.mark.parametrize("template", [CHATML, HEADERS, ALTERNATING, TOJSON],
                         ids=["chatml", "headers", "alternating", "tojson"])
@pytest.mark.parametrize("gen", [True, False])
def test_renders_as_transformers_does(tmp_path, template, gen):
    d = checkpoint(tmp_path, template)
    ours = ChatTemplate.from_model_dir(d)
    assert ours.render(CHAT, add_generation_prompt=gen) == hf_render(d, CHAT, gen)


def test_the_jinja_file_wins_and_named_templates_use_default(tmp_path):
    d = checkpoint(tmp_path, CHATML, as_file=True)
    assert ChatTemplate.from_model_dir(d).render(CHAT) == hf_render(d, CHAT)
    d2 = checkpoint(tmp_path / "named", [{"name": "tool_use", "template": "{{ 'tools' }}"},
                                         {"name": "default", "template": HEADERS}])
    assert ChatTemplate.from_model_dir(d2).render(CHAT) == hf_render(d2, CHAT)


def test_a_template_refusal_is_invalid_argument(tmp_path):
    t = ChatTemplate.from_model_dir(checkpoint(tmp_path, ALTERNATING))
    with pytest.raises(InvalidArgument, match="roles must alternate"):
        t.render([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])


def test_the_sandbox_keeps_a_template_from_reaching_the_process(tmp_path):
    evil = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    t = ChatTemplate.from_model_dir(checkpoint(tmp_path, evil))
    with pytest.raises(InvalidArgument):
        t.render(CHAT)
    mutate = "{% set _ = messages.append({'role': 'user', 'content': 'x'}) %}{{ messages }}"
    t = ChatTemplate.from_model_dir(checkpoint(tmp_path / "m", mutate))
    with pytest.raises(InvalidArgument):
        t.render(CHAT)


def test_no_template_and_a_broken_one(tmp_path):
    assert ChatTemplate.from_model_dir(checkpoint(tmp_path, None)) is None
    assert fallback(CHAT[1:2]) == "user:   Héllo, wörld!  \nassistant:"
    with pytest.raises(ValueError, match="chat template"):
        ChatTemplate.from_model_dir(checkpoint(tmp_path / "b", "{% for m in messages %}"))
