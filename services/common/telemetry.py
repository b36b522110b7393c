"""OpenTelemetry set-up and W3C trace-context propagation through gRPC metadata.

Each service calls `setup_tracing` once in main(). Spans go to OTLP when an endpoint is set
(the optional `otlp` extra), and to a JSON-lines file with --trace-file (tests read it).
"""
from __future__ import annotations

import json
import logging
import threading
from typing import Iterable, Sequence

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import (BatchSpanProcessor, SimpleSpanProcessor,
                                            SpanExporter, SpanExportResult)

log = logging.getLogger(__name__)


class JsonLinesExporter(SpanExporter):
    """Appends one JSON object per finished span to a file (thread-safe)."""

    def __init__(self, path: str):
        self._path = path
        self._lock = threading.Lock()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        lines = [json.dumps(span_record(s)) for s in spans]
        with self._lock, open(self._path, "a", encoding="utf-8") as f:
            f.write("".join(line + "\n" for line in lines))
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        return None


def span_record(span: ReadableSpan) -> dict:
    """A span as a plain dict: ids in hex, attributes, service name."""
    ctx = span.get_span_context()
    parent = span.parent
    return {
        "name": span.name,
        "trace_id": format(ctx.trace_id, "032x"),
        "span_id": format(ctx.span_id, "016x"),
        "parent_id": format(parent.span_id, "016x") if parent else None,
        "service": span.resource.attributes.get("service.name"),
        "start_ns": span.start_time, "end_ns": span.end_time,
        "attributes": {k: v if isinstance(v, (str, int, float, bool)) else list(v)
                       for k, v in (span.attributes or {}).items()},
        "status": span.status.status_code.name,
    }


def setup_tracing(service: str, otlp_endpoint: str | None, trace_file: str | None) -> None:
    """Install a TracerProvider for this process with the configured exporters."""
    provider = TracerProvider(resource=Resource.create({"service.name": service}))
    endpoint = otlp_endpoint         # the flag's default is OTEL_EXPORTER_OTLP_ENDPOINT
    if endpoint:
        try:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
            provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
            log.info("exporting traces to %s", endpoint)
        except ImportError:
            log.warning("--otlp-endpoint set but the otlp exporter is not installed "
                        "(pip install 'lorafleet[otlp]'); traces are not exported")
    if trace_file:
        provider.add_span_processor(SimpleSpanProcessor(JsonLinesExporter(trace_file)))
    trace.set_tracer_provider(provider)


def tracer(name: str) -> trace.Tracer:
    return trace.get_tracer(name)


async def traced(span: trace.Span, responses):
    """Yield what the async generator `responses` yields, with `span` current while
    `responses` runs (each step and its close), so its calls carry the span's context, but not
    across this generator's own yields. A span made current across a yield is detached
    wherever the generator is resumed or closed: in another task or context (a client gone,
    the generator finalized by the garbage collector) OpenTelemetry logs "Failed to detach
    context". The caller ends the span."""
    try:
        while True:
            with trace.use_span(span, end_on_exit=False):
                try:
                    item = await responses.__anext__()
                except StopAsyncIteration:
                    return
            yield item
    finally:
        with trace.use_span(span, end_on_exit=False):
            await responses.aclose()


def outgoing_metadata(extra: Iterable[tuple[str, str]] = ()) -> list[tuple[str, str]]:
    """gRPC metadata carrying the current trace context (traceparent/tracestate)."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return [*extra, *carrier.items()]


def incoming_context(metadata) -> otel_context.Context:
    """The trace context a caller sent in its gRPC metadata (empty context if none)."""
    carrier = {k: v for k, v in (metadata or ()) if isinstance(v, str)}
    return propagate.extract(carrier)
