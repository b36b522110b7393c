"""Structured outputs and tool calling (issue 45) through running services and the official
`openai` SDK: router (HTTP gateway) + adapter-store + worker on loopback, one stack for the
module, on the embedded tiny model at temperature 1.0 (which otherwise samples its training
sentences, or noise).

- 30 concurrent chats over the 3 demo adapters and the base, each with its own JSON Schema
  (objects, arrays, enums, numbers, nested objects, required fields, strings bounded by
  maxLength): every reply parses and validates (jsonschema);
- vLLM's structured_outputs and guided_* (regex, choice, grammar): every reply matches;
  json_object: every reply the model ends parses (see test_json_object for why some cannot);
- the SDK's chat.completions.parse with a pydantic model;
- n > 1 with logprobs, a stop sequence, max_tokens running out mid-object ("length");
- refusals: a bad schema, regex or grammar is a 400 naming the body's key; over gRPC,
  INVALID_ARGUMENT naming sampling.grammar.KIND;
- tools, on a checkpoint with a Hermes-style template (tests/tools_model.py): required and a
  named function return tool_calls whose arguments validate against the parameters; a chat
  carrying tool calls and results renders through the template (as transformers renders
  it); auto parses the call the model writes, which a test grammar makes it write (the tiny
  model was never trained to call tools), streamed as OpenAI streams calls.
"""
from __future__ import annotations

import concurrent.futures
import json
import random
import re

import grpc
import jsonschema
import openai
import pydantic
import pytest
from typing import Literal

from services.common.gen.lorafleet.v1 import common_pb2, router_pb2 as rpb, router_pb2_grpc
from tests.conftest import Stack
from tests.support import DEMO_ADAPTERS, FreePort
from tests.tools_model import make_tools_model

pytestmark = pytest.mark.slow
MODELS = ("base", "acme-support", "pirate", "poet")
ASK = [{"role": "user", "content": "Tell me about the weather, as JSON."}]
WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 10},
    "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"], "additionalProperties": False}
ADD = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 999},
                                        "b": {"type": "integer", "minimum": 0,
                                              "maximum": 999}},
       "required": ["a", "b"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "weather",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "parameters": ADD}}]


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    root = tmp_path_factory.mktemp("structured")
    port = FreePort("127.0.0.1:")
    s = Stack(make_tools_model(root), DEMO_ADAPTERS, root,
              router_args=["--http-listen", port])
    yield s, f"http://127.0.0.1:{port}"
    s.terminate()


@pytest.fixture(scope="module")
def sdk(stack):
    return openai.OpenAI(base_url=stack[1] + "/v1", api_key="unused", max_retries=0,
                         timeout=120)


def _field(rng: random.Random, depth: int) -> dict:
    kinds = ["string", "integer", "number", "enum", "boolean", "array"]
    if depth == 0:
        kinds.append("object")
    kind = rng.choice(kinds)
    if kind == "string":
        return {"type": "string", "maxLength": rng.randint(1, 12)}
    if kind == "integer":
        lo = rng.randint(-50, 50)
        return {"type": "integer", "minimum": lo, "maximum": lo + rng.randint(1, 500)}
    if kind == "number":
        return {"type": "number", "minimum": 0, "maximum": 100}
    if kind == "enum":
        return {"enum": rng.sample(["red", "green", "blue", "north", "south", "x1"], 3)}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "array":
        return {"type": "array", "items": _field(rng, depth + 1), "minItems": 1,
                "maxItems": rng.randint(1, 3)}
    return _object(rng, depth + 1)


def _object(rng: random.Random, depth: int) -> dict:
    names = rng.sample(["id", "name", "size", "kind", "tags", "where", "ok", "score"],
                       rng.randint(2, 4))
    props = {n: _field(rng, depth) for n in names}
    required = [n for n in names if rng.random() < 0.7] or names[:1]
    return {"type": "object", "properties": props, "required": required,
            "additionalProperties": False}


def schema_for(i: int) -> dict:
    return _object(random.Random(i), 0)


def test_thirty_concurrent_schemas_over_adapters_and_base_all_validate(sdk):
    def one(i: int):
        schema = schema_for(i)
        r = sdk.chat.completions.create(
            model=MODELS[i % len(MODELS)], messages=ASK, temperature=1.0, max_tokens=300,
            response_format={"type": "json_schema",
                             "json_schema": {"name": f"s{i}", "schema": schema,
                                             "strict": True}})
        return schema, r
    with concurrent.futures.ThreadPoolExecutor(30) as pool:
        results = list(pool.map(one, range(30)))
    nested = 0
    for schema, r in results:
        c = r.choices[0]
        assert c.finish_reason == "stop", (c.finish_reason, c.message.content)
        value = json.loads(c.message.content)
        jsonschema.validate(value, schema)
        nested += any(isinstance(v, (dict, list)) for v in value.values())
        assert r.usage.completion_tokens > 0
    assert nested >= 5          # the schemas' arrays and nested objects were exercised


def test_regex_choice_and_grammar_through_vllm_fields(sdk):
    regex = r"[a-z]{2,6}-[0-9]{2,4}"
    asks = [({"structured_outputs": {"regex": regex}}, lambda t: re.fullmatch(regex, t)),
            ({"guided_regex": regex}, lambda t: re.fullmatch(regex, t)),
            ({"structured_outputs": {"choice": ["sunny", "rainy", "snowy"]}},
             lambda t: t in ("sunny", "rainy", "snowy")),
            ({"guided_choice": ["yes", "no"]}, lambda t: t in ("yes", "no")),
            ({"guided_grammar": 'root ::= "temp=" [0-9] [0-9]? "C"'},
             lambda t: re.fullmatch(r"temp=[0-9][0-9]?C", t)),
            ({"structured_outputs": {"grammar": 'start: "ok " /[a-z]{1,5}/'}},
             lambda t: re.fullmatch(r"ok [a-z]{1,5}", t)),
            ({"guided_json": json.dumps(WEATHER)},
             lambda t: jsonschema.validate(json.loads(t), WEATHER) is None)]

    def one(i: int):
        extra, _ = asks[i % len(asks)]
        return sdk.chat.completions.create(model=MODELS[i % 4], messages=ASK, max_tokens=60,
                                           temperature=1.0, extra_body=extra)
    with concurrent.futures.ThreadPoolExecutor(14) as pool:
        replies = list(pool.map(one, range(2 * len(asks))))
    for i, r in enumerate(replies):
        text = r.choices[0].message.content
        assert r.choices[0].finish_reason == "stop" and asks[i % len(asks)][1](text), \
            (asks[i % len(asks)][0], text)
    # completions take vLLM's fields too
    r = sdk.completions.create(model="pirate", prompt="The weather:", max_tokens=20,
                               temperature=1.0, extra_body={"guided_choice": ["hot", "cold"]})
    assert r.choices[0].text in ("hot", "cold")


def test_json_object(sdk):
    """Any JSON object. The tiny model, asked for an object at temperature 1, writes `{}` or
    opens a key and then writes its training sentences into it without end (a key is any
    string): seeded, so the same replies each run; every reply it ends parses as an object,
    the others are cut by max_tokens ("length")."""
    replies = [sdk.chat.completions.create(
        model=MODELS[i % 4], messages=ASK, max_tokens=120, temperature=1.0, seed=100 + i,
        response_format={"type": "json_object"}) for i in range(6)]
    ended = [r.choices[0] for r in replies if r.choices[0].finish_reason == "stop"]
    assert ended
    for c in ended:
        assert isinstance(json.loads(c.message.content), dict)
    for r in replies:
        assert r.choices[0].finish_reason in ("stop", "length")
        assert r.choices[0].message.content.startswith("{")


class Forecast(pydantic.BaseModel):
    city: str = pydantic.Field(max_length=10)
    sky: Literal["clear", "cloudy", "rain"]
    high: int = pydantic.Field(ge=-40, le=50)
    windy: bool


def test_sdk_parse_with_a_pydantic_model(sdk):
    for model in ("base", "poet"):
        r = sdk.chat.completions.parse(model=model, messages=ASK, temperature=1.0,
                                       max_tokens=200, response_format=Forecast)
        parsed = r.choices[0].message.parsed
        assert isinstance(parsed, Forecast) and len(parsed.city) <= 10


def test_n_choices_logprobs_and_forced_tokens_counted(sdk):
    r = sdk.chat.completions.create(
        model="acme-support", messages=ASK, temperature=1.0, max_tokens=200, n=3, seed=7,
        logprobs=True, top_logprobs=2,
        response_format={"type": "json_schema", "json_schema": {"name": "w",
                                                                "schema": WEATHER}})
    assert len(r.choices) == 3
    total = 0
    for c in r.choices:
        jsonschema.validate(json.loads(c.message.content), WEATHER)
        assert "".join(t.token for t in c.logprobs.content) == c.message.content
        total += len(c.logprobs.content)
    assert r.usage.completion_tokens == total         # every token counts, forced or not


def test_stop_sequence_and_max_tokens_mid_object(sdk):
    r = sdk.chat.completions.create(model="base", messages=ASK, temperature=1.0,
                                    max_tokens=60, stop=["-"],
                                    extra_body={"guided_regex": r"[a-z]{3}-[0-9]{3}"})
    assert r.choices[0].finish_reason == "stop" and re.fullmatch("[a-z]{3}",
                                                                 r.choices[0].message.content)
    r = sdk.chat.completions.create(model="pirate", messages=ASK, temperature=1.0,
                                    max_tokens=4, response_format={
                                        "type": "json_schema",
                                        "json_schema": {"name": "w", "schema": WEATHER}})
    assert r.choices[0].finish_reason == "length"
    assert r.choices[0].message.content.startswith('{"')


@pytest.mark.parametrize("extra, param", [
    ({"response_format": {"type": "json_schema",
                          "json_schema": {"name": "bad", "schema": {"type": "objekt"}}}},
     "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}},
     "response_format.json_schema.name"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs"),
    ({"guided_grammar": "root ::= ("}, "guided_grammar"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_regex": "[a-z]+", "guided_choice": ["a"]}, "guided_choice"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
])
def test_bad_schema_or_grammar_is_a_400_naming_the_field(sdk, extra, param):
    with pytest.raises(openai.BadRequestError) as err:
        sdk.chat.completions.create(model="base", messages=ASK, max_tokens=8,
                                    extra_body=extra)
    assert err.value.body["param"] == param, err.value.body
    assert err.value.body["message"].startswith(param.split(".")[0]), err.value.body


def test_grpc_grammar_and_its_refusal(stack):
    s, _ = stack
    with grpc.insecure_channel(s.router.addr) as ch:
        stub = router_pb2_grpc.GenerationServiceStub(ch)
        req = rpb.GenerateRequest(text="Weather:", sampling=common_pb2.SamplingParams(
            temperature=1.0, grammar=common_pb2.Grammar(
                choice=common_pb2.Choice(options=["warm", "cold"]))))
        req.stopping.max_new_tokens = 10
        resp = stub.Generate(req, timeout=60)
        assert resp.text in ("warm", "cold") and resp.stop_reason == common_pb2.EOS_TOKEN
        req.sampling.grammar.json_schema = '{"type": "object", "minProperties": "x"}'
        with pytest.raises(grpc.RpcError) as err:
            stub.Generate(req, timeout=60)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.value.details().startswith("sampling.grammar.json_schema:")
        info = stub.ModelInfo(rpb.ModelInfoRequest(), timeout=10)
        assert info.tool_call_format == "hermes"


def _validate_call(call, tools=TOOLS) -> None:
    params = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    assert call.type == "function" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), params[call.function.name])


def test_tool_choice_required_and_named_return_valid_calls(sdk):
    """A named function and required with parallel_tool_calls false: exactly one call. Required
    with parallel calls: one or more, as many as the sampled model goes on writing (the tiny
    one may write them until max_tokens cuts one: the complete ones are returned)."""
    def one(i: int):
        choice = "required" if i % 2 else {"type": "function", "function": {"name": "add"}}
        parallel = i % 4 == 3
        return choice, parallel, sdk.chat.completions.create(
            model=MODELS[i % 4], messages=ASK, tools=TOOLS, tool_choice=choice,
            temperature=1.0, max_tokens=150, parallel_tool_calls=parallel)
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        replies = list(pool.map(one, range(8)))
    for choice, parallel, r in replies:
        c = r.choices[0]
        assert c.message.tool_calls, c
        if parallel:
            assert c.finish_reason in ("tool_calls", "length")
        else:
            assert c.finish_reason == "tool_calls" and len(c.message.tool_calls) == 1, c
            assert not c.message.content
        for call in c.message.tool_calls:
            _validate_call(call)
            if choice != "required":
                assert call.function.name == "add"
    assert len({call.id for *_, r in replies for call in r.choices[0].message.tool_calls}) == \
        sum(len(r.choices[0].message.tool_calls) for *_, r in replies)


def test_a_chat_with_tool_results_renders_through_the_template(stack, sdk, tmp_path):
    from transformers import AutoTokenizer
    chat = [{"role": "system", "content": "Be brief."}, *ASK,
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function",
                 "function": {"name": "get_weather",
                              "arguments": '{"city": "Oslo", "unit": "celsius"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": -3}'}]
    import urllib.request
    body = json.dumps({"model": "base", "messages": chat, "tools": TOOLS}).encode()
    got = json.loads(urllib.request.urlopen(urllib.request.Request(
        stack[1] + "/tokenize", body, {"Content-Type": "application/json"}),
        timeout=30).read())["tokens"]
    hf_chat = [dict(m) for m in chat]
    hf_chat[2] = {**chat[2], "content": "", "tool_calls": [{
        **chat[2]["tool_calls"][0], "function": {"name": "get_weather",
                                                 "arguments": {"city": "Oslo",
                                                               "unit": "celsius"}}}]}
    tok = AutoTokenizer.from_pretrained(make_tools_model(tmp_path))
    text = tok.apply_chat_template(hf_chat, tools=TOOLS, add_generation_prompt=True,
                                   tokenize=False)
    assert "<tool_response>\n{\"temp\": -3}\n</tool_response>" in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"' in text
    assert got == tok(text, add_special_tokens=False)["input_ids"]
    r = sdk.chat.completions.create(model="poet", messages=chat, tools=TOOLS, max_tokens=8,
                                    temperature=1.0)
    assert r.choices[0].finish_reason in ("stop", "length")


CALL_REGEX = (r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "(Oslo|Rome)", '
              r'"unit": "celsius"\}\}\n</tool_call>')


def test_auto_parses_the_call_the_model_writes(sdk):
    """tool_choice auto: the reply is parsed for calls in the template's format. The tiny
    model never learned to call tools, so a test grammar (a regex, given beside the tools)
    makes it write one, text first: what is outside the call stays content."""
    regex = "(Sure|Ok)\\. " + CALL_REGEX
    r = sdk.chat.completions.create(model="pirate", messages=ASK, tools=TOOLS,
                                    tool_choice="auto", temperature=1.0, max_tokens=120,
                                    extra_body={"guided_regex": regex})
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content in ("Sure. ", "Ok. ")
    (call,) = c.message.tool_calls
    assert call.function.name == "get_weather"
    _validate_call(call)
    r = sdk.chat.completions.create(model="pirate", messages=ASK, tools=TOOLS,
                                    temperature=1.0, max_tokens=20,
                                    extra_body={"guided_choice": ["No call needed."]})
    assert r.choices[0].message.content == "No call needed."
    assert not r.choices[0].message.tool_calls and r.choices[0].finish_reason == "stop"


def test_calls_stream_as_openai_streams_them(sdk):
    for extra, choice in (({"guided_regex": CALL_REGEX}, "auto"), ({}, "required")):
        chunks = list(sdk.chat.completions.create(
            model="acme-support", messages=ASK, tools=TOOLS, tool_choice=choice,
            temperature=1.0, max_tokens=150, stream=True, extra_body=extra))
        calls, content, finish = {}, "", None
        for ch in chunks:
            d = ch.choices[0].delta
            content += d.content or ""
            for tc in d.tool_calls or ():
                entry = calls.setdefault(tc.index, {"id": tc.id, "name": "", "arguments": ""})
                entry["name"] += tc.function.name or ""
                entry["arguments"] += tc.function.arguments or ""
            finish = ch.choices[0].finish_reason or finish
        assert finish == "tool_calls" and calls and not content.strip()
        params = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
        for entry in calls.values():
            assert entry["id"].startswith("call_")
            jsonschema.validate(json.loads(entry["arguments"]), params[entry["name"]])


@pytest.mark.parametrize("extra, param", [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools"),
    ({"tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "nope"}}}}}],
      "tool_choice": "required"}, "tools"),
    ({"tools": TOOLS, "tool_choice": "required", "guided_regex": "a"}, "tool_choice"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id"),
])
def test_bad_tools_are_a_400_naming_the_field(sdk, extra, param):
    body = {"messages": ASK, **extra}
    with pytest.raises(openai.BadRequestError) as err:
        sdk.chat.completions.create(model="base", max_tokens=8, **{
            k: v for k, v in body.items() if k in ("messages", "tools", "tool_choice")},
            extra_body={k: v for k, v in body.items()
                        if k not in ("messages", "tools", "tool_choice")})
    assert err.value.body["param"] == param, err.value.body
