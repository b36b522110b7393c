"""A production configuration never runs with its internal calls open by accident (issue 41:
with --tenants set, the store still answered `Resolve` for any tenant from anyone who reached
it). A router with --tenants, or a store or worker listening beyond loopback, refuses to start
(exit 2, naming the way out) without a service token or mTLS, unless --insecure-internal says
so; `make run` (no --tenants, loopback) needs nothing, and on a --host beyond loopback it gives
its three services one fresh token. Nothing here binds a non-loopback address: the refusals
come from the configuration, before anything binds."""
from __future__ import annotations

import json
import re
import subprocess
import sys
import types

import pytest

from services import devstack
from services.adapter_store.config import from_args, parser as store_parser
from services.router.config import parse_args as router_args
from services.worker.config import parse_args as worker_args
from tests.support import DEMO_ADAPTERS, MODEL_DIR, ROOT, free_port

REFUSED = "--insecure-internal runs with them open"


@pytest.fixture
def tenants(tmp_path):
    path = tmp_path / "tenants.json"
    path.write_text(json.dumps({"tenants": {"acme": {"tokens": ["tok-acme"]}}}))
    return str(path)


@pytest.fixture
def token(tmp_path):
    path = tmp_path / "token"
    path.write_text("s3cret\n")
    return str(path)


def test_a_router_with_tenants_and_open_internal_calls_exits_2_before_binding(tenants):
    port = free_port()
    proc = subprocess.run([sys.executable, "-m", "services.router", "--listen",
                           f"127.0.0.1:{port}", "--metrics-port", "0", "--tenants", tenants],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "--tenants (production mode) needs authenticated internal calls" in proc.stderr
    assert "--service-token-file" in proc.stderr and REFUSED in proc.stderr, proc.stderr


def test_a_router_with_tenants_runs_with_a_token_mtls_or_the_explicit_flag(tenants, token):
    base = ["--tenants", tenants]
    assert router_args([*base, "--service-token-file", token]).tenants == tenants
    assert router_args([*base, "--tls-ca", "ca.pem", "--tls-cert", "c.pem", "--tls-key",
                        "k.pem"]).common.tls_ca == "ca.pem"
    assert router_args([*base, "--insecure-internal"]).common.insecure_internal
    assert router_args([]).tenants is None                   # dev mode: nothing needed
    with pytest.raises(ValueError, match="--tenants"):
        router_args([*base, "--tls-ca", "ca.pem"])           # verifies, but presents no cert


def store(*flags: str):
    return from_args(store_parser().parse_args(["--adapters-dir", str(DEMO_ADAPTERS), "--model",
                                                str(MODEL_DIR), *flags]), {})


def worker(*flags: str):
    return worker_args(["--model", str(MODEL_DIR), *flags])


@pytest.mark.parametrize("build", [store, worker], ids=["store", "worker"])
def test_a_store_or_worker_beyond_loopback_needs_auth_or_the_explicit_flag(build, token):
    for listen in ("0.0.0.0:7003", "[::]:7003", ":7003"):
        with pytest.raises(ValueError, match=re.escape(f"--listen {listen} is reachable beyond")):
            build("--listen", listen)
        assert build("--listen", listen, "--service-token-file", token).common.listen == listen
        assert build("--listen", listen, "--insecure-internal").common.insecure_internal
    for listen in ("127.0.0.1:7003", "127.0.0.2:7003", "[::1]:7003", "localhost:7003"):
        assert build("--listen", listen).common.listen == listen     # loopback: as before


def test_make_run_beyond_loopback_gives_its_services_one_token(tmp_path):
    a = types.SimpleNamespace(host="0.0.0.0", port_base=7001, http_port=8080, metrics_base=0,
                              model=str(MODEL_DIR), adapters_dir=str(DEMO_ADAPTERS), db=":memory:")
    token = devstack.write_token(str(tmp_path))
    specs = devstack.service_specs(a, sys.executable, None, token)
    for name, cmd, _ in specs:
        assert cmd[cmd.index("--service-token-file") + 1] == token, name
    store_cmd, worker_cmd, router_cmd = (cmd[3:] for _, cmd, _ in specs)
    assert from_args(store_parser().parse_args(store_cmd), {}).common.service_token_file == token
    assert worker_args(worker_cmd).common.service_token_file == token
    assert router_args(router_cmd).common.service_token_file == token
    a.host = "127.0.0.1"
    assert all("--service-token-file" not in cmd
               for _, cmd, _ in devstack.service_specs(a, sys.executable, None, None))
