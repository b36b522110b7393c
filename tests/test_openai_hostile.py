"""Issue 41 on the HTTP gateway, through running services and the official `openai` SDK:
a JSON lone-surrogate escape anywhere in a body (it was a 500 with a UnicodeEncodeError
traceback) and a 10 KB header (a plain-text 400 and an ERROR LineTooLong traceback in the
router's log) are OpenAI-shaped refusals that name what is wrong, and the log stays quiet;
with `echo` and `logprobs`, `text_offset` indexes into the returned text (it counted a `<s>`
that the text does not hold); a context-length refusal names `max_tokens` and gives both counts
as vLLM does; and requests the gateway refuses count in lorafleet_router_requests_total."""
from __future__ import annotations

import http.client
import json
import urllib.request

import openai
import pytest

from tests.conftest import Stack
from tests.support import DEMO_ADAPTERS, FreePort, MODEL_DIR, health_status
pytestmark = pytest.mark.slow
METRICS = FreePort()                     # picked at each start
NOISE = ("Traceback", " ERROR ", "LineTooLong", "UnicodeEncodeError")


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    port = FreePort("127.0.0.1:")
    stack = Stack(MODEL_DIR, DEMO_ADAPTERS, tmp_path_factory.mktemp("hostile"),
                  router_args=["--http-listen", port,
                               "--metrics-port", METRICS])
    stack.port = port.port
    yield stack
    stack.terminate()


def sdk(stack, key: str = "dev") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{stack.port}/v1", api_key=key,
                         max_retries=0)


def raw(stack, path: str, body: bytes, headers=None) -> tuple[int, str, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", stack.port, timeout=60)
    try:
        conn.request("POST", path, body=body, headers={"Content-Type": "application/json",
                                                       **(headers or {})})
        resp = conn.getresponse()
        return resp.status, resp.getheader("Content-Type", ""), resp.read()
    finally:
        conn.close()


def assert_quiet(stack) -> None:
    log = stack.router.log()
    assert not [n for n in NOISE if n in log], log[-3000:]
    assert health_status(stack.router.addr) == 1           # SERVING


CHAT = '"messages": [{"role": "user", "content": "hi"}]'
SURROGATES = [      # (route, body as sent on the wire: JSON escapes, param the 400 names)
    ("/v1/completions", '{"model": "pirate", "prompt": "a\\ud800"}', "prompt"),
    ("/v1/completions", '{"model": "pirate", "prompt": ["a\\udfff"]}', "prompt[0]"),
    ("/v1/completions", '{"model": "pirate", "prompt": "a\\ud800", "stream": true}', "prompt"),
    ("/v1/completions", '{"model": "pi\\udc00rate", "prompt": "a"}', "model"),
    ("/v1/completions", '{"model": "pirate", "prompt": "a", "stop": ["x", "\\ud83d"]}',
     "stop[1]"),
    ("/v1/completions", '{"model": "pirate", "prompt": "a", "user": "\\ude00"}', "user"),
    ("/v1/chat/completions", '{"model": "pirate", "messages": [{"role": "user", '
     '"content": "a\\udc00b"}], "stream": true}', "messages[0].content"),
    ("/v1/chat/completions", '{"model": "pirate", "messages": [{"role": "user", "content": '
     '[{"type": "text", "text": "\\ud800"}]}]}', "messages[0].content[0].text"),
    ("/v1/chat/completions", '{"model": "pirate", ' + CHAT + ', "stop": "\\udbff"}', "stop"),
    ("/v1/chat/completions", '{"model": "pirate", ' + CHAT + ', "x\\ud800": 1}', '"x\\ud800"'),
    ("/tokenize", '{"prompt": "a\\ud800"}', "prompt"),
    ("/tokenize", '{' + CHAT.replace('"hi"', '"\\udfff"') + '}', "messages[0].content"),
]


@pytest.mark.parametrize("route,body,param", SURROGATES)
def test_a_lone_surrogate_is_a_400_naming_its_field(gateway, route, body, param):
    status, kind, data = raw(gateway, route, body.encode())
    assert status == 400 and kind.startswith("application/json"), (status, data[:300])
    error = json.loads(data)["error"]
    assert error["param"] == param and error["code"] == "invalid_value", error
    assert error["message"].startswith(param + ": ") and "surrogate" in error["message"]
    assert_quiet(gateway)


def test_a_valid_surrogate_pair_is_text(gateway):
    status, _, data = raw(gateway, "/v1/completions",
                          b'{"model": "pirate", "prompt": "a \\ud83d\\ude00", "max_tokens": 2}')
    assert status == 200, data[:300]


def test_an_over_long_header_is_a_json_431_and_no_traceback(gateway):
    token = "sk-" + "x" * 10240
    with pytest.raises(openai.APIStatusError) as err:
        sdk(gateway, token).completions.create(model="pirate", prompt="hi", max_tokens=2)
    assert err.value.status_code == 431, err.value
    body = err.value.body
    assert body["code"] == "request_header_fields_too_large", body
    assert body["type"] == "invalid_request_error" and "longer than 8190 bytes" in body["message"]
    assert "xxxxxxxx" not in body["message"] and "xxxxxxxx" not in gateway.router.log()
    assert_quiet(gateway)
    assert sdk(gateway).completions.create(model="pirate", prompt="hi", max_tokens=2).choices


def test_echo_logprobs_text_offsets_index_the_returned_text(gateway):
    client = sdk(gateway)
    kw = dict(model="pirate", prompt="Hello world, tell me", max_tokens=5, temperature=0,
              echo=True, logprobs=1)
    choice = client.completions.create(**kw).choices[0]
    text, lp = choice.text, choice.logprobs
    assert text.startswith("Hello world, tell me") and lp.tokens[0] == "<s>"
    assert lp.text_offset[:2] == [0, 0]                    # <s> is not in the text
    for token, at in zip(lp.tokens[1:], lp.text_offset[1:]):
        assert text[at:at + len(token)] == token, (token, at, text)
    assert "".join(lp.tokens[1:]) == text
    streamed, offsets, tokens = "", [], []
    for chunk in client.completions.create(stream=True, **kw):
        c = chunk.choices[0]
        streamed += c.text
        tokens += c.logprobs.tokens if c.logprobs else []
        offsets += c.logprobs.text_offset if c.logprobs else []
    assert (streamed, tokens, offsets) == (text, lp.tokens, lp.text_offset)


@pytest.mark.parametrize("chat", [False, True])
def test_context_length_refusal_names_max_tokens_with_both_counts(gateway, chat):
    client, prompt = sdk(gateway), "word " * 300
    req = urllib.request.Request(f"http://127.0.0.1:{gateway.port}/tokenize", method="POST",
                                 data=json.dumps({"model": "pirate", **(
                                     {"messages": [{"role": "user", "content": prompt}]}
                                     if chat else {"prompt": prompt})}).encode())
    counted = json.load(urllib.request.urlopen(req, timeout=30))
    n, limit = counted["count"], counted["max_model_len"]
    with pytest.raises(openai.BadRequestError) as err:
        if chat:
            client.chat.completions.create(model="pirate", max_tokens=1000,
                                           messages=[{"role": "user", "content": prompt}])
        else:
            client.completions.create(model="pirate", prompt=prompt, max_tokens=1000)
    body = err.value.body
    assert (body["param"], body["code"]) == ("max_tokens", "context_length_exceeded"), body
    where = "messages" if chat else "prompt"
    assert body["message"].startswith(
        f"This model's maximum context length is {limit} tokens. However, you requested "
        f"{n + 1000} tokens ({n} in the {where}, 1000 in the completion"), body["message"]


def refusals(tenant: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{METRICS}/metrics", timeout=10).read()
    prefix = f'lorafleet_router_requests_total{{status="INVALID_ARGUMENT",tenant="{tenant}"}}'
    other = f'lorafleet_router_requests_total{{tenant="{tenant}",status="INVALID_ARGUMENT"}}'
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.decode().splitlines()
               if line.startswith((prefix, other)))


def test_requests_refused_at_the_gateway_are_counted(gateway):
    client = sdk(gateway, "carol")
    before = refusals("carol")
    for bad in ({"temperature": "hot"}, {"best_of": 3}, {"no_such_field": 1}):
        with pytest.raises(openai.BadRequestError):
            client.completions.create(model="pirate", prompt="hi", extra_body=bad)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="pirate", messages=[{"role": "tool",
                                                                  "content": "x"}])
    status, _, _ = raw(gateway, "/v1/completions", b'{"prompt": "a\\ud800"}',
                       {"Authorization": "Bearer carol"})
    assert status == 400
    assert refusals("carol") - before == 5
