"""services/common/tenant_labels.py: 10k tenants make at most N + 1 series a family, the
busiest keep their names, a demoted tenant's series go and no counter ever goes down."""
from __future__ import annotations

import random

import pytest
from prometheus_client import CollectorRegistry, Counter

from services.common.tenant_labels import OTHER, TenantLabels
from services.common.weighted_histogram import WeightedHistogram

pytestmark = pytest.mark.policy     # torch-free: `make test-policy`


def series(registry, name):
    return {tuple(sorted(s.labels.items())): s.value for m in registry.collect()
            for s in m.samples if s.name == name}


def test_ten_thousand_tenants_make_at_most_n_plus_one_series():
    reg = CollectorRegistry()
    tokens = Counter("t_tokens", "", ["tenant", "status"], registry=reg)
    labels = TenantLabels(limit=50)
    rng = random.Random(1)
    heavy = [f"heavy{i}" for i in range(10)]
    total = 0
    for i in range(60_000):
        tenant = rng.choice(heavy) if i % 3 == 0 else f"t{rng.randrange(10_000)}"
        labels.note(tenant)
        labels.labels(tokens, tenant, "OK").inc(2)
        total += 2
    got = series(reg, "t_tokens_total")
    named = {dict(k)["tenant"] for k in got}
    assert len(got) <= 51 and OTHER in named
    assert set(heavy) <= named                   # the busiest keep their own series
    assert sum(got.values()) <= total            # a demoted tenant's count left with its series
    assert len(labels._traffic) <= labels.track + 1


def test_a_busier_tenant_takes_the_least_ones_place_and_counters_stay_monotonic():
    reg = CollectorRegistry()
    requests = Counter("r", "", ["tenant"], registry=reg)
    labels = TenantLabels(limit=2)
    for tenant in ["a", "a", "a", "b", "c"]:
        labels.labels(requests, labels.note(tenant) and tenant).inc()
    assert series(reg, "r_total") == {(("tenant", "a"),): 3, (("tenant", "b"),): 1,
                                      (("tenant", "other"),): 1}
    other_before = series(reg, "r_total")[(("tenant", "other"),)]
    for _ in range(2):                           # c passes 1.25x b's traffic: b is demoted
        labels.labels(requests, labels.note("c") and "c").inc()
    after = series(reg, "r_total")
    assert (("tenant", "b"),) not in after and after[(("tenant", "c"),)] >= 1
    assert after[(("tenant", "other"),)] >= other_before
    labels.labels(requests, labels.note("b") and "b").inc()
    assert series(reg, "r_total")[(("tenant", "other"),)] == other_before + 1


def test_the_weighted_histogram_sums_as_per_token_observations_would():
    reg = CollectorRegistry()
    h = WeightedHistogram("itl", "", ["tenant"], buckets=(0.01, 0.1, 1), registry=reg)
    h.labels("a").observe(0.05, 9)               # one request: 9 gaps of 50 ms on average
    h.labels("a").observe(0.5, 1)
    got = {(s.name, s.labels.get("le")): s.value for m in reg.collect() for s in m.samples}
    assert got[("itl_count", None)] == 10
    assert got[("itl_sum", None)] == pytest.approx(0.05 * 9 + 0.5)
    assert [got[("itl_bucket", le)] for le in ("0.01", "0.1", "1.0", "+Inf")] == [0, 9, 10, 10]
    h.remove("a")
    assert not [s for m in reg.collect() for s in m.samples]
