"""The adapter manager's records (services.worker.adapters.manager): where an adapter resides
and who holds it (the residency feed reads these), and a request's hold on one."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Acquired:
    key: str
    slot: int
    tier: int                   # common_pb2.Tier it came from (GPU on a hit)
    seconds: float              # cold-load time (0 on a hit)


@dataclass
class Residency:
    id: str
    version: str
    tenant: str
    nbytes: int
    users: int = 0              # requests holding it (waiting or running)
    loading: bool = False
    host: bool = False
    gpu: bool = False
    waiters: int = 0
