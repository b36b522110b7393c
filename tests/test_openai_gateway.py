"""The OpenAI-compatible HTTP gateway on the router, through running services: the same
tokens as the gRPC API, SSE streaming, chat, models, and errors as HTTP statuses."""
from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

from services.client.client import LorafleetClient
from tests.conftest import Stack
from tests.support import DEMO_ADAPTERS, MODEL_DIR, free_port

pytestmark = pytest.mark.slow
PROMPT = "Tell me about the weather."


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    port = free_port()
    stack = Stack(MODEL_DIR, DEMO_ADAPTERS, tmp_path_factory.mktemp("gw"),
                  router_args=["--http-listen", f"127.0.0.1:{port}"])
    yield stack, f"http://127.0.0.1:{port}"
    stack.terminate()


def post(url: str, body: dict, token: str | None = None):
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json",
                                          **({"Authorization": f"Bearer {token}"} if token
                                             else {})})
    return urllib.request.urlopen(req, timeout=60)


def test_models_lists_the_base_and_the_adapters(gateway):
    _, base = gateway
    data = json.load(urllib.request.urlopen(f"{base}/v1/models", timeout=30))["data"]
    ids = {m["id"] for m in data}
    assert {"pirate", "poet", "acme-support", "tiny-llama"} <= ids


def test_completion_equals_the_grpc_answer(gateway):
    stack, base = gateway
    with LorafleetClient(stack.router.addr) as c:
        expected = c.generate(PROMPT, adapter="pirate", max_new_tokens=16)
    body = json.load(post(f"{base}/v1/completions", {"model": "pirate", "prompt": PROMPT,
                                                      "max_tokens": 16, "temperature": 0}))
    assert body["object"] == "text_completion"
    assert body["choices"][0]["text"] == expected.text
    assert body["usage"]["completion_tokens"] == len(expected.token_ids)
    assert body["choices"][0]["finish_reason"] in ("length", "stop")


def test_streaming_sse_concatenates_to_the_same_text(gateway):
    _, base = gateway
    whole = json.load(post(f"{base}/v1/completions", {"model": "poet", "prompt": PROMPT,
                                                       "max_tokens": 12, "temperature": 0}))
    events = post(f"{base}/v1/completions", {"model": "poet", "prompt": PROMPT,
                                              "max_tokens": 12, "temperature": 0,
                                              "stream": True}).read().decode().split("\n\n")
    data = [e[len("data: "):] for e in events if e.startswith("data: ")]
    assert data[-1] == "[DONE]"
    chunks = [json.loads(d) for d in data[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["choices"][0]["text"]
    assert chunks[-1]["choices"][0]["finish_reason"] in ("length", "stop")


def test_chat_completion_and_chat_stream(gateway):
    _, base = gateway
    msgs = [{"role": "user", "content": "Hello!"}]
    body = json.load(post(f"{base}/v1/chat/completions",
                          {"model": "acme-support", "messages": msgs, "max_tokens": 10,
                           "temperature": 0}))
    text = body["choices"][0]["message"]["content"]
    assert body["object"] == "chat.completion" and text
    raw = post(f"{base}/v1/chat/completions", {"model": "acme-support", "messages": msgs,
                                               "max_tokens": 10, "temperature": 0,
                                               "stream": True}).read().decode()
    chunks = [json.loads(e[6:]) for e in raw.split("\n\n") if e.startswith("data: {")]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant"}
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == text


@pytest.mark.parametrize("body,status", [
    ({"model": "no-such-adapter", "prompt": "x"}, 404),
    ({"model": "pirate", "prompt": "x", "temperature": -1}, 400),
    ({"model": "pirate", "prompt": "x", "n": 2}, 400),
    ({"model": "pirate", "prompt": {"not": "a prompt"}}, 400),
])
def test_errors_are_http_statuses(gateway, body, status):
    _, base = gateway
    with pytest.raises(urllib.error.HTTPError) as err:
        post(f"{base}/v1/completions", body)
    assert err.value.code == status
    assert json.load(err.value)["error"]["message"]
