"""A checkpoint's chat template: messages -> the prompt text the model was fine-tuned on.

Hugging Face checkpoints ship their template as Jinja: `chat_template` in tokenizer_config.json
(a string, or a list of named templates of which "default" is the one used without tools), or
a `chat_template.jinja` file beside it, which transformers prefers when both exist. It is
rendered with transformers' conventions, so a prompt is the very text
`tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)` gives:

- variables `messages` (dicts with `role` and `content`; an assistant's `tool_calls` as
  OpenAI's objects with the arguments parsed, a tool message's `tool_call_id` and `name`),
  `add_generation_prompt`, the special tokens' strings (`bos_token`, `eos_token`, `unk_token`,
  `pad_token`), `tools` (OpenAI's `{"type": "function", "function": {...}}` objects, or None)
  and `documents` (None);
- `raise_exception(message)` (a template's own refusal, e.g. roles out of order: the request
  gets it as INVALID_ARGUMENT), `strftime_now(format)`, a `tojson` filter that keeps non-ASCII
  text; `trim_blocks` and `lstrip_blocks`; `{% break %}` / `{% continue %}`, and the
  `{% generation %}` block (rendered as its body);
- a sandbox (jinja2's immutable one): a template reads its inputs and cannot call into the
  process or mutate what it is given.

The rendered text is tokenized without the tokenizer's own special tokens (the template writes
`bos_token` itself where the model wants it), as apply_chat_template does.

A checkpoint without a template gets the fallback (FALLBACK): "role: content" lines, then
"assistant:", tokenized with the tokenizer's special tokens as a plain prompt is.

How the template has the model write tool calls (`tool_call_format`) is read from its text:
"hermes" (`<tool_call>` JSON `</tool_call>`: Hermes, Qwen 2/2.5/3), "mistral" (`[TOOL_CALLS]`),
"llama3_json" (`<|python_tag|>` or a JSON `{"name", "parameters"}`: Llama 3.1-3.3); "" for a
template that renders no tools. The router parses and enforces calls in that format.
"""
from __future__ import annotations

import datetime
import json
import pathlib
from dataclasses import dataclass

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment

from services.common.errors import InvalidArgument

ROLES = ("system", "user", "assistant", "tool")
TOOL_FORMATS = ("hermes", "llama3_json", "mistral")
SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")


class _Generation(Extension):
    """`{% generation %}...{% endgeneration %}` (transformers marks assistant text with it):
    rendered as its body."""
    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    @staticmethod
    def _body(caller):
        return caller()


def _raise(message):
    raise jinja2.TemplateError(str(message))


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt):
    return datetime.datetime.now().strftime(fmt)


def _token_text(value) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


@dataclass(frozen=True)
class ChatTemplate:
    source: str                       # the Jinja text
    special: dict[str, str]           # bos_token, eos_token, ... -> their strings

    @classmethod
    def from_model_dir(cls, model_dir: str | pathlib.Path) -> ChatTemplate | None:
        """The checkpoint's template (chat_template.jinja, else tokenizer_config.json's
        chat_template); None when it has none. A template that does not compile is an error
        at start, not at the first chat."""
        d = pathlib.Path(model_dir)
        config = {}
        if (d / "tokenizer_config.json").is_file():
            config = json.loads((d / "tokenizer_config.json").read_text())
        source = config.get("chat_template")
        if isinstance(source, list):      # named templates: the default one
            named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
            source = named.get("default")
        if (d / "chat_template.jinja").is_file():
            source = (d / "chat_template.jinja").read_text()
        if not isinstance(source, str) or not source.strip():
            return None
        special = {k: t for k in SPECIAL_KEYS if (t := _token_text(config.get(k))) is not None}
        template = cls(source, special)
        template.compiled              # noqa: B018 - compile now: a broken one fails the start
        return template

    @property
    def compiled(self) -> jinja2.Template:
        cached = self.__dict__.get("_compiled")
        if cached is None:
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=[_Generation, "jinja2.ext.loopcontrols"])
            env.filters["tojson"] = _tojson
            env.globals.update(raise_exception=_raise, strftime_now=_strftime_now)
            try:
                cached = env.from_string(self.source)
            except jinja2.TemplateSyntaxError as exc:
                raise ValueError(f"chat template: {exc}") from None
            object.__setattr__(self, "_compiled", cached)
        return cached

    @property
    def tool_call_format(self) -> str:
        """The tool-call format the template teaches (module docstring); "" for none."""
        src = self.source
        if "tools" not in src:
            return ""
        if "<tool_call>" in src:
            return "hermes"
        if "[TOOL_CALLS]" in src:
            return "mistral"
        if "<|python_tag|>" in src or ("ipython" in src and "parameters" in src):
            return "llama3_json"
        return ""

    def render(self, messages: list[dict], add_generation_prompt: bool = True,
               tools: list[dict] | None = None) -> str:
        """The prompt text for these messages (and tools); a template's own refusal
        (raise_exception) or failure is INVALID_ARGUMENT naming the messages."""
        try:
            return self.compiled.render(messages=messages,
                                        add_generation_prompt=add_generation_prompt,
                                        tools=tools or None, documents=None, **self.special)
        except jinja2.TemplateError as exc:
            raise InvalidArgument(f"messages: the model's chat template refused them: {exc}") \
                from None


def fallback(messages: list[dict]) -> str:
    """The documented rendering for a checkpoint without a template (a tool call as its JSON)."""
    def text(m):
        calls = [json.dumps({"name": c["function"]["name"],
                             "arguments": c["function"]["arguments"]})
                 for c in m.get("tool_calls", ())]
        return "\n".join([m["content"], *calls] if m["content"] else calls)
    return "\n".join(f"{m['role']}: {text(m)}" for m in messages) + "\nassistant:"


def check_messages(messages) -> list[dict]:
    """Proto ChatMessages as the dicts a template reads; roles other than system, user,
    assistant and tool are refused, as is an empty chat."""
    if not messages:
        raise InvalidArgument("messages: a non-empty list is required")
    out = []
    for i, m in enumerate(messages):
        if m.role not in ROLES:
            raise InvalidArgument(f"messages[{i}].role: {m.role!r} is not one of "
                                  f"{', '.join(ROLES)}")
        d = {"role": m.role, "content": m.content}
        if m.tool_calls:
            d["tool_calls"] = [_call(f"messages[{i}].tool_calls[{j}]", c)
                               for j, c in enumerate(m.tool_calls)]
        if m.role == "tool":
            d["tool_call_id"], d["name"] = m.tool_call_id, m.name
        out.append(d)
    return out


def _call(field: str, call) -> dict:
    """A ToolCall as OpenAI's object, the arguments parsed (templates write them with tojson)."""
    try:
        args = json.loads(call.arguments or "{}")
    except (json.JSONDecodeError, RecursionError):
        raise InvalidArgument(f"{field}.function.arguments: not JSON") from None
    return {"id": call.id, "type": "function",
            "function": {"name": call.name, "arguments": args}}


def check_tools(tools) -> list[dict]:
    """Proto Tools as the objects a template reads (OpenAI's), the parameters parsed."""
    out = []
    for i, t in enumerate(tools):
        try:
            params = json.loads(t.parameters_json) if t.parameters_json else {"type": "object"}
        except (json.JSONDecodeError, RecursionError):
            raise InvalidArgument(f"tools[{i}].parameters_json: not JSON") from None
        fn = {"name": t.name, "parameters": params}
        if t.description:
            fn["description"] = t.description
        out.append({"type": "function", "function": fn})
    return out
