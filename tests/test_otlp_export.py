"""OTLP export: a service started with --otlp-endpoint sends its spans to an OpenTelemetry
collector over OTLP/gRPC. The collector here is a real gRPC server on loopback implementing the
OTLP TraceService; the adapter store registers the demo adapters at start, which makes one
`store.validate` span each (and `store.register` around it)."""
from __future__ import annotations

import threading
import time
from concurrent import futures

import grpc
import pytest

from services.common.gen.lorafleet.v1 import adapter_store_pb2 as spb
from services.common.gen.lorafleet.v1 import adapter_store_pb2_grpc
from tests.support import DEMO_ADAPTERS, MODEL_DIR, Service, free_port

trace_service = pytest.importorskip(
    "opentelemetry.proto.collector.trace.v1.trace_service_pb2_grpc",
    reason="the otlp extra (make venv installs it)")
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2  # noqa: E402

pytestmark = pytest.mark.slow


class Collector(trace_service.TraceServiceServicer):
    """Records (service.name, span name) of every exported span."""

    def __init__(self):
        self.spans: list[tuple[str, str]] = []
        self.lock = threading.Lock()

    def Export(self, request, context):
        with self.lock:
            for rs in request.resource_spans:
                service = next((a.value.string_value for a in rs.resource.attributes
                                if a.key == "service.name"), "")
                for ss in rs.scope_spans:
                    self.spans += [(service, s.name) for s in ss.spans]
        return trace_service_pb2.ExportTraceServiceResponse()


def test_store_exports_its_spans_over_otlp(tmp_path):
    collector = Collector()
    server = grpc.server(futures.ThreadPoolExecutor(2))
    trace_service.add_TraceServiceServicer_to_server(collector, server)
    port = free_port()
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    store = Service("adapter_store", ["--model", str(MODEL_DIR), "--adapters-dir",
                                      str(DEMO_ADAPTERS), "--db", ":memory:", "--otlp-endpoint",
                                      f"http://127.0.0.1:{port}"], tmp_path)
    try:
        store.wait()
        names = sorted(p.name for p in DEMO_ADAPTERS.iterdir()
                       if (p / "adapter_config.json").exists())
        with grpc.insecure_channel(store.addr) as ch:      # first use validates each
            stub = adapter_store_pb2_grpc.AdapterStoreStub(ch)
            for name in names:
                stub.Resolve(spb.ResolveRequest(name=name), timeout=30)
        end = time.monotonic() + 30            # the batch processor exports every 5 s
        while time.monotonic() < end:
            with collector.lock:
                validated = sum(1 for svc, name in collector.spans
                                if svc == "adapter-store" and name == "store.validate")
            if validated >= len(names):
                break
            time.sleep(0.2)
        assert validated >= len(names), (collector.spans, store.log()[-2000:])
        assert "not exported" not in store.log()
    finally:
        store.terminate()
        server.stop(0)
