"""The Grafana dashboard (deploy/k8s/components/monitoring/grafana/lorafleet.json) and the
KEDA ScaledObject's queries (deploy/k8s/overlays/autoscale/scaledobject.yaml) name only
series the services export: every metric name in their PromQL must be among the series
scraped from a live stack's three /metrics pages after a small mixed run (the shared observed
stack, tests/observed.py). Also the dashboard's shape: panels with titles, a Prometheus
datasource, one or more PromQL targets each, and the health signals all present."""
from __future__ import annotations

import json
import re

import pytest
import yaml

from tests.observed import samples
from tests.test_k8s_monitoring import DASHBOARD
from tests.test_k8s import K8S

pytestmark = pytest.mark.slow

SCALED_OBJECT = K8S / "overlays" / "autoscale" / "scaledobject.yaml"
KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "and", "or",
            "unless", "bool", "offset", "inf", "nan"}


def series_names(expr: str) -> set[str]:
    """The metric names a PromQL expression reads: identifiers left once strings, label
    matchers, range selectors and by/without clauses are cut, less function calls and
    keywords."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    expr = re.sub(r"\{[^}]*\}", "", expr)
    expr = re.sub(r"\[[^\]]*\]", "", expr)
    expr = re.sub(r"\b(by|without|on|ignoring)\s*\([^)]*\)", "", expr)
    names = set()
    for m in re.finditer(r"[a-zA-Z_:][a-zA-Z0-9_:]*", expr):
        rest = expr[m.end():].lstrip()
        if rest.startswith("(") or m.group(0).lower() in KEYWORDS:
            continue
        names.add(m.group(0))
    return names


def test_series_names_reads_promql():
    assert series_names('histogram_quantile(0.99, sum by (le, tenant) (rate('
                        'lorafleet_request_seconds_bucket{tenant!="x"}[5m])))') == {
        "lorafleet_request_seconds_bucket"}
    assert series_names("sum(vllm:num_requests_waiting) + max(a_b) / on(x) c") == {
        "vllm:num_requests_waiting", "a_b", "c"}


@pytest.fixture(scope="module")
def dashboard():
    return json.loads(DASHBOARD.read_text())


def test_dashboard_schema(dashboard):
    assert dashboard["title"] and dashboard["uid"] and dashboard["schemaVersion"] >= 30
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    panels = dashboard["panels"]
    assert len({p["id"] for p in panels}) == len(panels) >= 10
    for p in panels:
        assert p["title"] and p["type"] in ("timeseries", "stat", "gauge", "table", "bargauge")
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        assert set(p["gridPos"]) == {"x", "y", "w", "h"}
        assert p["targets"], p["title"]
        for t in p["targets"]:
            assert t["expr"].strip() and t["refId"] and t["datasource"] == p["datasource"]
    text = " ".join(t["expr"] for p in panels for t in p["targets"])
    for signal in ("lorafleet_fleet_cache_hits_total", "lorafleet_router_cold_load_seconds_bucket",
                   "lorafleet_tokens_served_total", "lorafleet_request_seconds_bucket",
                   "lorafleet_jain_index", "lorafleet_fleet_adapters", "vllm:kv_cache_usage_perc",
                   "vllm:time_to_first_token_seconds_bucket", "vllm:inter_token_latency_seconds"):
        assert signal in text, signal


def test_every_query_names_series_the_services_export(dashboard, observed):
    exported = {name for page in observed.pages().values() for name, _, _ in samples(page)}
    queries = [(p["title"], t["expr"]) for p in dashboard["panels"] for t in p["targets"]]
    scaled = yaml.safe_load(SCALED_OBJECT.read_text())
    queries += [("ScaledObject", t["metadata"]["query"]) for t in scaled["spec"]["triggers"]]
    missing = {(title, name) for title, expr in queries for name in series_names(expr)
               if name not in exported}
    assert not missing, sorted(missing)
    assert len({n for _, e in queries for n in series_names(e)}) >= 20
