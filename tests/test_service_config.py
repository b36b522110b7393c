"""Every service refuses a bad configuration the same way: it exits 2 at once and names the
flag, before binding anything (the checks on the common flags are shared).

The refusals are `python -m services.NAME` runs, each a process of its own, forked from one
child per service that imported the service's modules once (tests/service_main.py): the
worker's import of torch is paid once, not once a run."""
from __future__ import annotations

import subprocess
import sys

import pytest

from tests.service_main import run_mains
from tests.support import MODEL_DIR, ROOT

SERVICES = {"worker": [], "router": [], "adapter_store": ["--model", str(MODEL_DIR)]}
BAD = [(["--tls-cert", "server.pem"], "--tls-cert and --tls-key go together"),
       (["--grace", "-1"], "--grace"),
       (["--listen", "7001"], "--listen"),
       (["--metrics-port", "70000"], "--metrics-port"),
       (["--log-level", "LOUD"], "--log-level")]
MISSING = [("router", ["--tenants", "no-such-tenants.yaml"], "--tenants no-such-tenants.yaml"),
           ("worker", ["--model", "no-such-model-dir"], "--model no-such-model-dir: ")]
WORKER_BAD = [(["--kernel-cache", "README.md"], "--kernel-cache README.md: not a directory"),
              (["--warmup", "sometimes"], "--warmup"),
              (["--frontend", "remote"], "--frontend"),
              (["--eviction", "lfu"], "--eviction"),
              (["--graph-mixed-tokens", "-1"], "--graph-mixed-tokens must be >= 0")]


@pytest.fixture(scope="module")
def refusals(tmp_path_factory):
    """{key: its run}: every refusal below, run once as `python -m services.NAME ARGS`."""
    bad = tmp_path_factory.mktemp("tenants") / "tenants.yaml"
    bad.write_text("tenants:\n  alice: {role: emperor}\n")
    runs = {("common", service, tuple(flags)): (service, [*SERVICES[service], "--metrics-port",
                                                          "0", *flags])
            for service in SERVICES for flags, _ in BAD}
    runs.update({("missing", service, tuple(flags)): (service, ["--metrics-port", "0", *flags])
                 for service, flags, _ in MISSING})
    runs[("malformed",)] = ("router", ["--metrics-port", "0", "--tenants", str(bad)])
    runs.update({("worker", tuple(flags)): ("worker", ["--metrics-port", "0", *flags])
                 for flags, _ in WORKER_BAD})
    return dict(zip(runs, run_mains(list(runs.values()), timeout=60)))


@pytest.mark.parametrize("service", list(SERVICES))
@pytest.mark.parametrize("flags,named", BAD)
def test_bad_common_flag_exits_2_naming_it(refusals, service, flags, named):
    proc = refusals[("common", service, tuple(flags))]
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert named in proc.stderr


def test_store_defaults_to_the_embedded_model_as_the_worker_does(monkeypatch):
    """The operator contract starts the store with --listen and --adapters-dir only: the base
    whose shapes it validates against is then the worker's default, the embedded tiny model;
    --base-config wins over --model."""
    from services.adapter_store.config import from_args, parser
    monkeypatch.chdir(ROOT)
    cfg = from_args(parser().parse_args(["--adapters-dir", "models/adapters"]), {})
    assert cfg.base_config == MODEL_DIR.relative_to(ROOT) / "config.json"
    other = ROOT / "models" / "adapters"
    with pytest.raises(ValueError, match="base model config"):
        from_args(parser().parse_args(["--base-config", str(other / "nope.json")]), {})


@pytest.mark.parametrize("service,flags,named", MISSING)
def test_a_missing_tenants_file_or_model_exits_2_naming_it(refusals, service, flags, named):
    """Files a service reads at start are checked with its flags: a one-line error and exit 2,
    not a traceback from inside the event loop."""
    proc = refusals[("missing", service, tuple(flags))]
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert named in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-2000:]


def test_a_malformed_tenants_file_exits_2_with_the_reason(refusals):
    proc = refusals[("malformed",)]
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "--tenants" in proc.stderr and "emperor" in proc.stderr, proc.stderr[-2000:]


def test_router_and_worker_take_the_store_address_from_the_environment(monkeypatch):
    """README: --store defaults to LORAFLEET_STORE where it is set, for both callers of the
    store (the router read only the flag)."""
    from services.router.config import parse_args as router_args
    from services.worker.config import parse_args as worker_args
    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("LORAFLEET_STORE", "10.0.0.9:7003")
    assert router_args([]).store == "10.0.0.9:7003"
    assert worker_args([]).store == "10.0.0.9:7003"
    assert router_args(["--store", "127.0.0.1:17003"]).store == "127.0.0.1:17003"


@pytest.mark.parametrize("flags,named", WORKER_BAD)
def test_the_worker_refuses_a_bad_kernel_cache_warmup_or_frontend(refusals, flags, named):
    proc = refusals[("worker", tuple(flags))]
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert named in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-2000:]


def test_the_worker_eviction_flag_reaches_its_config():
    from services.worker.config import parse_args
    assert parse_args([]).eviction == "lru"
    assert parse_args(["--eviction", "cost"]).eviction == "cost"


def test_the_worker_mixed_graph_flag_reaches_its_engine_options():
    from services.worker.config import parse_args
    assert parse_args([]).engine.graph_mixed_tokens == 1024
    assert parse_args(["--graph-mixed-tokens", "0"]).engine.graph_mixed_tokens == 0


def test_only_config_and_main_modules_read_the_environment():
    """Configuration is read once, in a service's config or main (issue 24): no module below
    them reads os.environ; they pass values down (the worker's PerfConfig among them)."""
    allowed = {"config.py", "__main__.py", "runtime.py", "cli.py"}
    readers = []
    for path in [*(ROOT / "services").rglob("*.py"), *(ROOT / "kernels").rglob("*.py")]:
        if "gen" in path.relative_to(ROOT).parts or path.name in allowed:
            continue
        text = path.read_text()
        if "os.environ" in text or "os.getenv" in text:
            readers.append(str(path.relative_to(ROOT)))
    assert readers == []


def test_the_policy_tests_run_without_torch():
    """The tests marked `policy` (cache policy, fair queue, quotas, placement, scheduler, k8s)
    import nothing of torch, triton, transformers or peft: `make test-policy` runs them with
    those unimportable (tests/no_torch.py), as a control-plane-only install would."""
    files = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").glob("test_*.py")
                   if "\npytestmark = pytest.mark.policy" in p.read_text())
    assert len(files) >= 6
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p",
                           "tests.no_torch", "-m", "policy", *files], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert " passed" in proc.stdout and "error" not in proc.stdout.splitlines()[-1]


def test_the_docs_name_only_files_that_exist():
    """Every repository path the README and docs/ARCHITECTURE.md name in backticks exists (the
    README once sent readers to a design document outside the repository)."""
    import re
    ignored = {line.strip().strip("/") for line in (ROOT / ".gitignore").read_text().splitlines()
               if line.strip() and not line.startswith("#") and "*" not in line}
    missing = []
    for doc in ("README.md", "docs/ARCHITECTURE.md"):
        for ref in re.findall(r"`([^`\s]+)`", (ROOT / doc).read_text()):
            path = ref.split(":")[0].rstrip(",.")
            if ("/" not in path or not re.fullmatch(r"[a-z0-9_.\-/]+", path)
                    or path.startswith(("/", "s3", "http", "file", "unix", "--"))):
                continue                 # flags, URLs, placeholders (DIR/NAME), globs
            if path.split("/")[0] in ignored:
                continue                 # made when the services run (state/, models/)
            if not (ROOT / path).exists() and not (ROOT / doc).parent.joinpath(path).exists():
                missing.append(f"{doc}: {path}")
    assert missing == []


def _wait_listening(port: int, host: str, timeout: float = 30.0) -> None:
    import socket
    import time
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        with socket.socket() as s:
            s.settimeout(0.5)
            if s.connect_ex((host, port)) == 0:
                return
        time.sleep(0.1)
    raise AssertionError(f"nothing listening on {host}:{port}")


def test_metrics_listen_on_the_listen_host_unless_told_otherwise(tmp_path):
    """A store on --listen 127.0.0.1 serves /metrics on 127.0.0.1 only (not on every
    interface: 127.0.0.2, another loopback address, is refused); --metrics-host widens it."""
    import socket
    from services.common.runtime import metrics_host
    from tests.support import free_port

    class Cfg:
        listen, metrics_host = "[::1]:7001", ""
    assert metrics_host(Cfg) == "::1"
    Cfg.listen, Cfg.metrics_host = ":7001", ""
    assert metrics_host(Cfg) == "0.0.0.0"
    for extra, reach in (([], False), (["--metrics-host", "0.0.0.0"], True)):
        port = free_port()
        proc = subprocess.Popen(
            [sys.executable, "-m", "services.adapter_store", "--model", str(MODEL_DIR),
             "--listen", f"127.0.0.1:{free_port()}", "--metrics-port", str(port),
             "--db", ":memory:", *extra], cwd=ROOT,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            _wait_listening(port, "127.0.0.1")
            with socket.socket() as s:
                s.settimeout(2)
                assert (s.connect_ex(("127.0.0.2", port)) == 0) is reach
        finally:
            proc.terminate()
            proc.wait(timeout=30)
