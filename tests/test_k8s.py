"""Offline checks of deploy/k8s: each kustomization renders, validates strictly against the
Kubernetes 1.30 schemas, and keeps the invariants operators rely on (hardened pods, gRPC probes,
PDBs, drain times, worker discovery, no real credentials; the network flows are
tests/test_k8s_network.py's).

Needs `kubectl` (built-in kustomize) on PATH; no cluster is contacted.
"""
from __future__ import annotations

import base64
import functools
import pathlib
import re
import shutil
import subprocess

import pytest

pytestmark = pytest.mark.policy     # torch-free: `make test-policy`

yaml = pytest.importorskip("yaml")
kubernetes_validate = pytest.importorskip("kubernetes_validate")

K8S = pathlib.Path(__file__).resolve().parent.parent / "deploy" / "k8s"
TARGETS = ["base", "overlays/dev", "overlays/gpu", "overlays/autoscale"]
# custom resources kubernetes-validate has no schema for: their structure is checked by
# tests/test_k8s_monitoring.py
CRDS = {("monitoring.coreos.com/v1", "ServiceMonitor"), ("keda.sh/v1alpha1", "ScaledObject")}
K8S_VERSION = "1.30.0"  # schemas shipped with kubernetes-validate; native gRPC probes are GA
SERVICES = {"services.router": "router", "services.adapter_store": "adapter-store",
            "services.worker": "worker"}
# Provided by the operator outside the manifests (README), except where an overlay creates them.
EXTERNAL = {"Secret": {"lorafleet-s3", "lorafleet-tenants", "lorafleet-service-token"},
            "PersistentVolumeClaim": {"lorafleet-models"}}


@functools.cache
def render(target: str) -> tuple[dict, ...]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl not on PATH: cannot render the kustomizations (kustomize is built in)")
    out = subprocess.run([kubectl, "kustomize", str(K8S / target)], capture_output=True,
                         text=True, timeout=30, check=False)
    assert out.returncode == 0, f"kubectl kustomize {target} failed:\n{out.stderr}"
    return tuple(d for d in yaml.safe_load_all(out.stdout) if d)


@pytest.fixture(params=TARGETS)
def target(request) -> str:
    return request.param


@pytest.fixture
def docs(target) -> tuple[dict, ...]:
    return render(target)


# ---- helpers: reading rendered objects ----------------------------------------------------

def of_kind(docs, kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


def named(docs, kind: str, name: str) -> dict | None:
    return next((d for d in of_kind(docs, kind) if d["metadata"]["name"] == name), None)


def workloads(docs) -> list[dict]:
    return [d for d in docs if d["kind"] in ("Deployment", "Job")]


def pod_containers(workload: dict) -> list[dict]:
    spec = workload["spec"]["template"]["spec"]
    return spec.get("initContainers", []) + spec["containers"]


def selects(selector: dict, labels: dict) -> bool:
    """A LabelSelector (matchLabels + matchExpressions) against a label set."""
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for e in selector.get("matchExpressions", []):
        present, value = e["key"] in labels, labels.get(e["key"])
        ok = {"In": present and value in e.get("values", []),
              "NotIn": not present or value not in e.get("values", []),
              "Exists": present, "DoesNotExist": not present}[e["operator"]]
        if not ok:
            return False
    return True


def expand(text: str, env: dict) -> str:
    """Kubernetes' $(VAR) expansion in args and env values."""
    return re.sub(r"\$\((\w+)\)", lambda m: env.get(m[1], m[0]), text)


def env_of(container: dict, docs) -> dict:
    maps = {d["metadata"]["name"]: d.get("data", {}) for d in of_kind(docs, "ConfigMap")}
    env = {}
    for src in container.get("envFrom", []):
        env.update(maps[src["configMapRef"]["name"]] if "configMapRef" in src else {})
    for var in container.get("env", []):
        ref = var.get("valueFrom", {}).get("configMapKeyRef")
        if "value" in var:
            env[var["name"]] = expand(var["value"], env)
        elif ref:
            env[var["name"]] = maps[ref["name"]][ref["key"]]
    return env


def command_line(container: dict, docs) -> list[str]:
    env = env_of(container, docs)
    return [expand(a, env) for a in container.get("command", []) + container.get("args", [])]


def flag(args: list[str], name: str) -> str | None:
    for i, arg in enumerate(args):
        if arg == name and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    return None


def service_containers(docs):
    """(workload, container, component, args) for each lorafleet service container."""
    for w in workloads(docs):
        for c in pod_containers(w):
            args = command_line(c, docs)
            if args and args[0] in SERVICES:
                yield w, c, SERVICES[args[0]], args


def host_port(address: str) -> tuple[str, int]:
    """`host:port` or `scheme://host[:port]` -> (host, port)."""
    m = re.fullmatch(r"(?:(\w+)://)?([^:/]+)(?::(\d+))?/?", address)
    assert m, f"not an address: {address}"
    return m[2], int(m[3] or {"https": 443, "http": 80}[m[1]])


# ---- schema validation ----------------------------------------------------------------------

def test_manifests_validate_strictly(docs):
    errors = []
    for d in docs:
        if (d["apiVersion"], d["kind"]) in CRDS:
            continue
        try:
            kubernetes_validate.validate(d, K8S_VERSION, strict=True)
        except Exception as exc:  # noqa: BLE001 - collect every failure, report them together
            errors.append(f"{d['kind']}/{d['metadata'].get('name')}: {getattr(exc, 'message', exc)}")
    assert not errors, "\n".join(errors)


def test_references_resolve(docs):
    have = {(d["kind"], d["metadata"]["name"]) for d in docs}
    for w in workloads(docs):
        spec = w["spec"]["template"]["spec"]
        refs = [("ConfigMap", v["configMap"]["name"]) for v in spec.get("volumes", []) if "configMap" in v]
        refs += [("Secret", v["secret"]["secretName"]) for v in spec.get("volumes", []) if "secret" in v]
        refs += [("PersistentVolumeClaim", v["persistentVolumeClaim"]["claimName"])
                 for v in spec.get("volumes", []) if "persistentVolumeClaim" in v]
        for c in pod_containers(w):
            refs += [("ConfigMap", s["configMapRef"]["name"]) for s in c.get("envFrom", [])]
            for var in c.get("env", []):
                for key, kind in (("configMapKeyRef", "ConfigMap"), ("secretKeyRef", "Secret")):
                    if key in var.get("valueFrom", {}):
                        refs.append((kind, var["valueFrom"][key]["name"]))
        for kind, name in refs:
            assert (kind, name) in have or name in EXTERNAL.get(kind, ()), \
                f"{w['metadata']['name']} refers to missing {kind} {name}"


# ---- pods ---------------------------------------------------------------------------------

def test_every_container_is_hardened_and_bounded(docs):
    for w in workloads(docs):
        where = w["metadata"]["name"]
        pod = w["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True, where
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}, where
        assert pod.get("automountServiceAccountToken") is False, where
        for c in pod_containers(w):
            sc, res = c.get("securityContext", {}), c.get("resources", {})
            assert sc.get("runAsNonRoot") is True and sc.get("runAsUser") == 10001, (where, sc)
            assert sc.get("readOnlyRootFilesystem") is True, (where, sc)
            assert sc.get("allowPrivilegeEscalation") is False, (where, sc)
            assert sc.get("capabilities", {}).get("drop") == ["ALL"], (where, sc)
            assert not sc.get("capabilities", {}).get("add"), (where, sc)
            assert sc.get("seccompProfile") == {"type": "RuntimeDefault"}, (where, sc)
            for kind in ("requests", "limits"):
                assert {"cpu", "memory"} <= set(res.get(kind, {})), (where, c["name"], kind)


def test_service_containers_use_grpc_probes_on_their_port(docs):
    found = set()
    for w, c, component, args in service_containers(docs):
        found.add(component)
        port = host_port(flag(args, "--listen"))[1]
        probes = ["readinessProbe", "livenessProbe"] + (["startupProbe"] if component == "worker" else [])
        for probe in probes:
            assert c.get(probe, {}).get("grpc", {}).get("port") == port, (component, probe)
        metrics = int(flag(args, "--metrics-port"))
        ports = {p["containerPort"] for p in c["ports"]}
        assert {port, metrics} <= ports, (component, ports)
        annotations = w["spec"]["template"]["metadata"].get("annotations", {})
        assert annotations.get("prometheus.io/port") == str(metrics), component
        assert flag(args, "--otlp-endpoint") == "http://otel-collector:4317", component
    assert found == set(SERVICES.values())


def pre_stop_seconds(container: dict) -> float:
    """How long a preStop hook delays SIGTERM: `sleep N` (exec) or the native sleep action."""
    hook = container.get("lifecycle", {}).get("preStop", {})
    if "sleep" in hook:
        return float(hook["sleep"]["seconds"])
    command = hook.get("exec", {}).get("command", [])
    assert not command or command[0] == "sleep", f"cannot time preStop {command}"
    return float(command[1]) if command else 0.0


def test_drain_fits_in_the_termination_grace_period(docs):
    for w, c, component, args in service_containers(docs):
        budget = w["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
        assert budget > float(flag(args, "--grace")) + pre_stop_seconds(c), (component, budget)


def test_worker_gpu_request_only_outside_dev(target, docs):
    for w, c, component, args in service_containers(docs):
        gpus = {kind: c["resources"].get(kind, {}).get("nvidia.com/gpu") for kind in ("requests", "limits")}
        if component != "worker":
            assert gpus == {"requests": None, "limits": None}, component
        elif target == "overlays/dev":
            assert gpus == {"requests": None, "limits": None}
            assert (flag(args, "--device"), flag(args, "--dtype")) == ("cpu", "float32")
            assert flag(args, "--model") == "/app/models/tiny-llama"
        else:
            assert gpus == {"requests": 1, "limits": 1}
            assert flag(args, "--device") == "cuda"


def test_router_tenants_outside_dev_only(target, docs):
    (router_args,) = [a for _, _, comp, a in service_containers(docs) if comp == "router"]
    tenants = flag(router_args, "--tenants")
    assert (tenants is None) == (target == "overlays/dev"), tenants


# ---- services, discovery, disruption budgets ---------------------------------------------

def test_every_deployment_has_a_pdb_that_lets_drains_proceed(docs):
    pdbs = of_kind(docs, "PodDisruptionBudget")
    for dep in of_kind(docs, "Deployment"):
        labels = dep["spec"]["template"]["metadata"]["labels"]
        mine = [p["spec"] for p in pdbs if selects(p["spec"]["selector"], labels)]
        assert len(mine) == 1, dep["metadata"]["name"]
        allowed = mine[0].get("maxUnavailable", dep["spec"]["replicas"] - mine[0].get("minAvailable", 0))
        assert isinstance(allowed, int) and allowed >= 1, (dep["metadata"]["name"], mine[0])


def test_every_service_selects_pods_that_expose_its_ports(docs):
    for svc in of_kind(docs, "Service"):
        pods = [d for d in of_kind(docs, "Deployment")
                if selects({"matchLabels": svc["spec"]["selector"]}, d["spec"]["template"]["metadata"]["labels"])]
        assert pods, f"Service {svc['metadata']['name']} selects no Deployment"
        for port in svc["spec"]["ports"]:
            exposed = {p.get(k) for d in pods for c in pod_containers(d) for p in c.get("ports", [])
                       for k in ("name", "containerPort")}
            assert port.get("targetPort", port["port"]) in exposed, (svc["metadata"]["name"], port)


def test_every_container_port_is_one_the_service_listens_on(docs):
    """A declared container port has a flag that makes the process listen there (the dev
    overlay's router once declared the HTTP port 8080 without --http-listen)."""
    listen_flags = ("--listen", "--http-listen", "--metrics-port")
    for _, c, component, args in service_containers(docs):
        bound = {host_port(flag(args, f))[1] if ":" in (flag(args, f) or "") else
                 int(flag(args, f)) for f in listen_flags if flag(args, f)}
        for port in c.get("ports", []):
            assert port["containerPort"] in bound, (component, port, sorted(bound))


def test_in_cluster_addresses_are_services(docs):
    for _, _, component, args in service_containers(docs):
        for name in ("--store", "--worker", "--otlp-endpoint", "--s3-endpoint"):
            address = flag(args, name)
            if address is None or "." in host_port(address)[0]:
                continue  # absent, or outside the cluster (S3 on AWS)
            host, port = host_port(address)
            svc = named(docs, "Service", host)
            assert svc is not None, f"{component} {name}={address}: no Service {host}"
            assert port in {p["port"] for p in svc["spec"]["ports"]}, (component, name, address)


def test_router_discovers_workers_through_a_headless_service(docs):
    (router_args,) = [a for _, _, comp, a in service_containers(docs) if comp == "router"]
    host, port = host_port(flag(router_args, "--worker"))
    svc = named(docs, "Service", host)
    assert svc is not None and svc["spec"].get("clusterIP") == "None", host
    assert port in {p["port"] for p in svc["spec"]["ports"]}
    workers = [w for w, _, comp, _ in service_containers(docs) if comp == "worker"]
    assert workers and all(selects({"matchLabels": svc["spec"]["selector"]},
                                   w["spec"]["template"]["metadata"]["labels"]) for w in workers)


# ---- internal authentication ----------------------------------------------------------------

def test_every_service_authenticates_internal_calls_with_one_shared_token(target, docs):
    """Each service reads --service-token-file from a mount of the one token Secret, so the
    router's and the workers' calls to the workers and the store carry it and are checked."""
    secrets = set()
    for w, c, comp, args in service_containers(docs):
        path = flag(args, "--service-token-file")
        assert path, f"{comp}: no --service-token-file"
        assert "--insecure-internal" not in args, comp     # internal calls never open here
        mount = next((m for m in c.get("volumeMounts", [])
                      if path.startswith(m["mountPath"].rstrip("/") + "/")), None)
        assert mount and mount.get("readOnly"), f"{comp}: {path} is not on a read-only mount"
        volume = next(v for v in w["spec"]["template"]["spec"]["volumes"]
                      if v["name"] == mount["name"])
        key = path[len(mount["mountPath"].rstrip("/")) + 1:]
        assert any(i["path"] == key for i in volume["secret"].get("items", [])), (comp, volume)
        secrets.add(volume["secret"]["secretName"])
    assert secrets == {"lorafleet-service-token"}
    made = named(docs, "Secret", "lorafleet-service-token")
    assert (made is not None) == (target == "overlays/dev")   # elsewhere the operator's


# ---- secrets --------------------------------------------------------------------------------

AWS_KEY_ID = re.compile(r"\b(AKIA|ASIA)[0-9A-Z]{16}\b")
AWS_SECRET = re.compile(r"(?<![A-Za-z0-9/+])[A-Za-z0-9/+]{40}(?![A-Za-z0-9/+=])")


def test_no_real_credentials(target, docs):
    for secret in of_kind(docs, "Secret"):
        assert target == "overlays/dev", f"Secret {secret['metadata']['name']} outside overlays/dev"
        values = [base64.b64decode(v).decode() for v in secret.get("data", {}).values()]
        values += list(secret.get("stringData", {}).values())
        assert all("dev" in v for v in values), "dev Secrets must look obviously dev-only"
    for path in K8S.rglob("*"):
        if path.is_file() and "overlays/dev" not in path.relative_to(K8S).as_posix():
            text = path.read_text()
            assert not AWS_KEY_ID.search(text) and not AWS_SECRET.search(text), path
