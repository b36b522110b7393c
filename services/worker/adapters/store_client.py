"""Fetch a validated adapter from the adapter store into the worker's host tier.

Runs on the adapter manager's loader threads with a blocking gRPC channel of its own, so a
cold load never waits for the worker's event loop (busy with every stream's tokens) nor holds
it. The bytes go straight into a host-tier reservation as they arrive:

- streamed: each chunk copied in and hashed as it comes (hashlib lets go of the GIL); the
  SHA-256 the store sends last must match, else DATA_LOSS and nothing is kept;
- same host (`shm_dir`, the store's --shm-dir): the store answers with the name of the file in
  its shared-memory directory that holds exactly the blob, and the worker reads it in with one
  system call. No digest: the bytes never left host memory, and the store checked them
  against the registered SHA-256 when it staged them. A file gone meanwhile (the store evicted
  it) is fetched again as a stream.
"""
from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass
from typing import Callable

import grpc
import numpy as np

from services.common.errors import DataLoss, from_rpc_error
from services.common.gen.lorafleet.v1 import adapter_store_pb2 as spb
from services.common.gen.lorafleet.v1 import adapter_store_pb2_grpc
from services.common.names import NAME
from services.common.telemetry import outgoing_metadata
from services.worker.adapters.host_tier import Reservation


@dataclass
class Fetched:
    """What a fetch brought besides the bytes (which are in the reservation)."""
    version: str
    config: dict
    tier: int                   # common_pb2.Tier the store served it from
    source_s: float             # the store's own source read, when it did one
    fetch_s: float              # the whole call, the bytes' transfer included
    digest_s: float             # hashing the streamed bytes (0 for a shared-memory read)
    shm: bool                   # the bytes came through the store's shared memory


Reserve = Callable[[int], Reservation]


class StoreClient:
    def __init__(self, channel: grpc.Channel, shm_dir: str | None = None):
        self._stub = adapter_store_pb2_grpc.AdapterStoreStub(channel)
        self._shm_dir = shm_dir

    def fetch(self, adapter_id: str, version: str, timeout: float | None,
              reserve: Reserve, pinned: bool = False) -> tuple[Fetched, Reservation]:
        """The adapter's bytes in a reservation from `reserve(nbytes)`, and what came with them.
        Blocking (a loader thread). DATA_LOSS if streamed bytes do not hash to the digest.
        pinned: the version was asked for, and is served while the store keeps it."""
        start = time.monotonic()
        res: list[Reservation] = []
        try:
            fetched = self._fetch(adapter_id, version, timeout, reserve, res, bool(self._shm_dir),
                                  pinned)
        except grpc.RpcError as err:
            raise from_rpc_error(err) from None
        fetched.fetch_s = time.monotonic() - start
        return fetched, res[0]

    def _fetch(self, adapter_id, version, timeout, reserve, res, shm: bool,
               pinned: bool = False) -> Fetched:
        call = self._stub.Fetch(spb.FetchRequest(id=adapter_id, version=version, shm=shm,
                                                 pinned=pinned),
                                timeout=timeout, metadata=outgoing_metadata())
        header = next(call, None)
        if header is None or header.WhichOneof("part") != "header":
            raise DataLoss(f"adapter {adapter_id!r}: the store's stream ended early")
        header = header.header
        if not res:
            res.append(reserve(header.total_bytes))
        elif res[0].view.numel() != header.total_bytes:
            raise DataLoss(f"adapter {adapter_id!r}: its size changed between two fetches")
        fetched = Fetched(header.adapter.version, json.loads(header.config_json), header.tier,
                          header.source_load_s, 0.0, 0.0, bool(header.shm_file))
        if header.shm_file:
            call.cancel()
            if self._read_shm(header.shm_file, res[0]):
                return fetched
            return self._fetch(adapter_id, version, timeout, reserve, res, False, pinned)
        fetched.digest_s = _receive(call, res[0], adapter_id)
        return fetched

    def _read_shm(self, name: str, res: Reservation) -> bool:
        """Read the store's file into the reservation; False if it is gone (evicted)."""
        if not NAME.fullmatch(name):
            raise DataLoss(f"the store named shared-memory file {name[:80]!r}, not a plain name")
        try:
            fd = os.open(os.path.join(self._shm_dir, name), os.O_RDONLY)
        except FileNotFoundError:
            return False
        try:
            if os.fstat(fd).st_size != res.view.numel():
                return False
            buf, got = memoryview(res.view.numpy()), 0
            while got < len(buf):
                n = os.readv(fd, [buf[got:]])
                if n == 0:
                    return False
                got += n
            return True
        finally:
            os.close(fd)


def _receive(call, res: Reservation, adapter_id: str) -> float:
    """Copy the data chunks into the reservation, hashing them; check the digest that ends
    the stream. Returns the seconds spent hashing."""
    out = res.view.numpy()
    sha, at, hashing, digest = hashlib.sha256(), 0, 0.0, ""
    for chunk in call:
        kind = chunk.WhichOneof("part")
        if kind == "data":
            data = chunk.data
            if at + len(data) > len(out):
                raise DataLoss(f"adapter {adapter_id!r}: the store sent more bytes than it said")
            out[at:at + len(data)] = np.frombuffer(data, dtype=np.uint8)
            at += len(data)
            t = time.monotonic()
            sha.update(data)
            hashing += time.monotonic() - t
        elif kind == "sha256":
            digest = chunk.sha256
    if at != len(out) or not digest:
        raise DataLoss(f"adapter {adapter_id!r}: the store's stream ended early")
    if sha.hexdigest() != digest:
        raise DataLoss(f"adapter {adapter_id!r}: digest mismatch (got {sha.hexdigest()[:16]}, "
                       f"store sent {digest[:16]})")
    return hashing
