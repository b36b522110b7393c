"""A worker's cold loads: the job of one in flight, the numbered log of finished ones the Info
RPC reads, the stage histograms, and the reload cost that cost-aware eviction weighs."""
from __future__ import annotations

import asyncio
import collections
from dataclasses import dataclass, field

from services.common.gen.lorafleet.v1 import common_pb2, worker_pb2 as wpb
from services.worker import metrics

H2D_BYTES_PER_S = 4e9    # a placement's copy to the pool, for the reload cost (--eviction cost)
STAGES = ("fetch", "digest", "layout", "room_wait", "host_to_device", "copy_wait", "device",
          "launch", "handoff", "source")


@dataclass
class ColdJob:
    """One cold load's job (services.worker.adapters.manager) across its runs: its record, and
    what the last run found and changed, for the event loop to apply."""
    key: str
    adapter_id: str
    version: str
    tenant: str
    deadline: float | None
    record: wpb.ColdLoadRecord
    placed: bool = False
    runs: int = 0
    nbytes: int = 0
    host_added: bool = False
    gpu_victims: list[str] = field(default_factory=list)
    host_victims: list[str] = field(default_factory=list)


class ColdLoadLog:
    """The newest finished cold loads, numbered (WorkerInfoResponse.cold_load_records)."""

    def __init__(self, keep: int = 4096):
        self.seq = 0
        self._records: collections.deque = collections.deque(maxlen=keep)

    def add(self, record: wpb.ColdLoadRecord) -> None:
        self.seq += 1
        record.seq = self.seq
        self._records.append(record)

    def since(self, seq: int) -> list[wpb.ColdLoadRecord]:
        return [r for r in self._records if r.seq > seq]


def reload_cost(record: wpb.ColdLoadRecord, nbytes: int) -> float:
    """Seconds this load took to get its bytes (fetch and layout: ~0 from the host tier) plus
    the copy to the pool: what evicting it would cost (CachePolicy eviction="cost")."""
    return record.fetch_s + record.layout_s + nbytes / H2D_BYTES_PER_S


def count_cold(samples: dict[int, list[float]], counts: dict[int, int], tier: int,
               seconds: float) -> None:
    """A finished cold load from `tier`: its histogram, its recent samples (the newest 512)
    and its count (WorkerInfoResponse.cold_loads)."""
    metrics.COLD_LOAD.labels(common_pb2.Tier.Name(tier).lower()).observe(seconds)
    kept = samples.setdefault(tier, [])
    kept.append(seconds)
    del kept[:-512]
    counts[tier] = counts.get(tier, 0) + 1


def observe_stages(record: wpb.ColdLoadRecord) -> None:
    for stage in STAGES:
        seconds = getattr(record, f"{stage}_s")
        if seconds:
            metrics.COLD_LOAD_STAGE.labels(stage).observe(seconds)


class LoopTurns:
    """One turn an event-loop iteration: take() is True for its first caller in an iteration
    (the turn ends when the loop starts its next one), False for the rest."""

    def __init__(self):
        self.taken = False

    def take(self) -> bool:
        if self.taken:
            return False
        self.taken = True
        asyncio.get_running_loop().call_soon(self._end)     # runs in the next iteration
        return True

    def _end(self) -> None:
        self.taken = False
