"""The OpenAI-compatible gateway as the official `openai` SDK speaks to it, through running
services: chats rendered with the checkpoint's own chat template (token for token what
transformers' apply_chat_template + PEFT generate give), every field honoured or refused with
a 400 naming it, OpenAI's error types, /health, /tokenize and /detokenize."""
from __future__ import annotations

import json
import urllib.error
import urllib.request

import openai
import pytest
import torch

from services.client.client import LorafleetClient
from tests.conftest import Stack
from tests.support import DEMO_ADAPTERS, FreePort, MODEL_DIR
pytestmark = pytest.mark.slow
CHAT = [{"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Hello! How are you?"},
        {"role": "assistant", "content": "Fine, thank you."},
        {"role": "user", "content": "Tell me about the weather."}]


METRICS, WORKER_METRICS = FreePort(), FreePort()   # picked at each start


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    port = FreePort("127.0.0.1:")
    stack = Stack(MODEL_DIR, DEMO_ADAPTERS, tmp_path_factory.mktemp("api"),
                  router_args=["--http-listen", port,
                               "--metrics-port", METRICS],
                  worker_args=["--metrics-port", WORKER_METRICS])
    yield stack, f"http://127.0.0.1:{port}"
    stack.terminate()


def requests_by_status() -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{METRICS}/metrics", timeout=10).read()
    out: dict[str, float] = {}
    for line in text.decode().splitlines():
        if line.startswith("lorafleet_router_requests_total{"):
            status = line.split('status="', 1)[1].split('"', 1)[0]
            out[status] = out.get(status, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


@pytest.fixture(scope="module")
def sdk(gateway):
    return openai.OpenAI(base_url=gateway[1] + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def hf(hf_tiny):
    return hf_tiny


def peft_greedy(base, adapter: str, ids: list[int], n: int) -> list[int]:
    from peft import PeftModel
    model = PeftModel.from_pretrained(base, DEMO_ADAPTERS / adapter).eval() if adapter else base
    try:
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False,
                                 eos_token_id=None, pad_token_id=0)
        return out[0, len(ids):].tolist()
    finally:
        if adapter:
            model.unload()


def test_the_tiny_model_ships_a_chat_template_and_model_info_says_so(gateway, hf):
    stack, _ = gateway
    tok, _ = hf
    assert tok.chat_template and "<|assistant|>" in tok.chat_template
    with LorafleetClient(stack.router.addr) as c:
        assert c.model_info().has_chat_template


@pytest.mark.parametrize("adapter", ["acme-support", ""])
def test_chat_is_rendered_with_the_template_token_for_token(gateway, sdk, hf, adapter):
    """The worker renders the chat as apply_chat_template(add_generation_prompt=True) does
    and the reply is the one PEFT's greedy generate gives on those very ids."""
    stack, _ = gateway
    tok, model = hf
    ids = list(tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True,
                                       return_dict=False))
    expected = peft_greedy(model, adapter, ids, 12)
    with LorafleetClient(stack.router.addr) as c:
        assert list(c.tokenize(messages=CHAT).token_ids) == ids
        got = c.generate(messages=CHAT, adapter=adapter, max_new_tokens=12, ignore_eos=True)
    assert list(got.token_ids) == expected and got.usage.prompt_tokens == len(ids)
    resp = sdk.chat.completions.create(model=adapter or "tiny-llama", messages=CHAT,
                                       max_tokens=12, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert resp.choices[0].message.content == got.text
    assert resp.usage.prompt_tokens == len(ids) and resp.usage.completion_tokens == 12
    assert resp.choices[0].finish_reason == "length"


def test_streaming_chat_with_usage_through_the_sdk(sdk):
    whole = sdk.chat.completions.create(model="acme-support", messages=CHAT, max_tokens=8,
                                        temperature=0)
    chunks = list(sdk.chat.completions.create(model="acme-support", messages=CHAT,
                                              max_tokens=8, temperature=0, stream=True,
                                              stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == whole.usage.total_tokens


def test_streamed_http_requests_count_as_ok_not_cancelled(sdk):
    """A stream the gateway read to its last message is a success in the router's request
    counts (it was counted CANCELLED: the gateway stopped reading at the last message)."""
    before = requests_by_status()
    for _ in range(3):
        list(sdk.chat.completions.create(model="poet", messages=CHAT, max_tokens=4,
                                         stream=True))
        list(sdk.completions.create(model="poet", prompt="Hello!", max_tokens=4, stream=True))
    after = requests_by_status()
    assert after.get("OK", 0) - before.get("OK", 0) == 6, (before, after)
    assert after.get("CANCELLED", 0) == before.get("CANCELLED", 0)


def test_completions_through_the_sdk_match_grpc(gateway, sdk):
    stack, _ = gateway
    with LorafleetClient(stack.router.addr) as c:
        expected = c.generate("Tell me about the weather.", adapter="pirate", max_new_tokens=10)
    resp = sdk.completions.create(model="pirate", prompt="Tell me about the weather.",
                                  max_tokens=10, temperature=0)
    assert resp.choices[0].text == expected.text


@pytest.mark.parametrize("field,value", [
    ("functions", [{"name": "f", "parameters": {}}]), ("function_call", "auto"),
    ("modalities", ["text", "audio"]), ("store", True),
    ("reasoning_effort", "low"), ("not_an_openai_field", 1),
])
def test_chat_fields_not_honoured_are_refused_by_name(sdk, field, value):
    with pytest.raises(openai.BadRequestError) as err:
        sdk.chat.completions.create(model="acme-support", messages=CHAT, max_tokens=4,
                                    extra_body={field: value})
    e = err.value.body
    assert e["type"] == "invalid_request_error" and e["param"] == field, e
    assert e["code"] in ("unsupported_parameter", "unsupported_value", "unknown_parameter"), e


@pytest.mark.parametrize("field,value", [
    ("suffix", "x"), ("best_of", 3), ("metadata", {"a": "b"}),
])
def test_completion_fields_not_honoured_are_refused_by_name(sdk, field, value):
    with pytest.raises(openai.BadRequestError) as err:
        sdk.completions.create(model="pirate", prompt="x", max_tokens=4,
                               extra_body={field: value})
    assert err.value.body["param"] == field, err.value.body


def test_fields_left_at_their_off_values_are_accepted(sdk):
    """What clients send by default (nulls, zero penalties, n=1, text format, no tools) is
    not refused."""
    resp = sdk.chat.completions.create(
        model="acme-support", messages=CHAT, max_tokens=3, temperature=0, n=1,
        presence_penalty=0, frequency_penalty=0.0, logit_bias={}, logprobs=False,
        response_format={"type": "text"}, tool_choice="none", user="u-1",
        metadata={"k": "v"}, service_tier="auto", parallel_tool_calls=False)
    assert resp.choices[0].message.content is not None


def test_tools_on_a_template_that_renders_none_are_refused_naming_tools(sdk):
    """The tiny model's template renders no tools (ModelInfo.tool_call_format ""): a call
    could be neither prompted nor parsed. (tool_choice none still passes: see above.)"""
    with pytest.raises(openai.BadRequestError) as err:
        sdk.chat.completions.create(model="acme-support", messages=CHAT, max_tokens=4,
                                    tools=[{"type": "function", "function": {"name": "f"}}])
    assert err.value.body["param"] == "tools", err.value.body


@pytest.mark.parametrize("body,param,code", [
    ({"temperature": 2.5}, "temperature", "invalid_value"),
    ({"presence_penalty": 2.5}, "presence_penalty", "invalid_value"),
    ({"logit_bias": {"x": 1}}, "logit_bias", "invalid_value"),
    ({"logit_bias": {"5": 101}}, "logit_bias", "invalid_value"),
    ({"top_logprobs": 21, "logprobs": True}, "top_logprobs", "invalid_value"),
    ({"min_tokens": -1}, "min_tokens", "invalid_value"),
    ({"n": 0}, "n", "invalid_value"), ({"n": 17}, "n", "invalid_value"),
    ({"temperature": "hot"}, "temperature", "invalid_type"),
    ({"top_p": 1.5}, "top_p", "invalid_value"),
    ({"max_tokens": 0}, "max_tokens", "invalid_value"),
    ({"max_tokens": 100000}, "max_tokens", "invalid_value"),
    ({"model": 5}, "model", "invalid_type"),
    ({"messages": [{"role": "function", "content": "x"}]}, "messages[0].role",
     "unsupported_value"),
    ({"messages": [{"role": {"a": 1}, "content": "x"}]}, "messages[0]", "invalid_type"),
    ({"stream_options": {"include_usage": True}}, "stream_options", "invalid_value"),
])
def test_out_of_range_and_wrong_types_name_their_param(gateway, body, param, code):
    _, base = gateway
    full = {"model": "acme-support", "messages": CHAT, **body}
    req = urllib.request.Request(f"{base}/v1/chat/completions", data=json.dumps(full).encode(),
                                 method="POST", headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(req, timeout=30)
    assert err.value.code == 400
    e = json.load(err.value)["error"]
    assert (e["type"], e["param"], e["code"]) == ("invalid_request_error", param, code), e


def test_a_template_refusal_is_a_400(sdk):
    """The tiny model's template refuses a chat that opens with the assistant."""
    with pytest.raises(openai.BadRequestError) as err:
        sdk.chat.completions.create(model="acme-support", max_tokens=3,
                                    messages=[{"role": "assistant", "content": "hi"}])
    assert "chat template" in err.value.body["message"]


def test_error_types_for_unknown_models_and_context_length(sdk):
    with pytest.raises(openai.NotFoundError) as err:
        sdk.chat.completions.create(model="no-such-adapter", messages=CHAT, max_tokens=3)
    assert (err.value.body["type"], err.value.body["code"]) == ("not_found_error",
                                                                "model_not_found")
    with pytest.raises(openai.BadRequestError) as err:
        sdk.completions.create(model="pirate", prompt="word " * 2000, max_tokens=3)
    assert err.value.body["code"] == "context_length_exceeded", err.value.body


def test_health_tokenize_and_detokenize(gateway, hf):
    _, base = gateway
    tok, _ = hf
    health = json.load(urllib.request.urlopen(f"{base}/health", timeout=30))
    assert health["status"] == "ok" and health["workers"] == 1

    def post(path, body):
        req = urllib.request.Request(base + path, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
        return json.load(urllib.request.urlopen(req, timeout=30))
    text = "Tell me about the weather."
    got = post("/tokenize", {"model": "tiny-llama", "prompt": text})
    assert got["tokens"] == tok(text)["input_ids"] and got["count"] == len(got["tokens"])
    assert got["max_model_len"] > 0
    chat = post("/tokenize", {"model": "tiny-llama", "messages": CHAT})
    assert chat["tokens"] == list(tok.apply_chat_template(CHAT, add_generation_prompt=True,
                                                          tokenize=True, return_dict=False))
    back = post("/detokenize", {"model": "tiny-llama", "tokens": got["tokens"]})
    assert back["prompt"] == tok.decode(got["tokens"])


def test_models_carry_the_base_as_parent(sdk):
    models = {m.id: m for m in sdk.models.list()}
    assert models["pirate"].model_extra["parent"] == "tiny-llama"
    assert models["tiny-llama"].model_extra["parent"] is None


def running_rows() -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{WORKER_METRICS}/metrics",
                                  timeout=10).read().decode()
    return float(next(line.split()[-1] for line in text.splitlines()
                      if line.startswith("vllm:num_requests_running")))


def test_a_client_that_leaves_a_non_stream_request_frees_its_row(gateway):
    """A non-stream completion whose client closes the connection is cancelled down to the
    worker (it generated on to max_tokens before): its row is free well before the whole
    completion would have taken."""
    import socket
    import time
    stack, base = gateway
    with LorafleetClient(stack.router.addr) as c:       # how long the whole one takes
        t0 = time.monotonic()
        c.generate("Hello!", adapter="pirate", max_new_tokens=480, ignore_eos=True)
        whole = time.monotonic() - t0
    host, port = base.removeprefix("http://").split(":")
    body = json.dumps({"model": "pirate", "prompt": "Hello!", "max_tokens": 480,
                       "temperature": 0, "ignore_eos": True}).encode()
    with socket.create_connection((host, int(port))) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                  b"application/json\r\nContent-Length: " + str(len(body)).encode()
                  + b"\r\n\r\n" + body)
        start = time.monotonic()
        while running_rows() == 0 and time.monotonic() < start + 10:
            time.sleep(0.02)
        assert running_rows() == 1                   # it is generating now
    left = time.monotonic()
    while running_rows() and time.monotonic() < left + whole:
        time.sleep(0.02)
    freed = time.monotonic() - left
    assert freed < 0.4 * whole, (freed, whole)       # not generated to its end
