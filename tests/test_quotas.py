"""Per-tenant quotas with an injected clock (no torch)."""
from __future__ import annotations

import pytest

from services.router.quotas import QuotaConfig, Quotas, TenantQuota, TokenBucket

pytestmark = pytest.mark.policy     # torch-free: `make test-policy`


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _quotas(config: dict) -> tuple[Quotas, FakeClock]:
    clock = FakeClock()
    return Quotas(QuotaConfig.from_dict(config), clock=clock, in_flight_retry_s=0.5), clock


def test_requests_per_second_with_burst_and_retry_after() -> None:
    quotas, clock = _quotas({"default": {"requests_per_s": 2, "request_burst": 3}})
    assert [quotas.check("a") for _ in range(3)] == [None, None, None]
    assert quotas.check("a") == pytest.approx(0.5)  # one request refills in 1/2 s
    clock.now += 0.25
    assert quotas.check("a") == pytest.approx(0.25)
    clock.now += 0.25
    assert quotas.check("a") is None
    assert quotas.check("b") is None  # tenants are independent
    assert quotas.usage()["a"].throttled == 2 and quotas.usage()["a"].admitted == 4


def test_tokens_per_second_and_retry_after() -> None:
    quotas, clock = _quotas({"default": {"tokens_per_s": 100, "token_burst": 200}})
    assert quotas.check("a", est_tokens=150) is None
    assert quotas.check("a", est_tokens=100) == pytest.approx(0.5)  # 50 left, 50 short
    clock.now += 0.5
    assert quotas.check("a", est_tokens=100) is None


def test_request_larger_than_burst_waits_for_full_bucket_then_passes() -> None:
    quotas, clock = _quotas({"default": {"tokens_per_s": 100, "token_burst": 200}})
    assert quotas.check("a", est_tokens=50) is None
    assert quotas.check("a", est_tokens=1000) == pytest.approx(0.5)  # until the bucket is full
    clock.now += 0.5
    assert quotas.check("a", est_tokens=1000) is None  # goes into debt
    assert quotas.check("a", est_tokens=1) == pytest.approx(8.01)


def test_in_flight_limit_and_release() -> None:
    quotas, _ = _quotas({"default": {"max_in_flight": 2}})
    assert quotas.check("a") is None and quotas.check("a") is None
    assert quotas.check("a") == 0.5
    quotas.release("a")
    assert quotas.in_flight("a") == 1
    assert quotas.check("a") is None


def test_release_settles_tokens_to_actual_use() -> None:
    quotas, _ = _quotas({"default": {"tokens_per_s": 10, "token_burst": 100}})
    assert quotas.check("a", est_tokens=100) is None
    quotas.release("a", est_tokens=100, actual_tokens=40)  # 60 refunded
    assert quotas.check("a", est_tokens=60) is None
    assert quotas.check("a", est_tokens=1) == pytest.approx(0.1)
    quotas.release("a", est_tokens=60, actual_tokens=80)  # 20 more taken
    assert quotas.check("a", est_tokens=1) == pytest.approx(2.1)


def test_config_overrides_defaults_key_by_key_and_rejects_unknown_keys() -> None:
    config = QuotaConfig.from_dict({
        "default": {"requests_per_s": 10, "max_in_flight": 4},
        "tenants": {"acme": {"requests_per_s": 50}, "free": {"max_in_flight": None}},
    })
    assert config.for_tenant("acme") == TenantQuota(requests_per_s=50, max_in_flight=4)
    assert config.for_tenant("free").max_in_flight is None
    assert config.for_tenant("other") == config.default
    assert config.for_tenant("acme").request_capacity == 50
    with pytest.raises(ValueError, match="rps"):
        QuotaConfig.from_dict({"default": {"rps": 3}})
    with pytest.raises(ValueError, match="tokens_per_s"):
        QuotaConfig.from_dict({"tenants": {"x": {"tokens_per_s": -1}}})
    with pytest.raises(ValueError):
        QuotaConfig.from_dict({"defaults": {}})


def test_unlimited_by_default() -> None:
    quotas, _ = _quotas({})
    assert all(quotas.check("a", est_tokens=10**9) is None for _ in range(100))


def test_token_bucket_refund_capped_at_burst() -> None:
    bucket = TokenBucket(rate=1.0, burst=5.0, now=0.0)
    bucket.give(10, now=0.0)
    assert bucket.level == 5.0 and bucket.wait_time(5, now=0.0) == 0.0


def test_a_replica_enforces_its_part_and_takes_the_whole_back():
    """Two live replicas: each admits half the burst and half the in-flight requests; alone
    again, the whole (the bucket keeps its fill, scaled)."""
    now = [0.0]
    config = QuotaConfig.from_dict({"default": {"requests_per_s": 1, "request_burst": 10,
                                                "max_in_flight": 4}})
    q = Quotas(config, clock=lambda: now[0])
    q.set_replicas(2)
    admitted = [q.check("t") is None for _ in range(6)]
    assert admitted == [True, True, False, False, False, False]      # in flight: 2 of 4
    for _ in range(2):
        q.release("t")
    assert [q.check("t") is None for _ in range(3)] == [True, True, False]   # burst: 5 of 10
    q.set_replicas(1)
    for _ in range(2):
        q.release("t")
    # the bucket kept its fill, 1 of 5 -> 2 of 10; in flight, up to 4 again
    assert [q.check("t") is None for _ in range(3)] == [True, True, False]
    now[0] += 2.0                                                     # 2 more at 1/s
    assert [q.check("t") is None for _ in range(3)] == [True, True, False]   # 4 in flight
