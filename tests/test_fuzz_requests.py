"""Property-based fuzzing of the request surface, through one running stack: arbitrary
GenerateRequests over gRPC and arbitrary JSON bodies for /v1/completions and
/v1/chat/completions over HTTP, their strings now and then holding a lone UTF-16 surrogate
(a JSON escape such as "\\ud800", which is no text: issue 41 found it a 500), and arbitrary
headers, over-long ones and too many of them included (a 10 KB one was a plain-text 400 and a
traceback in the router's log). Whatever the fields hold, the answer is a result or a typed
refusal (gRPC OK, INVALID_ARGUMENT, RESOURCE_EXHAUSTED or NOT_FOUND; HTTP 200, or 400, 401, 404,
429 or 431 with an OpenAI error object), never UNKNOWN, INTERNAL or a 500, and every service is
still SERVING at the end."""
from __future__ import annotations

import http.client
import json
import urllib.error
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2
from hypothesis import HealthCheck, event, example, given, settings, strategies as st

from services.common.gen.lorafleet.v1 import common_pb2, router_pb2 as rpb, router_pb2_grpc
from services.router.openai_fields import CHAT, COMPLETIONS, SAMPLING
from tests.conftest import Stack
from tests.support import DEMO_ADAPTERS, FreePort, MODEL_DIR, health_status
pytestmark = pytest.mark.slow
SERVING = health_pb2.HealthCheckResponse.SERVING
FUZZ = settings(max_examples=150, deadline=None, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture,
                                       HealthCheck.too_slow])
GRPC_OK = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT,
           grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.NOT_FOUND}
NAMES = st.sampled_from(["", "pirate", "poet", "acme-support", "nope", "pirate@0123456789abcdef",
                         "pirate@", "@", "tiny-llama"]) | st.text(max_size=12)
U32, U64 = st.integers(0, 2**32 - 1), st.integers(0, 2**64 - 1)
F32 = st.floats(width=32)                      # NaN and the infinities included
SMALL_TOKENS = st.integers(0, 4) | st.integers(600, 2**32 - 1)     # quick, or refused
# text with at least one lone surrogate (json.dumps sends it as a \\udXXX escape; two that
# happen to form a pair arrive as one valid character)
LONE = st.tuples(st.text(max_size=4), st.characters(categories=["Cs"]),
                 st.text(max_size=4)).map("".join)
TEXT = st.text(max_size=12) | LONE


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    port = FreePort("127.0.0.1:")
    s = Stack(MODEL_DIR, DEMO_ADAPTERS, tmp_path_factory.mktemp("fuzz"),
              router_args=["--http-listen", port])
    s.http = f"http://127.0.0.1:{port}"
    with grpc.insecure_channel(s.router.addr) as ch:
        s.stub = router_pb2_grpc.GenerationServiceStub(ch)
        yield s
    for service in s.services:
        assert health_status(service.addr) == SERVING, service.name       # after it all
    assert all(code == 0 for code in s.terminate())




def grpc_requests(wild: bool):
    """GenerateRequests: plausible field values (most reach the worker and run); wild: each
    field now and then any value of its type (NaN, the infinities, the largest integers, any
    text), so that refusals of every field and their combinations are reached."""
    pick = (lambda plausible, anything: st.one_of(plausible, plausible, anything) if wild
            else plausible)
    sampling = st.builds(
        common_pb2.SamplingParams, temperature=pick(st.floats(0, 2), F32),
        top_k=pick(st.integers(0, 50), U32), top_p=pick(st.floats(0, 1), F32), seed=U64,
        repetition_penalty=pick(st.floats(0.5, 2) | st.just(0.0), F32),
        presence_penalty=pick(st.floats(-2, 2), F32),
        frequency_penalty=pick(st.floats(-2, 2), F32),
        logit_bias=st.dictionaries(pick(st.integers(0, 1023), st.integers(0, 1100) | U32),
                                   pick(st.floats(-100, 100), F32), max_size=4))
    stopping = st.builds(
        common_pb2.StoppingCriteria, max_new_tokens=pick(st.integers(1, 4), SMALL_TOKENS),
        stop_sequences=st.lists(st.text(max_size=4), max_size=3),
        time_limit_ms=pick(st.just(0) | st.integers(1, 3000), st.integers(0, 3000) | U32),
        ignore_eos=st.booleans(), min_new_tokens=pick(st.integers(0, 1), st.integers(0, 6) | U32))
    messages = st.lists(st.builds(
        common_pb2.ChatMessage, role=pick(st.sampled_from(["system", "user", "assistant"]),
                                          st.text(max_size=6)),
        content=st.text(max_size=30)), max_size=3)
    prompt = pick(st.lists(st.integers(0, 1023), min_size=1, max_size=8),
                  st.lists(st.integers(0, 1100) | U32, max_size=8))
    return st.builds(
        rpb.GenerateRequest, adapter_id=pick(st.sampled_from(["", "pirate", "poet"]), NAMES),
        text=pick(st.just(""), st.text(max_size=40)), prompt_token_ids=prompt,
        sampling=sampling, stopping=stopping, request_id=st.text(max_size=10),
        messages=pick(st.just([]), messages),
        response=st.builds(common_pb2.ResponseOptions, token_logprobs=st.booleans(),
                           top_n_tokens=pick(st.integers(0, 5), st.integers(0, 25) | U32),
                           prompt_logprobs=st.booleans()))


@FUZZ
@given(req=grpc_requests(False) | grpc_requests(True))
def test_grpc_generate_answers_or_refuses(stack, req):
    try:
        stack.stub.Generate(req, timeout=30)
        event("OK")                 # --hypothesis-show-statistics: how the answers spread
    except grpc.RpcError as err:
        event(err.code().name)
        assert err.code() in GRPC_OK, (err.code(), err.details(), req)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False)
    | TEXT,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6) | LONE,
                                                                 inner, max_size=3),
    max_leaves=6)
# values that run quickly when accepted: few tokens and choices, or refused
QUICK = {"max_tokens": SMALL_TOKENS | json_values, "max_completion_tokens": SMALL_TOKENS,
         "n": st.integers(-1, 3) | json_values, "min_tokens": st.integers(0, 4) | json_values,
         "model": NAMES | LONE | json_values, "best_of": st.integers(0, 2) | json_values,
         "prompt": st.text(max_size=30) | LONE | st.lists(st.integers(0, 1100), max_size=6)
         | json_values,
         "messages": st.lists(st.fixed_dictionaries(
             {"role": st.sampled_from(["system", "user", "assistant"]) | json_values,
              "content": st.text(max_size=20) | LONE | json_values}), max_size=3)
         | json_values}


# plausible values of the fields: most bodies built of them are accepted and run
PLAUSIBLE = {
    "temperature": st.floats(0, 2), "top_p": st.floats(0, 1), "seed": st.integers(0, 2**63),
    "stop": st.text(max_size=4) | LONE | st.lists(st.text(max_size=4) | LONE, max_size=4),
    "presence_penalty": st.floats(-2, 2), "frequency_penalty": st.floats(-2, 2),
    "logit_bias": st.dictionaries(st.integers(0, 1023).map(str), st.floats(-100, 100),
                                  max_size=3),
    "top_logprobs": st.integers(0, 5),
    "echo": st.booleans(), "stream": st.booleans(), "ignore_eos": st.booleans(),
    "top_k": st.integers(0, 50), "repetition_penalty": st.floats(0.5, 2),
    "min_tokens": st.integers(0, 4), "max_tokens": st.integers(1, 4),
    "max_completion_tokens": st.integers(1, 4), "n": st.integers(1, 3),
    "user": st.text(max_size=8),
}
LOGPROBS = {False: st.integers(0, 5), True: st.booleans()}     # completions', chat's
MODELS = st.sampled_from(["pirate", "poet", "tiny-llama"])
PROMPTS = (st.text(min_size=1, max_size=30) | LONE
           | st.lists(st.integers(0, 1023), min_size=1, max_size=6))
CHAT_MESSAGES = st.lists(st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant"]),
     "content": st.text(max_size=20) | LONE}), min_size=1, max_size=3)


def bodies(keys: set[str], chat: bool):
    """A JSON body: a plausible one (the endpoint's required keys, some others with plausible
    values), one with one key set to any JSON value, or anything at all (some of the endpoint's
    keys with quick or arbitrary values, unknown keys; now and then not an object)."""
    needed = {"model": MODELS, **({"messages": CHAT_MESSAGES} if chat else {"prompt": PROMPTS})}
    clean = st.fixed_dictionaries(needed, optional={
        **{k: v for k, v in PLAUSIBLE.items() if k in keys}, "logprobs": LOGPROBS[chat]})
    one_wild = st.tuples(clean, st.sampled_from(sorted(keys)) | st.text(max_size=8),
                         json_values).map(lambda t: {**t[0], t[1]: t[2]})
    known = st.dictionaries(st.sampled_from(sorted(keys)), json_values, max_size=6)
    fixed = st.fixed_dictionaries({}, optional={k: v for k, v in QUICK.items() if k in keys})
    unknown = st.dictionaries(st.text(max_size=8), json_values, max_size=2)
    wild = st.tuples(known, fixed, unknown | st.just({})).map(
        lambda parts: {**parts[2], **parts[0], **parts[1]})
    return clean | one_wild | wild | json_values


def post(url: str, body) -> tuple[int, bytes]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


def check_http(status: int, data: bytes, body) -> None:
    event(str(status))
    assert status in (200, 400, 401, 404, 429, 431), (status, data[:500], body)
    if status == 200:
        assert b"server_error" not in data and b'"INTERNAL"' not in data, (data[:500], body)
        return
    error = json.loads(data)["error"]
    assert {"type", "param", "code", "message"} <= set(error), (error, body)
    assert error["type"] != "server_error", (error, body)


@FUZZ
@given(body=bodies(set(SAMPLING) | COMPLETIONS, chat=False))
def test_http_completions_answer_or_refuse(stack, body):
    check_http(*post(f"{stack.http}/v1/completions", body), body)


@FUZZ
@given(body=bodies(set(SAMPLING) | CHAT, chat=True))
@example(body={"model": "pirate", "messages": [{"role": "user", "content": "hi"}],
               "parallel_tool_calls": []})           # found here: was a KeyError, a 500
def test_http_chat_completions_answer_or_refuse(stack, body):
    check_http(*post(f"{stack.http}/v1/chat/completions", body), body)


# header values the HTTP parser takes as they are (printable ASCII), of every size around
# aiohttp's 8190-byte line limit; names of headers the gateway reads and of others
HEADER_VALUES = (st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7e), max_size=20)
                 | st.integers(0, 20_000).map(lambda n: "x" * n))
HEADERS = st.dictionaries(
    st.sampled_from(["Authorization", "X-Pad", "Cookie", "User-Agent", "Accept"])
    | st.from_regex(r"X-[A-Za-z]{1,8}", fullmatch=True),
    st.tuples(st.sampled_from(["", "Bearer ", "Bearer dev", "Basic "]), HEADER_VALUES).map(
        "".join), max_size=6)
MANY = st.integers(0, 200).map(lambda n: {f"X-H{i}": "v" for i in range(n)})


@FUZZ
@given(headers=HEADERS | MANY, chat=st.booleans())
def test_http_headers_answer_or_refuse(stack, headers, chat):
    """Over-long and too many headers: a JSON refusal (431, or 401 for a token no tenant
    has), never aiohttp's plain text, and nothing in the router's log with a traceback."""
    conn = http.client.HTTPConnection(stack.http.split("//")[1], timeout=60)
    body = {"model": "pirate", "max_tokens": 1,
            **({"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "hi"})}
    try:
        conn.request("POST", "/v1/chat/completions" if chat else "/v1/completions",
                     body=json.dumps(body), headers={"Content-Type": "application/json",
                                                     **headers})
        resp = conn.getresponse()
        status, data = resp.status, resp.read()
    finally:
        conn.close()
    check_http(status, data, headers)
    log = stack.router.log()
    assert "Traceback" not in log and "LineTooLong" not in log, log[-2000:]
