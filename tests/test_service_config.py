"""Every service refuses a bad configuration the same way: it exits 2 at once and names the
flag, before binding anything (the checks on the common flags are shared)."""
from __future__ import annotations

import subprocess
import sys

import pytest

from tests.support import MODEL_DIR, ROOT

SERVICES = {"worker": [], "router": [], "adapter_store": ["--model", str(MODEL_DIR)]}
BAD = [(["--tls-cert", "server.pem"], "--tls-cert and --tls-key go together"),
       (["--grace", "-1"], "--grace"),
       (["--listen", "7001"], "--listen"),
       (["--metrics-port", "70000"], "--metrics-port"),
       (["--log-level", "LOUD"], "--log-level")]


@pytest.mark.parametrize("service", list(SERVICES))
@pytest.mark.parametrize("flags,named", BAD)
def test_bad_common_flag_exits_2_naming_it(service, flags, named):
    proc = subprocess.run([sys.executable, "-m", f"services.{service}", *SERVICES[service],
                           "--metrics-port", "0", *flags], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
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


@pytest.mark.parametrize("service,flags,named", [
    ("router", ["--tenants", "no-such-tenants.yaml"], "--tenants no-such-tenants.yaml"),
    ("worker", ["--model", "no-such-model-dir"], "--model no-such-model-dir: "),
])
def test_a_missing_tenants_file_or_model_exits_2_naming_it(service, flags, named, tmp_path):
    """Files a service reads at start are checked with its flags: a one-line error and exit 2,
    not a traceback from inside the event loop."""
    proc = subprocess.run([sys.executable, "-m", f"services.{service}", "--metrics-port", "0",
                           *flags], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert named in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-2000:]


def test_a_malformed_tenants_file_exits_2_with_the_reason(tmp_path):
    bad = tmp_path / "tenants.yaml"
    bad.write_text("tenants:\n  alice: {role: emperor}\n")
    proc = subprocess.run([sys.executable, "-m", "services.router", "--metrics-port", "0",
                           "--tenants", str(bad)], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)
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


@pytest.mark.parametrize("flags,named", [
    (["--kernel-cache", "README.md"], "--kernel-cache README.md: not a directory"),
    (["--warmup", "sometimes"], "--warmup"),
    (["--frontend", "remote"], "--frontend"),
])
def test_the_worker_refuses_a_bad_kernel_cache_warmup_or_frontend(flags, named):
    proc = subprocess.run([sys.executable, "-m", "services.worker", "--metrics-port", "0",
                           *flags], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert named in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-2000:]
