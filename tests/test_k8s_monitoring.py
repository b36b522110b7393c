"""deploy/k8s's monitoring pieces, rendered offline with kustomize: the monitoring component's
ServiceMonitors and Grafana dashboard ConfigMap, and overlays/autoscale's KEDA ScaledObject.
kubernetes-validate has no schemas for these custom resources, so their structure is checked
here: apiVersion and kind, the fields each CRD requires, and that what they point at exists
in the same render (a ServiceMonitor selects a Service with the named port, the ScaledObject
targets the worker Deployment). tests/test_dashboard.py checks their PromQL against a live
stack's series."""
from __future__ import annotations

import json
import re

import pytest

from tests.test_k8s import K8S, named, of_kind, render, selects

pytestmark = pytest.mark.policy     # torch-free: `make test-policy`

DASHBOARD = K8S / "components" / "monitoring" / "grafana" / "lorafleet.json"


@pytest.fixture(scope="module")
def docs():
    return render("overlays/autoscale")


def test_service_monitors_select_each_service_by_its_metrics_port(docs):
    monitors = of_kind(docs, "ServiceMonitor")
    assert {m["metadata"]["name"] for m in monitors} == {
        "lorafleet-router", "lorafleet-worker", "lorafleet-adapter-store"}
    services = of_kind(docs, "Service")
    covered = set()
    for m in monitors:
        assert m["apiVersion"] == "monitoring.coreos.com/v1"
        assert m["metadata"]["namespace"] == "lorafleet"
        spec = m["spec"]
        assert spec["endpoints"] and "matchLabels" in spec["selector"]
        chosen = [s for s in services if selects(spec["selector"], s["metadata"]["labels"])]
        assert len(chosen) == 1, (m["metadata"]["name"], [s["metadata"]["name"] for s in chosen])
        ports = {p["name"] for p in chosen[0]["spec"]["ports"]}
        for ep in spec["endpoints"]:
            assert ep["port"] in ports and ep["path"] == "/metrics"
            assert re.fullmatch(r"\d+[smh]", ep["interval"])
        covered.add(chosen[0]["metadata"]["name"])
    assert covered == {"lorafleet-router", "lorafleet-workers", "lorafleet-store"}


def test_scaled_object_scales_the_worker_deployment_on_prometheus_triggers(docs):
    (so,) = of_kind(docs, "ScaledObject")
    assert so["apiVersion"] == "keda.sh/v1alpha1" and so["metadata"]["namespace"] == "lorafleet"
    spec = so["spec"]
    ref = spec["scaleTargetRef"]
    target = named(docs, ref.get("kind", "Deployment"), ref["name"])
    assert target is not None and target["metadata"]["labels"][
        "app.kubernetes.io/component"] == "worker"
    assert 1 <= spec["minReplicaCount"] <= spec["maxReplicaCount"]
    triggers = spec["triggers"]
    assert len(triggers) == 3
    for t in triggers:
        assert t["type"] == "prometheus"
        meta = t["metadata"]
        assert meta["serverAddress"].startswith("http") and meta["query"]
        assert float(meta["threshold"]) > 0 and isinstance(meta["threshold"], str)
    queries = " ".join(t["metadata"]["query"] for t in triggers)
    for signal in ("lorafleet_fleet_cache_misses_total", "lorafleet_fleet_cold_loads_pending",
                   "vllm:num_requests_waiting"):
        assert signal in queries


def test_the_dashboard_config_map_carries_the_dashboard_file(docs):
    cm = named(docs, "ConfigMap", "lorafleet-grafana-dashboard")
    assert cm is not None and cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(cm["data"]["lorafleet.json"]) == json.loads(DASHBOARD.read_text())
