"""OpenTelemetry across router -> worker -> store, read back from each service's --trace-file: one
cold request (an adapter on S3, loaded nowhere yet) is one trace over the three services, with a
`lora.cold_load` span whose children are the store fetch (and under it the S3 get), the worker's
validation of the fetched adapter against its model, and the host-to-device copy, carrying
adapter id, bytes, tier and tenant. The store validates the adapter in full once, at register:
that trace (router -> store) holds `store.validate` over its S3 get."""
from __future__ import annotations

import collections
import json
import time

import pytest

from services.client.client import LorafleetClient
from services.common.gen.lorafleet.v1 import common_pb2
from tests.conftest import Stack
from tests.support import S3_ENV, MotoS3

pytestmark = pytest.mark.slow

BUCKET = "lorafleet-traces"
SERVICES = {"lorafleet-router", "lorafleet-worker", "adapter-store"}


def upload(s3, prefix: str, folder) -> None:
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        s3.put_object(Bucket=BUCKET, Key=f"{prefix}/{name}", Body=(folder / name).read_bytes())


def read_spans(files) -> list[dict]:
    spans = []
    for path in files:
        if path.exists():
            spans += [json.loads(line) for line in path.read_text().splitlines() if line]
    return spans


def wait_for_span(files, predicate, timeout: float = 10.0) -> list[dict]:
    """All spans, once one satisfying predicate has been written (spans end after replies)."""
    end = time.monotonic() + timeout
    while True:
        spans = read_spans(files)
        if any(predicate(s) for s in spans) or time.monotonic() > end:
            return spans
        time.sleep(0.1)


class Trace:
    """The spans of one trace id, as a tree."""

    def __init__(self, spans: list[dict], trace_id: str):
        self.spans = [s for s in spans if s["trace_id"] == trace_id]
        self.children = collections.defaultdict(list)
        for s in self.spans:
            self.children[s["parent_id"]].append(s)

    def named(self, name: str) -> list[dict]:
        return [s for s in self.spans if s["name"] == name]

    def one(self, name: str) -> dict:
        found = self.named(name)
        assert len(found) == 1, (name, [s["name"] for s in self.spans])
        return found[0]

    def parent(self, span: dict) -> dict | None:
        return next((s for s in self.spans if s["span_id"] == span["parent_id"]), None)

    def descendants(self, span: dict) -> list[dict]:
        out, todo = [], list(self.children[span["span_id"]])
        while todo:
            s = todo.pop()
            out.append(s)
            todo += self.children[s["span_id"]]
        return out

    def render(self, span: dict | None = None, depth: int = 0) -> str:
        roots = [span] if span else [s for s in self.spans if self.parent(s) is None]
        lines = []
        for s in sorted(roots, key=lambda s: s["start_ns"]):
            ms = (s["end_ns"] - s["start_ns"]) / 1e6
            lines.append(f"{'  ' * depth}{s['name']} [{s['service']}] {ms:.1f} ms")
            lines += [self.render(c, depth + 1) for c in
                      sorted(self.children[s["span_id"]], key=lambda c: c["start_ns"])]
        return "\n".join(x for x in lines if x)


@pytest.fixture(scope="module")
def moto(tmp_path_factory):
    server = MotoS3(tmp_path_factory.mktemp("moto"))
    server.client().create_bucket(Bucket=BUCKET)
    yield server
    server.stop()


def test_cold_request_is_one_trace_across_the_services(lora_fleet, moto, tmp_path):
    base, adapters = lora_fleet
    files = {n: tmp_path / f"{n}-spans.jsonl" for n in ("router", "worker", "store")}
    upload(moto.client(), "acme/cold", adapters / "a10")
    stack = Stack(base, adapters, tmp_path, env=S3_ENV,
                  store_args=["--s3-endpoint", moto.endpoint, "--trace-file", str(files["store"])],
                  worker_args=["--trace-file", str(files["worker"])],
                  router_args=["--trace-file", str(files["router"])])
    try:
        with LorafleetClient(stack.router.addr, token="acme", timeout=60) as c:
            info = c.register("acme-cold", f"s3://{BUCKET}/acme/cold", tenant="acme")
            resp = c.generate(adapter="acme-cold", prompt_ids=[4, 5, 6], max_new_tokens=4)
        assert resp.timings.adapter_tier == common_pb2.SOURCE and resp.timings.cold_load_s > 0
        wait_for_span(files.values(), lambda s: s["name"] == "worker.generate")
        spans = wait_for_span(files.values(), lambda s: s["name"] == "router.generate")
    finally:
        assert all(code == 0 for code in stack.terminate())

    root = next(s for s in spans if s["name"] == "router.generate")
    assert root["attributes"]["lora.adapter_id"] == "acme-cold"
    assert root["attributes"]["gen_ai.usage.output_tokens"] == 4
    trace = Trace(spans, root["trace_id"])
    print("\ncold request trace:\n" + trace.render())
    assert {s["service"] for s in trace.spans} == SERVICES
    assert trace.parent(trace.one("worker.generate")) is root

    cold = trace.one("lora.cold_load")
    attrs = cold["attributes"]
    assert attrs["lora.adapter_id"] == "acme-cold" and attrs["lora.tenant"] == "acme"
    assert attrs["lora.tier"] == "SOURCE" and attrs["lora.bytes"] > 0
    assert attrs["lora.version"] == info.version
    below = trace.descendants(cold)
    names = {s["name"] for s in below}
    assert {"lora.store_fetch", "store.fetch", "s3.get", "lora.host_to_device"} <= names, names
    fetch = trace.one("store.fetch")
    assert trace.parent(fetch)["name"] == "lora.store_fetch"
    assert fetch["attributes"]["lora.tier"] == "SOURCE"
    assert fetch["attributes"]["lora.bytes"] == info.bytes
    gets = trace.named("s3.get")                 # adapter_config.json and the weights
    assert len(gets) == 2 and all(trace.parent(g) is fetch for g in gets)
    assert trace.parent(trace.one("store.verify")) is fetch      # the digest check
    assert sum(g["attributes"]["lora.bytes"] for g in gets) > info.bytes
    assert trace.parent(trace.one("lora.host_to_device")) is cold
    checked = trace.one("lora.validate")         # the worker, against its served model
    assert trace.parent(checked) is cold and checked["attributes"]["lora.bytes"] == info.bytes

    # Validation runs once, when the adapter is registered: router -> store -> validate -> S3.
    reg = next(s for s in spans if s["name"] == "router.register")
    reg_trace = Trace(spans, reg["trace_id"])
    print("register trace:\n" + reg_trace.render())
    validate = reg_trace.one("store.validate")
    assert reg_trace.parent(reg_trace.parent(validate)) is reg
    assert all(reg_trace.parent(g) is validate for g in reg_trace.named("s3.get"))
    assert validate["attributes"]["lora.bytes"] == info.bytes
