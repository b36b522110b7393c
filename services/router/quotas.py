"""Per-tenant quotas: requests/s and tokens/s (token buckets with a burst) and requests in flight
(no torch, no I/O). The router calls ``check`` before queueing a request and ``release`` when it
ends; a refusal carries the delay after which the same request would pass (RESOURCE_EXHAUSTED +
retry delay in the servicer).

Config, from the tenants file (parsed elsewhere) as a plain mapping::

    {"default": {"requests_per_s": 10, "tokens_per_s": 20000, "max_in_flight": 8},
     "tenants": {"acme": {"requests_per_s": 50, "request_burst": 100}}}

Keys: requests_per_s, request_burst (default max(1, requests_per_s)), tokens_per_s, token_burst
(default tokens_per_s), max_in_flight. A missing or null key means unlimited; a tenant's entry
overrides the default key by key. Unknown keys are refused (ValueError names them).
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field, fields, replace
from typing import Any, Callable, Mapping

_KEYS = ("requests_per_s", "request_burst", "tokens_per_s", "token_burst", "max_in_flight")


@dataclass(frozen=True)
class TenantQuota:
    """One tenant's limits; None = unlimited."""

    requests_per_s: float | None = None
    request_burst: float | None = None
    tokens_per_s: float | None = None
    token_burst: float | None = None
    max_in_flight: int | None = None

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if value is not None and (not isinstance(value, (int, float)) or value <= 0):
                raise ValueError(f"quota {f.name} must be a positive number or null, got {value!r}")
        if self.max_in_flight is not None and int(self.max_in_flight) != self.max_in_flight:
            raise ValueError(f"quota max_in_flight must be an integer, got {self.max_in_flight!r}")

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any], base: TenantQuota | None = None) -> TenantQuota:
        """Build from a config mapping, key by key over base (the defaults)."""
        unknown = sorted(set(data) - set(_KEYS))
        if unknown:
            raise ValueError(f"unknown quota keys {unknown}; expected some of {list(_KEYS)}")
        return replace(base or cls(), **{k: data[k] for k in _KEYS if k in data})

    @property
    def request_capacity(self) -> float:
        """Burst of the requests/s bucket."""
        return self.request_burst or max(1.0, self.requests_per_s or 1.0)

    @property
    def token_capacity(self) -> float:
        """Burst of the tokens/s bucket."""
        return self.token_burst or (self.tokens_per_s or 1.0)


@dataclass(frozen=True)
class QuotaConfig:
    """Default quota plus per-tenant overrides."""

    default: TenantQuota = TenantQuota()
    tenants: Mapping[str, TenantQuota] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> QuotaConfig:
        """Parse ``{"default": {...}, "tenants": {name: {...}}}`` (both optional)."""
        data = data or {}
        unknown = sorted(set(data) - {"default", "tenants"})
        if unknown:
            raise ValueError(f"unknown quota config sections {unknown}")
        default = TenantQuota.from_mapping(data.get("default") or {})
        tenants = {name: TenantQuota.from_mapping(spec or {}, default)
                   for name, spec in (data.get("tenants") or {}).items()}
        return cls(default, tenants)

    def for_tenant(self, tenant: str) -> TenantQuota:
        """The tenant's quota (its override or the default)."""
        return self.tenants.get(tenant, self.default)


class TokenBucket:
    """Refills at ``rate`` per second up to ``burst``. A request larger than the burst passes only
    when the bucket is full and leaves it in debt, so it is delayed, never refused forever."""

    def __init__(self, rate: float, burst: float, now: float) -> None:
        self.rate, self.burst = float(rate), float(burst)
        self.level, self._last = float(burst), now

    def _refill(self, now: float) -> None:
        if now > self._last:
            self.level = min(self.burst, self.level + (now - self._last) * self.rate)
            self._last = now

    def wait_time(self, amount: float, now: float) -> float:
        """Seconds until ``amount`` can be taken (0.0: now)."""
        self._refill(now)
        short = min(amount, self.burst) - self.level
        return max(0.0, short / self.rate)

    def take(self, amount: float, now: float) -> None:
        """Take amount (may go into debt); call after wait_time said 0."""
        self._refill(now)
        self.level -= amount

    def give(self, amount: float, now: float) -> None:
        """Return amount (a refund), never above the burst."""
        self._refill(now)
        self.level = min(self.burst, self.level + amount)


@dataclass
class TenantUsage:
    """Per-tenant counters: admitted and throttled requests, requests in flight."""

    admitted: int = 0
    throttled: int = 0
    in_flight: int = 0


def share_of(quota: TenantQuota, replicas: int) -> TenantQuota:
    """One of `replicas` routers' part of a tenant's quota: rates, bursts and in-flight divided
    among them (in-flight rounded up, so each replica lets at least one through)."""
    if replicas <= 1:
        return quota

    def part(v):
        return None if v is None else v / replicas
    return TenantQuota(part(quota.requests_per_s),
                       part(quota.request_capacity) if quota.requests_per_s else None,
                       part(quota.tokens_per_s),
                       part(quota.token_capacity) if quota.tokens_per_s else None,
                       None if quota.max_in_flight is None
                       else max(1, -(-quota.max_in_flight // replicas)))


class _TenantState:
    __slots__ = ("quota", "requests", "tokens", "usage")

    def __init__(self, quota: TenantQuota, now: float) -> None:
        self.quota = quota
        self.requests = (TokenBucket(quota.requests_per_s, quota.request_capacity, now)
                         if quota.requests_per_s else None)
        self.tokens = (TokenBucket(quota.tokens_per_s, quota.token_capacity, now)
                       if quota.tokens_per_s else None)
        self.usage = TenantUsage()


class Quotas:
    """Per-tenant admission control. Thread-safe.

    clock: monotonic seconds (injectable for tests). in_flight_retry_s: the retry delay given
    when the in-flight limit refuses (when a slot frees cannot be known in advance).
    """

    def __init__(self, config: QuotaConfig | None = None, *,
                 clock: Callable[[], float] = time.monotonic,
                 in_flight_retry_s: float = 1.0) -> None:
        self._config = config or QuotaConfig()
        self._clock = clock
        self._in_flight_retry = in_flight_retry_s
        self._lock = threading.Lock()
        self._tenants: dict[str, _TenantState] = {}
        self.replicas = 1

    def set_replicas(self, replicas: int) -> None:
        """Enforce this router's part of each quota when `replicas` routers share them (the
        live ones, services.router.peers): the buckets keep their fill, scaled to the new part."""
        replicas = max(1, int(replicas))
        with self._lock:
            if replicas == self.replicas:
                return
            now = self._clock()
            for tenant, state in self._tenants.items():
                quota = share_of(self._config.for_tenant(tenant), replicas)
                for bucket, rate, burst in ((state.requests, quota.requests_per_s,
                                             quota.request_burst),
                                            (state.tokens, quota.tokens_per_s,
                                             quota.token_burst)):
                    if bucket is not None:
                        bucket._refill(now)
                        fill = bucket.level / bucket.burst
                        bucket.rate, bucket.burst = float(rate), float(burst)
                        bucket.level = fill * bucket.burst
                state.quota = quota
            self.replicas = replicas

    def _state(self, tenant: str) -> _TenantState:
        state = self._tenants.get(tenant)
        if state is None:
            quota = share_of(self._config.for_tenant(tenant), self.replicas)
            state = self._tenants[tenant] = _TenantState(quota, self._clock())
        return state

    def check(self, tenant: str, est_tokens: int = 0) -> float | None:
        """Admit a request (None; it now counts until release) or refuse it: the retry delay in
        seconds after which it would pass (nothing is taken then)."""
        with self._lock:
            state, now = self._state(tenant), self._clock()
            wait = self._wait(state, est_tokens, now)
            if wait > 0.0:
                state.usage.throttled += 1
                return wait
            if state.requests:
                state.requests.take(1, now)
            if state.tokens:
                state.tokens.take(est_tokens, now)
            state.usage.admitted += 1
            state.usage.in_flight += 1
            return None

    def _wait(self, state: _TenantState, est_tokens: int, now: float) -> float:
        wait = 0.0
        limit = state.quota.max_in_flight
        if limit is not None and state.usage.in_flight >= limit:
            wait = self._in_flight_retry
        if state.requests:
            wait = max(wait, state.requests.wait_time(1, now))
        if state.tokens:
            wait = max(wait, state.tokens.wait_time(est_tokens, now))
        return 0.0 if wait <= 1e-9 else wait

    def release(self, tenant: str, est_tokens: int = 0, actual_tokens: int | None = None) -> None:
        """End an admitted request; with actual_tokens, settle the token bucket to the real use
        (more than estimated is taken, less is refunded)."""
        with self._lock:
            state, now = self._state(tenant), self._clock()
            state.usage.in_flight = max(0, state.usage.in_flight - 1)
            if state.tokens and actual_tokens is not None:
                delta = actual_tokens - est_tokens
                if delta > 0:
                    state.tokens.take(delta, now)
                elif delta < 0:
                    state.tokens.give(-delta, now)

    def usage(self) -> dict[str, TenantUsage]:
        """Per-tenant counters (copies)."""
        with self._lock:
            return {t: replace(s.usage) for t, s in self._tenants.items()}

    def in_flight(self, tenant: str) -> int:
        """Admitted, unreleased requests of the tenant."""
        state = self._tenants.get(tenant)
        return state.usage.in_flight if state else 0

