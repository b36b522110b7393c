"""The adapter store over S3 (moto's server on loopback): register from a bucket (the store
keeps its own copy of the validated bytes), cold load (tier SOURCE, read from the bucket: its
s3.get spans), warm hit (STORE_HOST), digests checked here; an object overwritten or deleted
after registration does not change what the version serves (the store's copy does, issue 41); a
failing and a silent endpoint give clean errors within the deadline.
"""
from __future__ import annotations

import json
import socket
import threading
import time
import urllib.request

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2

from services.common.gen.lorafleet.v1 import common_pb2
from tests.support import FreePort, MotoS3, S3_ENV, Service, health_status
from tests.test_store_support import (StoreClient, lora_tensors, peft_config, safetensors_bytes,
                                      sha256, write_base)

BUCKET = "lorafleet"
SECRET = "sekrit-never-logged-42"
SERVING = health_pb2.HealthCheckResponse.SERVING
SMALL = (peft_config(), lora_tensors())                                           # ~8 KiB
BIG_CFG = peft_config(r=64, lora_alpha=128, use_rslora=True, target_modules="all-linear")
BIG = (BIG_CFG, lora_tensors(64, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                  "up_proj", "down_proj")))                       # 512 KiB


def upload(s3, prefix: str, config: dict | None, tensors: dict | None) -> bytes:
    blob = safetensors_bytes(tensors) if tensors is not None else b""
    if config is not None:
        s3.put_object(Bucket=BUCKET, Key=f"{prefix}/adapter_config.json",
                      Body=json.dumps(config).encode())
    if tensors is not None:
        s3.put_object(Bucket=BUCKET, Key=f"{prefix}/adapter_model.safetensors", Body=blob)
    return blob


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("store-s3")
    moto = MotoS3(tmp)
    s3 = moto.client()
    s3.create_bucket(Bucket=BUCKET)
    metrics_port = FreePort()
    # 64 KiB host tier: SMALL stays, BIG never fits (every Fetch of it reads S3 again).
    store = Service("adapter_store", [
        "--base-config", str(write_base(tmp / "base")), "--db", str(tmp / "reg.sqlite"),
        "--s3-endpoint", moto.endpoint, "--bucket", BUCKET, "--host-cache-bytes", "65536",
        "--max-adapter-bytes", str(1 << 20), "--metrics-port", metrics_port,
        "--trace-file", str(tmp / "spans.jsonl")], tmp, env=S3_ENV)
    client = StoreClient(store.wait().addr)
    yield moto, s3, store, client, metrics_port, tmp
    client.close()
    assert store.terminate() == 0
    moto.stop()


def test_cold_then_warm(env):
    _, s3, store, client, metrics_port, tmp = env
    blob = upload(s3, "tenants/acme/v1", *SMALL)
    info = client.register("acme-v1", f"s3://{BUCKET}/tenants/acme/v1", owner="acme")
    assert info.state == "READY" and info.bytes == len(blob) and info.rank == 4
    traceparent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    header, got, digest = client.fetch("acme-v1", version=info.version,
                                       metadata=[("traceparent", traceparent)])
    assert header.tier == common_pb2.SOURCE and header.source_load_s > 0
    assert got == blob and digest == sha256(got) == sha256(blob)
    assert header.adapter.version == info.version and header.total_bytes == len(blob)
    assert json.loads(header.config_json)["r"] == 4
    header, got, digest = client.fetch("acme-v1")
    assert header.tier == common_pb2.STORE_HOST and header.source_load_s == 0
    assert got == blob and digest == sha256(blob)
    stats = client.stats()
    assert stats.host_hits >= 1 and stats.host_misses >= 1 and stats.source_loads.count >= 1
    spans = [json.loads(line) for line in (tmp / "spans.jsonl").read_text().splitlines()]
    fetch = [s for s in spans if s["name"] == "store.fetch"
             and s["trace_id"] == "0af7651916cd43dd8448eb211c80319c"]
    assert fetch and fetch[0]["attributes"]["lora.tier"] == "SOURCE"
    assert fetch[0]["attributes"]["lora.adapter_id"] == "acme-v1"
    gets = [s for s in spans if s["name"] == "s3.get" and s["trace_id"] == fetch[0]["trace_id"]]
    assert len(gets) == 2  # config + weights, children of the fetch (the source, read first)
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics").read().decode()
    assert 'lorafleet_cold_load_seconds_count{tier="source"}' in text
    assert 'lorafleet_cache_hits_total{tier="store_host"}' in text
    # one miss (the cold fetch) and one hit so far: the hit rate, and the adapter on the host tier
    rate = next(float(line.split()[-1]) for line in text.splitlines()
                if line.startswith('lorafleet_cache_hit_rate{tier="store_host"}'))
    assert rate == stats.host_hits / (stats.host_hits + stats.host_misses) > 0
    resident = next(float(line.split()[-1]) for line in text.splitlines()
                    if line.startswith("lorafleet_store_host_adapters "))
    assert resident == 1


def test_default_bucket(env):
    _, s3, _, client, _, _ = env
    blob = upload(s3, "shared/x", *SMALL)
    info = client.register("shared-x", "s3:///shared/x")
    assert info.source == f"s3://{BUCKET}/shared/x"
    assert client.fetch("shared-x")[1] == blob


def test_an_object_overwritten_or_deleted_after_registration_still_serves_its_version(env):
    """The version is the bytes registered: an object rewritten in the bucket (a valid
    adapter still) or deleted serves the registered bytes, from the store's copy (it was
    DATA_LOSS, then NOT_FOUND); a register --replace then makes the new bytes a new version."""
    _, s3, store, client, _, _ = env
    blob = upload(s3, "big", *BIG)
    info = client.register("big", f"s3://{BUCKET}/big")
    assert client.fetch("big")[0].tier == common_pb2.SOURCE
    tensors = dict(BIG[1])
    name = next(iter(tensors))
    tensors[name] = tensors[name] + np.float32(1.0)  # still a perfectly valid adapter
    upload(s3, "big", None, tensors)
    for _ in range(2):                               # BIG never fits the host tier
        header, got, digest = client.fetch("big", version=info.version)
        assert header.tier == common_pb2.SOURCE and got == blob and digest == sha256(blob)
    assert client.register("big", f"s3://{BUCKET}/big", replace=True).version != info.version
    upload(s3, "gone", SMALL[0], lora_tensors(seed=7))
    small = client.register("gone", f"s3://{BUCKET}/gone")
    s3.delete_object(Bucket=BUCKET, Key="gone/adapter_model.safetensors")
    assert client.fetch("gone", timeout=5)[0].adapter.version == small.version
    assert health_status(store.addr) == SERVING


def test_refusals_before_download(env):
    _, s3, _, client, _, _ = env
    s3.put_object(Bucket=BUCKET, Key="huge/adapter_config.json",
                  Body=json.dumps(peft_config()).encode())
    s3.put_object(Bucket=BUCKET, Key="huge/adapter_model.safetensors", Body=b"\0" * (2 << 20))
    code, details = client.error(client.register, "huge", f"s3://{BUCKET}/huge")
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "--max-adapter-bytes" in details
    s3.put_object(Bucket=BUCKET, Key="pickled/adapter_config.json",
                  Body=json.dumps(peft_config()).encode())
    s3.put_object(Bucket=BUCKET, Key="pickled/adapter_model.bin", Body=b"\x80\x04N.")
    code, details = client.error(client.register, "pickled", f"s3://{BUCKET}/pickled")
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "pickle" in details
    code, details = client.error(client.register, "empty", f"s3://{BUCKET}/nothing-here")
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "adapter_config.json: missing" in details


class BadEndpoint:
    """A TCP endpoint that either drops every connection ("close") or never answers ("hang")."""

    def __init__(self):
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.mode = "close"
        self.held: list[socket.socket] = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            if self.mode == "close":
                conn.close()
            else:
                self.held.append(conn)

    def stop(self):
        self.sock.close()
        for conn in self.held:
            conn.close()


def test_failing_and_silent_endpoint_within_deadline(tmp_path):
    bad = BadEndpoint()
    store = Service("adapter_store", [
        "--base-config", str(write_base(tmp_path / "base")), "--db", ":memory:",
        "--s3-endpoint", bad.url, "--bucket", BUCKET], tmp_path,
        env={**S3_ENV, "AWS_SECRET_ACCESS_KEY": SECRET})
    client = StoreClient(store.wait().addr)
    try:
        start = time.monotonic()
        code, details = client.error(client.register, "x", f"s3://{BUCKET}/x", timeout=8)
        assert code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED), details
        assert time.monotonic() - start < 8.5
        bad.mode = "hang"
        start = time.monotonic()
        code, details = client.error(client.register, "y", f"s3://{BUCKET}/y", timeout=1.5)
        assert code == grpc.StatusCode.DEADLINE_EXCEEDED, details
        assert time.monotonic() - start < 3
        assert health_status(store.addr) == SERVING
        assert SECRET not in store.log()
    finally:
        client.close()
        assert store.terminate() == 0
        bad.stop()
