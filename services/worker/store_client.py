"""Fetch a validated adapter from the adapter store and check its digest."""
from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass

import grpc

from services.common.errors import DataLoss, from_rpc_error
from services.common.gen.lorafleet.v1 import adapter_store_pb2 as spb
from services.common.gen.lorafleet.v1 import adapter_store_pb2_grpc
from services.common.telemetry import outgoing_metadata


@dataclass
class FetchedAdapter:
    id: str
    version: str
    config: dict
    blob: bytes                 # the adapter_model.safetensors bytes the store validated
    tier: int                   # common_pb2.Tier the store served it from
    source_load_s: float
    fetch_s: float


class StoreClient:
    def __init__(self, channel: grpc.aio.Channel):
        self._stub = adapter_store_pb2_grpc.AdapterStoreStub(channel)

    async def fetch(self, adapter_id: str, version: str, timeout: float | None) -> FetchedAdapter:
        """Stream the adapter; DATA_LOSS if the bytes do not hash to the digest sent."""
        start = time.monotonic()
        header, parts, digest = None, [], ""
        sha = hashlib.sha256()
        try:
            async for chunk in self._stub.Fetch(spb.FetchRequest(id=adapter_id, version=version),
                                                timeout=timeout, metadata=outgoing_metadata()):
                kind = chunk.WhichOneof("part")
                if kind == "header":
                    header = chunk.header
                elif kind == "data":
                    sha.update(chunk.data)
                    parts.append(chunk.data)
                else:
                    digest = chunk.sha256
        except grpc.RpcError as err:
            raise from_rpc_error(err) from None
        if header is None or not digest:
            raise DataLoss(f"adapter {adapter_id!r}: the store's stream ended early")
        if sha.hexdigest() != digest:
            raise DataLoss(f"adapter {adapter_id!r}: digest mismatch (got {sha.hexdigest()[:16]}, "
                           f"store sent {digest[:16]})")
        return FetchedAdapter(adapter_id, header.adapter.version, json.loads(header.config_json),
                              b"".join(parts), header.tier, header.source_load_s,
                              time.monotonic() - start)
