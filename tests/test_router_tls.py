"""TLS: the three services with --tls-cert/--tls-key/--tls-ca talk mTLS to each other (router ->
store, router -> workers' residency streams and generation, worker -> store), and the router's
public endpoint admits only clients presenting a certificate from that CA (the client's and the
CLI's --tls-ca/--tls-cert/--tls-key)."""
from __future__ import annotations

import datetime
import ipaddress
import json
import pathlib
import subprocess
import sys
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.client.client import LorafleetClient
from tests.support import WAIT_OPTIONS, Service

pytestmark = pytest.mark.slow


def write_pki(d: pathlib.Path) -> dict[str, pathlib.Path]:
    """A CA, a certificate for the services (127.0.0.1, server and client use) and one for a
    client, as PEM files in d."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.timezone.utc)

    def name(cn):
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    def cert(subject, key, issuer, issuer_key, ca=False, san=None):
        b = (x509.CertificateBuilder().subject_name(name(subject)).issuer_name(name(issuer))
             .public_key(key.public_key()).serial_number(x509.random_serial_number())
             .not_valid_before(now - datetime.timedelta(minutes=5))
             .not_valid_after(now + datetime.timedelta(days=1))
             .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
        if san:
            b = b.add_extension(x509.SubjectAlternativeName(san), critical=False)
        if not ca:
            b = b.add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                       ExtendedKeyUsageOID.CLIENT_AUTH]),
                                critical=False)
        return b.sign(issuer_key, hashes.SHA256())

    def pem_key(key):
        return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                 serialization.NoEncryption())

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = cert("lorafleet test CA", ca_key, "lorafleet test CA", ca_key, ca=True)
    out = {"ca": d / "ca.pem"}
    out["ca"].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    san = [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]
    for who, alt in (("service", san), ("client", None)):
        key = ec.generate_private_key(ec.SECP256R1())
        c = cert(f"lorafleet {who}", key, "lorafleet test CA", ca_key, san=alt)
        out[who] = d / f"{who}.pem"
        out[who].write_bytes(c.public_bytes(serialization.Encoding.PEM))
        out[f"{who}_key"] = d / f"{who}.key"
        out[f"{who}_key"].write_bytes(pem_key(key))
    return out


def wait_tls(svc: Service, pki, timeout: float = 120.0) -> Service:
    creds = grpc.ssl_channel_credentials(pki["ca"].read_bytes(), pki["client_key"].read_bytes(),
                                         pki["client"].read_bytes())
    end = time.monotonic() + timeout
    with grpc.secure_channel(svc.addr, creds, options=WAIT_OPTIONS) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        while time.monotonic() < end:
            assert svc.proc.poll() is None, svc.log()
            try:
                if stub.Check(health_pb2.HealthCheckRequest(), timeout=1).status == 1:
                    return svc
            except grpc.RpcError:
                time.sleep(0.1)
    raise TimeoutError(svc.log())


def test_mtls_between_services_and_for_clients(lora_fleet, tmp_path):
    base, adapters = lora_fleet
    pki = write_pki(tmp_path)
    tls = ["--tls-cert", str(pki["service"]), "--tls-key", str(pki["service_key"]),
           "--tls-ca", str(pki["ca"])]
    store = wait_tls(Service("adapter_store", ["--adapters-dir", str(adapters), "--model",
                                               str(base), "--db", ":memory:", *tls], tmp_path), pki)
    worker = wait_tls(Service("worker", ["--model", str(base), "--store", store.addr,
                                         "--device", "cpu", *tls], tmp_path), pki)
    router = wait_tls(Service("router", ["--store", store.addr, "--worker", worker.addr, *tls],
                              tmp_path), pki)
    services = [router, worker, store]
    try:
        with LorafleetClient(router.addr, "acme", timeout=30, ca=str(pki["ca"]),
                             cert=str(pki["client"]), key=str(pki["client_key"])) as c:
            resp = c.generate(adapter="a03", prompt_ids=[3, 4, 5], max_new_tokens=3)
            assert resp.adapter_id == "a03" and len(resp.token_ids) == 3
            assert c.model_info().num_workers == 1
        for kw in ({"ca": str(pki["ca"])}, {}):                   # no client cert; plaintext
            with LorafleetClient(router.addr, "acme", timeout=5, **kw) as c:
                with pytest.raises(grpc.RpcError) as err:
                    c.generate(adapter="a03", prompt_ids=[3, 4, 5], max_new_tokens=3)
                assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        exe = pathlib.Path(sys.executable).parent / "lorafleet"
        cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "services.client.cli"]
        done = subprocess.run([*cmd, "--router", router.addr, "--tls-ca", str(pki["ca"]),
                               "--tls-cert", str(pki["client"]), "--tls-key",
                               str(pki["client_key"]), "generate", "--adapter", "a04",
                               "--prompt-ids", "3,4,5", "--max-new-tokens", "2", "--json"],
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        assert len(json.loads(done.stdout)["token_ids"]) == 2
    finally:
        assert all(s.terminate() == 0 for s in services)
