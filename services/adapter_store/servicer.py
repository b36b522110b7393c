"""AdapterStore gRPC servicer: proto -> AdapterStore call -> proto. Domain errors raised below are
mapped to status codes by services.common.server.ErrorInterceptor.

Fetch streams, in order: one AdapterHeader, the blob (exactly the validated
adapter_model.safetensors bytes) in `data` chunks of --chunk-bytes, then the blob's hex SHA-256.
A caller on this host that asks for shared memory (FetchRequest.shm) of a blob the host tier
keeps as a file there gets the header with `shm_file` set and the digest, no chunks.
"""
from __future__ import annotations

from opentelemetry import trace

from services.adapter_store.registry import AdapterRecord
from services.adapter_store.store import AdapterStore, Staged
from services.common.gen.lorafleet.v1 import (adapter_store_pb2 as pb, adapter_store_pb2_grpc,
                                              common_pb2, router_pb2)
from services.common import span_attrs
from services.common.telemetry import incoming_context

_tracer = trace.get_tracer(__name__)
# A deadline further away than this is treated as none (aio reports "no deadline" as huge).
_NO_DEADLINE_S = 1e6


def remaining(context) -> float | None:
    """Seconds left before the caller's deadline, None when it set none."""
    left = context.time_remaining()
    return None if left is None or left > _NO_DEADLINE_S else max(0.0, left)


def adapter_info(rec: AdapterRecord) -> router_pb2.AdapterInfo:
    """The public view of a registry record."""
    return router_pb2.AdapterInfo(
        id=rec.id, version=rec.version, owner=rec.owner, shared=rec.shared,
        aliases=list(rec.aliases), rank=rec.rank, target_modules=list(rec.targets),
        bytes=rec.bytes, state=rec.state, failure_reason=rec.reason, source=rec.source,
        lora_alpha=rec.alpha, use_rslora=rec.rslora, pinned=rec.pinned,
        pinned_aliases=dict(rec.alias_pins))


def fetch_header(staged: Staged, shm: bool = False) -> pb.AdapterHeader:
    """What the worker needs to place the blob without parsing safetensors again (and, with
    shm, the shared-memory file to read it from)."""
    rec = staged.record
    return pb.AdapterHeader(
        adapter=adapter_info(rec), config_json=rec.config_json,
        tensors=[pb.TensorEntry(name=t.name, dtype=t.dtype, shape=list(t.shape),
                                offset=t.offset, nbytes=t.nbytes) for t in rec.tensors],
        total_bytes=len(staged.blob), tier=common_pb2.Tier.Value(staged.tier),
        source_load_s=staged.load_s, shm_file=staged.shm_file if shm else "")


class AdapterStoreServicer(adapter_store_pb2_grpc.AdapterStoreServicer):
    """Thin adapter between lorafleet.v1.AdapterStore and services.adapter_store.store."""

    def __init__(self, store: AdapterStore, chunk_bytes: int):
        self._store = store
        self._chunk = chunk_bytes

    async def Register(self, request, context):
        with _tracer.start_as_current_span(
                "store.register", context=incoming_context(context.invocation_metadata()),
                attributes={**span_attrs.rpc("AdapterStore", "Register"),
                            "lora.adapter_id": request.id}) as span, \
                span_attrs.grpc_status(span, context):
            rec = await self._store.register(request.id, request.source, request.owner,
                                             list(request.aliases), request.replace,
                                             remaining(context))
        return pb.RegisterResponse(adapter=adapter_info(rec))

    async def Resolve(self, request, context):
        return pb.ResolveResponse(adapter=adapter_info(
            await self._store.resolve(request.name, request.tenant, remaining(context))))

    async def SetAlias(self, request, context):
        return router_pb2.SetAliasResponse(adapter=adapter_info(
            self._store.set_alias(request.alias, request.target)))

    async def List(self, request, context):
        records, token = self._store.list_page(request.tenant, request.all_tenants,
                                               request.owner, request.prefix,
                                               request.page_size, request.page_token)
        return pb.ListResponse(adapters=[adapter_info(r) for r in records],
                               next_page_token=token)

    async def Versions(self, request, context):
        rec, kept = self._store.versions(request.id, request.tenant, request.all_tenants)
        return router_pb2.ListAdapterVersionsResponse(
            adapter_id=rec.id, owner=rec.owner,
            versions=[router_pb2.AdapterVersion(
                version=v.version, sha256=v.sha256, source=v.source, rank=v.rank,
                bytes=v.bytes, registered_at=v.created, current=v.current,
                pinned_aliases=list(v.pinned_aliases), kept=has) for v, has in kept])

    async def Delete(self, request, context):
        self._store.delete(request.id)
        return pb.DeleteResponse()

    async def Fetch(self, request, context):
        span = _tracer.start_span("store.fetch",
                                  context=incoming_context(context.invocation_metadata()),
                                  attributes={**span_attrs.rpc("AdapterStore", "Fetch"),
                                              "lora.adapter_id": request.id})
        try:
            with span_attrs.grpc_status(span, context):
                with trace.use_span(span, end_on_exit=False):
                    staged = await self._store.stage(request.id, request.version,
                                                     remaining(context), request.pinned)
                span.set_attributes({"lora.bytes": len(staged.blob), "lora.tier": staged.tier,
                                     "lora.version": staged.record.version})
                shm = request.shm and bool(staged.shm_file)
                span.set_attribute("lora.shm", shm)
                yield pb.FetchChunk(header=fetch_header(staged, shm))
                if not shm:
                    view = memoryview(staged.blob)
                    for start in range(0, len(view), self._chunk):
                        yield pb.FetchChunk(data=bytes(view[start:start + self._chunk]))
                yield pb.FetchChunk(sha256=staged.record.sha256)
        finally:
            span.end()

    async def Stats(self, request, context):
        s = self._store.stats()
        return pb.StoreStatsResponse(
            registered=s.registered, failed=s.failed, host_resident=s.host.resident,
            host_hits=s.host.hits, host_misses=s.host.misses, host_bytes=s.host.bytes,
            max_rank=self._store.max_rank,
            source_loads=router_pb2.ColdLoadStats(tier="source", count=s.source_loads,
                                                  p50=s.p50, p95=s.p95, p99=s.p99))
