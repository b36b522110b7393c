"""The OpenAI-compatible HTTP gateway on the router, through running services: the same
tokens as the gRPC API, SSE streaming, chat, models, and errors as HTTP statuses."""
from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

from services.client.client import LorafleetClient
from tests.conftest import Stack
from tests.support import DEMO_ADAPTERS, FreePort, MODEL_DIR
pytestmark = pytest.mark.slow
PROMPT = "Tell me about the weather."


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    port = FreePort("127.0.0.1:")
    stack = Stack(MODEL_DIR, DEMO_ADAPTERS, tmp_path_factory.mktemp("gw"),
                  router_args=["--http-listen", port])
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


@pytest.mark.parametrize("body,status,field", [
    ({"model": "no-such-adapter", "prompt": "x"}, 404, None),
    ({"model": "pirate", "prompt": "x", "temperature": -1}, 400, "temperature"),
    ({"model": "pirate", "prompt": "x", "n": 0}, 400, "n"),
    ({"model": "pirate", "prompt": {"not": "a prompt"}}, 400, "prompt"),
    # wrong types and out-of-range numbers: 400 with the field's name, never a 500
    ({"model": "pirate", "prompt": "x", "max_tokens": -1}, 400, "max_tokens"),
    ({"model": "pirate", "prompt": "x", "max_tokens": 1 << 32}, 400, "max_tokens"),
    ({"model": "pirate", "prompt": "x", "max_tokens": 2.7}, 400, "max_tokens"),
    ({"model": "pirate", "prompt": "x", "max_tokens": "3"}, 400, "max_tokens"),
    ({"model": "pirate", "prompt": "x", "top_k": -1}, 400, "top_k"),
    ({"model": "pirate", "prompt": "x", "temperature": True}, 400, "temperature"),
    ({"model": "pirate", "prompt": [1, -2, 3]}, 400, "prompt"),
    ({"model": "pirate", "prompt": [1, 1 << 33]}, 400, "prompt"),
    ({"model": "pirate", "prompt": [True, False]}, 400, "prompt"),
    ({"model": "pirate", "prompt": "x", "stop": 5}, 400, "stop"),
    ({"model": "pirate", "prompt": "x", "stop": {"a": 1}}, 400, "stop"),
    ({"model": "pirate", "prompt": "x", "stream": "false"}, 400, "stream"),
    # refused past the gateway (the servicers' checks): named by the body's key, not the
    # GenerateRequest field (sampling.temperature, stopping.stop_sequences, ...)
    ({"model": "pirate", "prompt": "x", "temperature": 5000}, 400, "temperature:"),
    ({"model": "pirate", "prompt": "x", "top_p": 2}, 400, "top_p:"),
    ({"model": "pirate", "prompt": "x", "stop": ["s"] * 17}, 400, "stop:"),
    ({"model": "pirate", "prompt": ""}, 400, "prompt:"),
    ({"model": "pirate", "prompt": "x", "max_tokens": 1 << 20}, 400, "max_tokens:"),
])
def test_errors_are_http_statuses(gateway, body, status, field):
    _, base = gateway
    with pytest.raises(urllib.error.HTTPError) as err:
        post(f"{base}/v1/completions", body)
    assert err.value.code == status
    assert err.value.headers["Content-Type"].startswith("application/json")
    message = json.load(err.value)["error"]["message"]
    assert message and (field is None or message.startswith(field)), message


def test_malformed_bodies_and_routes_get_json_errors(gateway):
    _, base = gateway
    deep = b"[" * 100000 + b"]" * 100000
    cases = [(urllib.request.Request(f"{base}/v1/completions", data=deep, method="POST"), 400),
             (urllib.request.Request(f"{base}/v1/chat/completions", method="POST", data=json.dumps(
                 {"model": "pirate", "messages": [{"role": "user", "content": 5}]}).encode()),
              400),
             (urllib.request.Request(f"{base}/v1/embeddings", data=b"{}", method="POST"), 404),
             (urllib.request.Request(f"{base}/v1/completions"), 405),
             (urllib.request.Request(f"{base}/v1/models/no-such-model"), 404)]
    for req, status in cases:
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(req, timeout=30)
        assert err.value.code == status, req.full_url
        assert json.load(err.value)["error"]["message"]


def test_one_model_by_id(gateway):
    _, base = gateway
    m = json.load(urllib.request.urlopen(f"{base}/v1/models/pirate", timeout=30))
    assert m["id"] == "pirate" and m["parent"] == "tiny-llama"
    assert json.load(urllib.request.urlopen(f"{base}/v1/models/base", timeout=30))["id"] == \
        "tiny-llama"


def chat(base, messages, **extra):
    return json.load(post(f"{base}/v1/chat/completions",
                          {"model": "acme-support", "messages": messages, "temperature": 0,
                           **extra}))


def test_stream_ends_with_usage_when_asked(gateway):
    _, base = gateway
    body = {"model": "poet", "prompt": PROMPT, "max_tokens": 5, "temperature": 0}
    whole = json.load(post(f"{base}/v1/completions", body))
    raw = post(f"{base}/v1/completions", {**body, "stream": True,
                                          "stream_options": {"include_usage": True}})
    events = [json.loads(e[6:]) for e in raw.read().decode().split("\n\n")
              if e.startswith("data: {")]
    assert events[-1]["choices"] == [] and events[-1]["usage"] == whole["usage"]
    assert all("usage" not in e for e in events[:-1])


def test_chat_caps_with_max_completion_tokens(gateway):
    _, base = gateway
    msgs = [{"role": "user", "content": "Hello!"}]
    for key in ("max_completion_tokens", "max_tokens"):
        body = chat(base, msgs, **{key: 3})
        n, finish = body["usage"]["completion_tokens"], body["choices"][0]["finish_reason"]
        assert n == 3 and finish == "length" or n < 3 and finish == "stop", (key, body)


def test_chat_content_as_text_parts_is_the_same_prompt(gateway):
    _, base = gateway
    plain = chat(base, [{"role": "user", "content": "Hello!"}], max_tokens=6)
    parts = chat(base, [{"role": "user", "content": [{"type": "text", "text": "Hel"},
                                                      {"type": "text", "text": "lo!"}]}],
                 max_tokens=6)
    assert parts["usage"] == plain["usage"]
    assert parts["choices"][0]["message"] == plain["choices"][0]["message"]
    with pytest.raises(urllib.error.HTTPError) as err:
        chat(base, [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}])
    assert err.value.code == 400


def test_base_model_name_is_known_with_a_tenants_file(tmp_path):
    """With --tenants the gateway still learns the served model's name (its lookup needs no
    caller), so `model: <base name>` runs the base model. (And ModelInfo's largest rank is the
    store's --max-rank.)"""
    port = FreePort("127.0.0.1:")
    tenants = tmp_path / "tenants.json"
    tenants.write_text(json.dumps({"tenants": {"acme": {"tokens": ["tok-acme"]}}}))
    stack = Stack(MODEL_DIR, DEMO_ADAPTERS, tmp_path, store_args=["--max-rank", "256"],
                  router_args=["--http-listen", port, "--tenants", str(tenants),
                               "--insecure-internal"])
    try:
        with LorafleetClient(stack.router.addr, "tok-acme") as c:
            info = c.model_info()
        assert (info.model_name, info.max_lora_rank) == ("tiny-llama", 256)
        url = f"http://127.0.0.1:{port}"
        body = json.load(post(f"{url}/v1/completions", {"model": "tiny-llama", "prompt": "x",
                                                         "max_tokens": 2}, token="tok-acme"))
        assert body["model"] == "tiny-llama"
        req = urllib.request.Request(f"{url}/v1/models",
                                     headers={"Authorization": "Bearer tok-acme"})
        assert json.load(urllib.request.urlopen(req, timeout=30))["data"][0]["id"] == \
            "tiny-llama"
    finally:
        stack.terminate()
