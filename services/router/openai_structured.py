"""Structured outputs and tools in an OpenAI body (services.router.openai_fields): the grammar
the body asks for (OpenAI's `response_format`: json_object, json_schema; vLLM's
`structured_outputs` {json, regex, choice, grammar, json_object} and its older `guided_json`,
`guided_regex`, `guided_choice`, `guided_grammar`), at most one of them, as
SamplingParams.grammar; and `tools`, `tool_choice`, `parallel_tool_calls` as the request's
tools and ToolChoice. A refusal names the body's key (`param`); one of the worker's (a schema
or grammar that does not compile) is reworded with the key the grammar came from
(`http_param`).
"""
from __future__ import annotations

import json

from services.common.gen.lorafleet.v1 import common_pb2

GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
# structured_outputs keys: the grammar ones, and options that are ours already
SO_KINDS = ("json", "regex", "choice", "grammar", "json_object")
SO_OPTIONS = ("disable_any_whitespace", "disable_additional_properties", "disable_fallback")
GRAMMAR_KEYS = ("response_format", "structured_outputs", *GUIDED)
ANY_OBJECT = '{"type": "object"}'


def _error(message: str, param: str, code: str = "invalid_value"):
    from services.router.openai_fields import BodyError     # (openai_fields imports this)
    return BodyError(f"{param}: {message}", param, code)


def _schema(value, param: str, strict: bool = False) -> str:
    """A JSON Schema given as an object or its JSON text -> JSON text (strict: every object
    without additionalProperties gets false, as OpenAI's strict mode requires of them)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            raise _error("not a JSON Schema (not JSON)", param) from None
    if not isinstance(value, (dict, bool)):
        raise _error("a JSON Schema object", param, "invalid_type")
    if strict:
        value = _closed(value)
    return json.dumps(value)


def _closed(schema):
    """The schema with additionalProperties false on each object schema that has none."""
    if isinstance(schema, list):
        return [_closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _closed(v) if k not in ("const", "enum", "default", "examples") else v
           for k, v in schema.items()}
    if (out.get("type") == "object" or "properties" in out) and \
            "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def _strings(value, param: str) -> list[str]:
    if not isinstance(value, list) or not value or \
            not all(isinstance(x, str) and x for x in value):
        raise _error("a non-empty list of non-empty strings", param, "invalid_type")
    return value


def _text(value, param: str) -> str:
    if not isinstance(value, str) or not value:
        raise _error("a non-empty string", param, "invalid_type")
    return value


def _response_format(value) -> common_pb2.Grammar | None:
    param = "response_format"
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise _error('an object with a type ("text", "json_object", "json_schema")', param,
                     "invalid_type")
    kind = value["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return common_pb2.Grammar(json_schema=ANY_OBJECT)
    if kind != "json_schema":
        raise _error(f"type {kind!r} is not text, json_object or json_schema",
                     "response_format.type", "unsupported_value")
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise _error("an object {name, schema, strict}", "response_format.json_schema",
                     "invalid_type")
    if not isinstance(spec.get("name"), str) or not spec["name"]:
        raise _error("required: a string", "response_format.json_schema.name", "invalid_type")
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise _error("true or false", "response_format.json_schema.strict", "invalid_type")
    schema = spec.get("schema", {"type": "object"})
    return common_pb2.Grammar(json_schema=_schema(
        schema, "response_format.json_schema.schema", bool(strict)))


def _structured_outputs(value) -> common_pb2.Grammar | None:
    param = "structured_outputs"
    if not isinstance(value, dict):
        raise _error("an object", param, "invalid_type")
    extra = set(value) - set(SO_KINDS) - set(SO_OPTIONS)
    if extra:
        key = sorted(extra)[0]
        raise _error("not supported", f"{param}.{key}", "unsupported_parameter")
    kinds = [k for k in SO_KINDS if value.get(k) not in (None, False)]
    if len(kinds) > 1:
        raise _error(f"give one of {', '.join(SO_KINDS)}, not {' and '.join(kinds)}", param)
    if not kinds:
        return None
    kind, given = kinds[0], value[kinds[0]]
    strict = bool(value.get("disable_additional_properties"))
    return _grammar(kind, given, f"{param}.{kind}", strict)


def _grammar(kind: str, given, param: str, strict: bool = False) -> common_pb2.Grammar:
    """vLLM's kinds (json, regex, choice, grammar, json_object) as a Grammar."""
    if kind == "json":
        return common_pb2.Grammar(json_schema=_schema(given, param, strict))
    if kind == "json_object":
        return common_pb2.Grammar(json_schema=ANY_OBJECT)
    if kind == "regex":
        return common_pb2.Grammar(regex=_text(given, param))
    if kind == "choice":
        return common_pb2.Grammar(choice=common_pb2.Choice(options=_strings(given, param)))
    text = _text(given, param)             # GBNF (vLLM's, xgrammar's EBNF) or Lark
    return common_pb2.Grammar(ebnf=text) if "::=" in text else common_pb2.Grammar(lark=text)


def grammar(body: dict) -> tuple[common_pb2.Grammar | None, str | None]:
    """The grammar the body asks for and the key it came from; at most one key may ask."""
    asked = [k for k in GRAMMAR_KEYS if body.get(k) is not None]
    found, where = None, None
    for key in asked:
        value = body[key]
        if key == "response_format":
            g = _response_format(value)
        elif key == "structured_outputs":
            g = _structured_outputs(value)
        else:
            g = _grammar(key[len("guided_"):], value, key)
        if g is not None and found is not None:
            raise _error(f"only one of {', '.join(GRAMMAR_KEYS)} may constrain the output "
                         f"({where} does)", key)
        if g is not None:
            found, where = g, key
    return found, where


def _tool(i: int, t) -> common_pb2.Tool:
    param = f"tools[{i}]"
    if not isinstance(t, dict) or t.get("type", "function") != "function" or \
            not isinstance(t.get("function"), dict):
        raise _error('{"type": "function", "function": {...}}', param, "invalid_type")
    fn = t["function"]
    if not isinstance(fn.get("name"), str):
        raise _error("required: a string", f"{param}.function.name", "invalid_type")
    desc = fn.get("description") or ""
    if not isinstance(desc, str):
        raise _error("a string", f"{param}.function.description", "invalid_type")
    params = fn.get("parameters")
    params_json = "" if params is None else _schema(
        params, f"{param}.function.parameters", fn.get("strict") is True)
    return common_pb2.Tool(name=fn["name"], description=desc, parameters_json=params_json)


def tool_list(body: dict) -> list[common_pb2.Tool]:
    """The body's `tools`."""
    given = body.get("tools")
    if given is not None and not isinstance(given, list):
        raise _error("a list of tools", "tools", "invalid_type")
    return [_tool(i, t) for i, t in enumerate(given or ())]


def tools(body: dict, req) -> None:
    """`tools`, `tool_choice` and `parallel_tool_calls` onto the request."""
    given = tool_list(body)
    req.tools.extend(given)
    choice, mode = body.get("tool_choice"), common_pb2.ToolChoice
    if choice is None or choice == "auto":
        req.tool_choice.mode = mode.AUTO if given else mode.NONE
    elif choice in ("none", "required"):
        req.tool_choice.mode = mode.NONE if choice == "none" else mode.REQUIRED
    elif isinstance(choice, dict) and isinstance(choice.get("function"), dict) and \
            isinstance(choice["function"].get("name"), str):
        req.tool_choice.mode = mode.FUNCTION
        req.tool_choice.function = choice["function"]["name"]
    else:
        raise _error('"none", "auto", "required" or {"type": "function", "function": '
                     '{"name": ...}}', "tool_choice", "invalid_value")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise _error("true or false", "parallel_tool_calls", "invalid_type")
    req.tool_choice.single_call = parallel is False


def http_param(message: str, grammar_key: str | None) -> tuple[str, str] | None:
    """A worker's refusal of the grammar (`sampling.grammar.KIND: ...`) or of the tools
    (`tools[i]...`, `tool_choice...`) -> (message, param) with the body's key, or None."""
    field, sep, rest = message.partition(":")
    if field.startswith("sampling.grammar") and grammar_key:
        return f"{grammar_key}:{rest}", grammar_key
    if field.startswith(("tools", "tool_choice")):
        return message, field.split(".")[0].split("[")[0]
    return None
