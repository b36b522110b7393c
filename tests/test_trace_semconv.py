"""The services' spans carry OpenTelemetry's semantic conventions, read back from the shared
observed stack's --trace-file output (tests/observed.py): RPC (`rpc.system`, `rpc.service`,
`rpc.method`, `rpc.grpc.status_code`) on router, worker and store spans, GenAI
(`gen_ai.operation.name`, `gen_ai.request.model`, `gen_ai.response.finish_reasons`,
`gen_ai.usage.input_tokens`, `gen_ai.usage.output_tokens`) on the generation spans."""
from __future__ import annotations

import pytest

from tests.test_tracing import Trace, read_spans, wait_for_span

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def spans(observed):
    files = observed.traces.values()
    wait_for_span(files, lambda s: s["name"] == "worker.generate")
    return read_spans(files)


def named(spans, name):
    return [s for s in spans if s["name"] == name]


def test_generation_spans_carry_the_genai_and_rpc_conventions(spans):
    routed = [s for s in named(spans, "router.generate")
              if s["attributes"].get("lora.adapter_id") == "pirate"]
    assert routed
    for root in routed:
        a = root["attributes"]
        assert a["rpc.system"] == "grpc" and a["rpc.service"] == "lorafleet.v1.GenerationService"
        assert a["rpc.method"] in ("Generate", "GenerateStream")
        assert a["rpc.grpc.status_code"] == 0
        assert a["gen_ai.operation.name"] == "text_completion"
        assert a["gen_ai.request.model"] == "pirate"
        assert a["gen_ai.response.finish_reasons"][0] in ("stop", "length")
        assert a["gen_ai.usage.input_tokens"] > 0 and a["gen_ai.usage.output_tokens"] > 0
        trace = Trace(spans, root["trace_id"])
        (worker,) = trace.named("worker.generate")
        assert trace.parent(worker) is root
        w = worker["attributes"]
        assert (w["rpc.service"], w["rpc.method"], w["rpc.grpc.status_code"]) == (
            "lorafleet.v1.Worker", "Generate", 0)
        for key in ("gen_ai.request.model", "gen_ai.operation.name", "gen_ai.usage.input_tokens",
                    "gen_ai.usage.output_tokens", "gen_ai.response.finish_reasons"):
            assert w[key] == a[key], key
    methods = {s["attributes"]["rpc.method"] for s in named(spans, "router.generate")}
    assert methods == {"Generate", "GenerateStream"}
    base = [s for s in named(spans, "router.generate") if not s["attributes"]["lora.adapter_id"]]
    assert base and base[0]["attributes"]["gen_ai.request.model"] == "base"


def test_a_refusal_carries_its_status_code(spans):
    refused = [s for s in named(spans, "router.generate")
               if s["attributes"].get("lora.adapter_id") == "no-such-adapter"]
    assert len(refused) == 1
    a = refused[0]["attributes"]
    assert a["rpc.grpc.status_code"] == 5                          # NOT_FOUND
    assert "gen_ai.usage.output_tokens" not in a


def test_store_fetches_carry_the_rpc_conventions(spans):
    fetches = named(spans, "store.fetch")
    assert len(fetches) == 3                                      # one a staged adapter
    for f in fetches:
        a = f["attributes"]
        assert (a["rpc.system"], a["rpc.service"], a["rpc.method"], a["rpc.grpc.status_code"]) \
            == ("grpc", "lorafleet.v1.AdapterStore", "Fetch", 0)
        assert f["service"] == "adapter-store"
