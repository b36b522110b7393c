"""The NetworkPolicies of deploy/k8s let through exactly the flows the workloads need, and the
needed flows are read from the manifests themselves, not listed by hand: each address a
container is told to call (`--store`, `--worker`, `--peer`, `--otlp-endpoint`, `--s3-endpoint`,
a URL in its environment) names a Service, whose pods and target port give a flow; the
router's `--listen`/`--http-listen` are public, each `--metrics-port` is Prometheus'. Issue 41:
the routers ran with `--peer=lorafleet-router-peers:7001` while the policy let no router reach
another, so each replica enforced a whole quota alone.

Needs `kubectl` (built-in kustomize) on PATH; no cluster is contacted.
"""
from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass, field

import pytest

from tests.test_k8s import (TARGETS, command_line, env_of, flag, host_port, named, of_kind,
                            pod_containers, render, selects, service_containers, workloads)

pytestmark = pytest.mark.policy     # torch-free: `make test-policy`

# The flags by which a lorafleet service calls another endpoint.
CALL_FLAGS = ("--store", "--worker", "--peer", "--otlp-endpoint", "--s3-endpoint")
# A URL or host:port in a container's environment (`http://user:pass@minio:9000`).
ENV_ADDRESS = re.compile(r"(?:(\w+)://)?(?:[^@\s/]*@)?([a-z0-9][a-z0-9.-]*):(\d+)\b")


@pytest.fixture(params=TARGETS)
def docs(request) -> tuple[dict, ...]:
    return render(request.param)


@dataclass(frozen=True)
class Endpoint:
    name: str
    ns: str = ""
    labels: dict = field(default_factory=dict, hash=False, compare=False)
    ip: str | None = None  # set for endpoints outside the pod network


OUTSIDE = [Endpoint("client", ip="203.0.113.7"), Endpoint("s3", ip="52.216.8.1"),
           Endpoint("nodelocal-dns", ip="169.254.20.10"),
           Endpoint("prometheus", "monitoring", {"app.kubernetes.io/name": "prometheus"}),
           Endpoint("kube-dns", "kube-system", {"k8s-app": "kube-dns"}),
           Endpoint("other-pod", "other", {"app": "minio"})]
CALLERS = ("client", "prometheus", "other-pod")      # the outside endpoints that open calls


def component(workload: dict) -> str:
    return workload["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"]


# ---- the flows the manifests ask for --------------------------------------------------------

def service_flows(docs, src: str, address: str) -> set[tuple]:
    """The flows a call from `src` to `address` makes: a Service's pods on its target port, or
    S3 outside the cluster (a dotted host) on the address's port."""
    host, port = host_port(address)
    if "." in host:
        return {(src, "s3", port, "TCP")}
    svc = named(docs, "Service", host)
    assert svc is not None, f"{src} calls {address}: no Service {host}"
    (sport,) = [p for p in svc["spec"]["ports"] if p["port"] == port]
    target = sport.get("targetPort", port)
    flows = set()
    for w in workloads(docs):
        if not selects({"matchLabels": svc["spec"]["selector"]},
                       w["spec"]["template"]["metadata"]["labels"]):
            continue
        ports = {p["containerPort"] for c in pod_containers(w) for p in c.get("ports", [])
                 if target in (p.get("name"), p["containerPort"])}
        assert ports, f"{address}: {component(w)} exposes no port {target}"
        flows |= {(src, component(w), p, sport.get("protocol", "TCP")) for p in ports}
    assert flows, f"{src} calls {address}: Service {host} selects no pod"
    return flows


def called_addresses(docs, w: dict, c: dict) -> list[str]:
    """The addresses a container calls: a lorafleet service's CALL_FLAGS (every occurrence),
    another container's in-cluster addresses in its environment."""
    args = command_line(c, docs)
    if args and args[0].startswith("services."):
        return [a.split("=", 1)[1] if "=" in a else args[i + 1]
                for i, a in enumerate(args) for f in CALL_FLAGS
                if a == f or a.startswith(f + "=")]
    found = []
    for value in env_of(c, docs).values():
        for m in ENV_ADDRESS.finditer(str(value)):
            if named(docs, "Service", m[2]) is not None:
                found.append(f"{m[2]}:{m[3]}")
    return found


def derived_flows(docs) -> set[tuple]:
    """Every flow the workloads' own flags and addresses call for."""
    flows = set()
    for w in workloads(docs):
        for c in pod_containers(w):
            for address in called_addresses(docs, w, c):
                flows |= service_flows(docs, component(w), address)
    for _, _, comp, args in service_containers(docs):
        flows.add(("prometheus", comp, int(flag(args, "--metrics-port")), "TCP"))
        if comp == "router":        # the one public endpoint: clients anywhere
            public = [host_port(flag(args, f))[1] for f in ("--listen", "--http-listen")
                      if flag(args, f)]
            flows |= {(src, comp, p, "TCP") for src in CALLERS for p in public}
    return flows


def allowance_flows(components: set[str]) -> set[tuple]:
    """What the policies allow on purpose beyond the flags (network-policies.yaml says why):
    every pod resolves names and may export traces; the store's object storage may be any
    pod's 9000 (MinIO wherever it runs) or any address on 443, so --s3-endpoint can move
    without a policy change."""
    flows = {("adapter-store", ep.name, 9000 if ep.ip is None else 443, "TCP")
             for ep in OUTSIDE if ep.name != "client"}
    if "minio" in components:
        flows.add(("adapter-store", "minio", 9000, "TCP"))
    for c in components:
        flows |= {(c, dns, 53, proto) for dns in ("kube-dns", "nodelocal-dns")
                  for proto in ("UDP", "TCP")}
        flows.add((c, "otel-collector", 4317, "TCP"))
    return flows


# ---- what the policies let through ----------------------------------------------------------

def peer_matches(peer: dict, ep: Endpoint, policy_ns: str) -> bool:
    if "ipBlock" in peer:
        block = peer["ipBlock"]
        inside = lambda cidr: ipaddress.ip_address(ep.ip) in ipaddress.ip_network(cidr)  # noqa: E731
        return ep.ip is not None and inside(block["cidr"]) and not any(map(inside, block.get("except", [])))
    if ep.ip is not None:
        return False
    ns_sel = peer.get("namespaceSelector")
    ns_ok = ep.ns == policy_ns if ns_sel is None else selects(ns_sel, {"kubernetes.io/metadata.name": ep.ns})
    return ns_ok and selects(peer.get("podSelector", {}), ep.labels)


def side_allows(policies, pod: Endpoint, peer: Endpoint, port: int, proto: str, direction: str) -> bool:
    """Whether `pod`'s policies let traffic to (Egress) or from (Ingress) `peer` through."""
    rules_key, peers_key = ("ingress", "from") if direction == "Ingress" else ("egress", "to")
    applying = [p for p in policies if p["metadata"].get("namespace", "") == pod.ns
                and direction in p["spec"].get("policyTypes", ["Ingress"])
                and selects(p["spec"]["podSelector"], pod.labels)]
    if not applying:
        return True
    for policy in applying:
        for rule in policy["spec"].get(rules_key) or []:
            ports = rule.get("ports") or [{}]
            port_ok = any(p.get("protocol", "TCP") == proto and p.get("port", port) == port for p in ports)
            peers = rule.get(peers_key)
            if port_ok and (not peers or any(peer_matches(x, peer, pod.ns) for x in peers)):
                return True
    return False


def allowed_flows(policies, inside, ports, sides=("Egress", "Ingress")) -> set[tuple]:
    """Every (src, dst, port, proto) that the policies let through on the given sides."""
    sources = inside + [ep for ep in OUTSIDE if ep.name in CALLERS]
    targets = inside + [ep for ep in OUTSIDE if ep.name != "client"]
    allowed = set()
    for src in sources:
        for dst in targets:
            if src in OUTSIDE and dst in OUTSIDE:
                continue
            for port in ports:
                for proto in ("TCP", "UDP"):
                    egress = "Egress" not in sides or src in OUTSIDE or \
                        side_allows(policies, src, dst, port, proto, "Egress")
                    ingress = "Ingress" not in sides or dst in OUTSIDE or \
                        side_allows(policies, dst, src, port, proto, "Ingress")
                    if egress and ingress:
                        allowed.add((src.name, dst.name, port, proto))
    return allowed


def pods_and_ports(docs) -> tuple[list[Endpoint], set[int]]:
    inside = [Endpoint(component(w), w["metadata"].get("namespace", ""),
                       w["spec"]["template"]["metadata"]["labels"]) for w in workloads(docs)]
    ports = {53, 443, 4317, 9000, 13133} | {p["containerPort"] for w in workloads(docs)
                                             for c in pod_containers(w) for p in c.get("ports", [])}
    return inside, ports


# ---- tests ----------------------------------------------------------------------------------

def test_replicas_told_of_their_peers_are_expected_to_reach_them(docs):
    """The derivation itself: a router with --peer needs router -> router on the peers'
    port (the base and production overlays run two replicas with --peer)."""
    (args,) = [a for _, _, comp, a in service_containers(docs) if comp == "router"]
    peers = flag(args, "--peer")
    assert (("router", "router", 7001, "TCP") in derived_flows(docs)) == (peers is not None)


def test_network_policies_allow_exactly_the_flows_the_manifests_call_for(docs):
    policies = of_kind(docs, "NetworkPolicy")
    assert any(p["spec"]["podSelector"] == {} and set(p["spec"]["policyTypes"]) == {"Ingress", "Egress"}
               and not p["spec"].get("ingress") and not p["spec"].get("egress") for p in policies), \
        "no default-deny NetworkPolicy"
    inside, ports = pods_and_ports(docs)
    names = {ep.name for ep in inside}
    needed = derived_flows(docs)
    expected = needed | allowance_flows(names)
    allowed = allowed_flows(policies, inside, ports)
    assert needed <= allowed, f"needed but denied: {sorted(needed - allowed)}"
    assert allowed == expected, f"unexpected: {sorted(allowed - expected)}\nmissing: {sorted(expected - allowed)}"
    # Between our own pods each side must be exact too, so no slack hides behind the other side.
    # Known one-sided slack, where the other side decides: the store may leave on 9000 to any
    # pod (MinIO wherever it runs), and the router's public ports are open to every client.
    between = {f for f in expected if {f[0], f[1]} <= names}
    public = {f[2] for f in needed if f[0] == "client"}
    slack = {"Egress": {("adapter-store", n, 9000, "TCP") for n in names},
             "Ingress": {(n, "router", p, "TCP") for n in names for p in public}}
    for side in ("Egress", "Ingress"):
        one_side = {f for f in allowed_flows(policies, inside, ports, (side,)) if {f[0], f[1]} <= names}
        assert one_side == between | slack[side], (side, sorted(one_side ^ (between | slack[side])))
