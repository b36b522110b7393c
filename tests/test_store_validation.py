"""Bad adapters and bad names, each through the running adapter-store process: a clear error with
the right status naming the field or tensor, the store stays SERVING, good adapters keep serving,
and an --adapters-dir with bad adapters among good ones starts (good REGISTERED, a bad config
FAILED at once, bad weights FAILED on first use).
"""
from __future__ import annotations

import os
import pathlib
import pickle

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2

from tests.support import DEMO_ADAPTERS, MODEL_DIR, Service, health_status
from tests.test_store_support import (StoreClient, bf16_blob, good_adapter, join, key,
                                      lora_tensors, peft_config, safetensors_bytes, sha256,
                                      split, write_adapter, write_base)

INVALID = grpc.StatusCode.INVALID_ARGUMENT


class Boom:
    """Unpickling this would create the marker file: proof that a pickle was never opened."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _good_blob() -> bytes:
    return safetensors_bytes(lora_tensors())


def _overlapping() -> bytes:
    header, data = split(_good_blob())
    names = sorted((n for n in header if n != "__metadata__"),
                   key=lambda n: header[n]["data_offsets"][0])
    begin, end = header[names[1]]["data_offsets"]
    header[names[1]]["data_offsets"] = [begin - 4, end - 4]
    return join(header, data)


def _with(tensor_key: str, array) -> dict:
    tensors = lora_tensors()
    tensors[tensor_key] = array
    return tensors


def _nan() -> dict:
    a = lora_tensors()[key(1, "v_proj", "B")].copy()
    a[3, 1] = np.nan
    return _with(key(1, "v_proj", "B"), a)


def _inf_f16() -> dict:
    tensors = lora_tensors(dtype=np.float16)
    tensors[key(0, "q_proj", "A")][0, 0] = np.inf
    return tensors


# name -> (config, tensors or None, raw blob or None, text the error must contain)
BAD = {
    "truncated": (peft_config(), None, _good_blob()[:-10], "truncated"),
    "huge-header": (peft_config(), None, (1 << 40).to_bytes(8, "little") + b"{}",
                    "header length 1099511627776 exceeds"),
    "bad-json": (peft_config(), None, (9).to_bytes(8, "little") + b"{not json" + b"\0" * 8,
                 "header is not valid JSON"),
    "overlap": (peft_config(), None, _overlapping(), "overlaps"),
    "missing-field": ({k: v for k, v in peft_config().items() if k != "r"}, lora_tensors(), None,
                      "missing required field 'r'"),
    "unknown-field": (peft_config(frobnicate=True), lora_tensors(), None,
                      "unknown field 'frobnicate' set to true"),
    "unknown-zero": (peft_config(frobnicate=0), lora_tensors(), None,
                     "unknown field 'frobnicate' set to 0"),
    "rank-too-big": (peft_config(r=200), lora_tensors(), None, "r: 200"),
    "dora": (peft_config(use_dora=True), lora_tensors(), None, "use_dora"),
    "modules-to-save": (peft_config(modules_to_save=["lm_head"]), lora_tensors(), None,
                        "modules_to_save"),
    "bias": (peft_config(bias="all"), lora_tensors(), None, "bias"),
    "wrong-shape": (peft_config(), _with(key(0, "q_proj", "A"), np.zeros((4, 65), np.float32)),
                    None, f"tensor '{key(0, 'q_proj', 'A')}': shape [4, 65], expected [4, 64]"),
    "rank-mismatch": (peft_config(r=8), lora_tensors(r=4), None, "for r=8"),
    "missing-tensor": (peft_config(target_modules=["q_proj", "v_proj", "k_proj"]),
                       lora_tensors(), None, "k_proj lora_A: missing"),
    "bad-target": (peft_config(target_modules=["q_proj", "c_attn"]), lora_tensors(), None,
                   "no module 'c_attn'"),
    "nan": (peft_config(), _nan(), None, f"tensor '{key(1, 'v_proj', 'B')}': 1 NaN/Inf"),
    "inf-f16": (peft_config(), _inf_f16(), None, "NaN/Inf"),
    "int-dtype": (peft_config(), _with(key(0, "q_proj", "A"), np.zeros((4, 64), np.int32)),
                  None, "dtype 'I32' is not supported"),
    "no-config": (None, lora_tensors(), None, "adapter_config.json: missing"),
    "layer-out-of-range": (peft_config(layers_to_transform=[5]), lora_tensors(), None,
                           "layers_to_transform: layer 5 out of range"),
    "nan-bf16": (peft_config(), None, bf16_blob(_nan()), "NaN/Inf"),
}
# Accepted variants: adapter-name key segment, regex targets, one layer, BF16, rsLoRA.
GOOD = {
    "named-keys": (peft_config(), {k.replace(".weight", ".default.weight"): v
                                   for k, v in lora_tensors().items()}, None),
    "regex-targets": (peft_config(target_modules=r".*\.(q_proj|v_proj)"), lora_tensors(), None),
    "one-layer": (peft_config(layers_to_transform=1, use_rslora=True),
                  lora_tensors(layers=(1,)), None),
    "bf16": (peft_config(), None, bf16_blob(lora_tensors())),
    # a newer PEFT's fields, left at their "off" values: accepted (and logged)
    "newer-peft": (peft_config(frobnicate=None, use_future_lora=False, future_modules=[],
                               future_pattern={}), lora_tensors(), None),
}


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("store-validation")
    root = tmp / "adapters"
    outside = good_adapter(tmp / "outside" / "secret")
    for name in ("good-a", "good-b"):
        good_adapter(root / name, seed=len(name), r=8 if name == "good-b" else 4)
    for name, (config, tensors, blob, _) in BAD.items():
        write_adapter(root / name, config, tensors, blob)
    for name, (config, tensors, blob) in GOOD.items():
        write_adapter(root / name, config, tensors, blob)
    marker = tmp / "UNPICKLED"
    write_adapter(root / "pickle-only", peft_config())
    (root / "pickle-only" / "adapter_model.bin").write_bytes(pickle.dumps(Boom(str(marker))))
    os.symlink(outside, root / "escape")
    write_adapter(root / "file-link", peft_config())
    os.symlink(outside / "adapter_model.safetensors", root / "file-link" /
               "adapter_model.safetensors")
    (root / "not-an-adapter").mkdir()
    store = Service("adapter_store", ["--base-config", str(write_base(tmp / "base")),
                                      "--adapters-dir", str(root), "--db", ":memory:",
                                      "--background-validate-threads", "0"], tmp)  # first use
    client = StoreClient(store.wait().addr)
    yield store, client, marker
    client.close()
    assert store.terminate() == 0


# BAD adapters whose config is fine: their weights are read on first use, not at start
WEIGHT_FAULTS = {"truncated", "huge-header", "bad-json", "overlap", "wrong-shape",
                 "rank-mismatch", "missing-tensor", "nan", "inf-f16", "int-dtype", "nan-bf16"}


def test_directory_with_bad_adapters_starts(env):
    """At start a bad config (or file) is FAILED and the rest REGISTERED (no blob read); the
    first use of each reads and validates it: good ones READY, bad weights FAILED naming the
    tensor, FAILED_PRECONDITION to the request that used it."""
    store, client, _ = env
    states = {a.id: (a.state, a.failure_reason) for a in client.list(all_tenants=True)}
    for name in ("good-a", "good-b", *GOOD, *WEIGHT_FAULTS):
        assert states[name] == ("REGISTERED", ""), (name, states[name])
    for name, (*_, text) in BAD.items():
        if name not in WEIGHT_FAULTS:
            assert states[name][0] == "FAILED" and text in states[name][1], (name, states[name])
    assert "pickle" in states["pickle-only"][1]
    assert "outside --adapters-dir" in states["escape"][1]
    assert "outside --adapters-dir" in states["file-link"][1]
    assert "not-an-adapter" not in states
    for name in ("good-a", "good-b", *GOOD):
        assert client.resolve(name).state == "READY"
    for name in WEIGHT_FAULTS:
        code, details = client.error(client.resolve, name)
        assert code == grpc.StatusCode.FAILED_PRECONDITION and BAD[name][3] in details, (
            name, details)
    states = {a.id: (a.state, a.failure_reason) for a in client.list(all_tenants=True)}
    for name in ("good-a", "good-b", *GOOD):
        assert states[name] == ("READY", ""), (name, states[name])
    for name, (*_, text) in BAD.items():
        assert states[name][0] == "FAILED" and text in states[name][1], (name, states[name])
    log = store.log()
    assert "adapters dir: 'dora' FAILED: use_dora" in log
    assert "adapter 'nan' FAILED on first use: tensor" in log
    assert "adapter 'good-a' validated on first use" in log
    assert ("newer-peft: adapter_config.json fields unknown to this store, left unset, "
            "ignored: frobnicate, use_future_lora, future_modules, future_pattern") in log


def test_accepted_variants(env):
    _, client, _ = env
    header, blob, digest = client.fetch("one-layer")
    assert header.adapter.use_rslora and header.adapter.rank == 4 and digest == sha256(blob)
    assert {t.name.split(".")[4] for t in header.tensors} == {"1"}
    header, blob, _ = client.fetch("bf16")
    assert {t.dtype for t in header.tensors} == {"BF16"} and len(header.tensors) == 8
    header, _, _ = client.fetch("named-keys")
    assert all(".lora_A.default.weight" in t.name or ".lora_B.default.weight" in t.name
               for t in header.tensors)
    assert list(client.resolve("regex-targets").target_modules) == ["q_proj", "v_proj"]


@pytest.mark.parametrize("name", [*BAD, "pickle-only"])
def test_bad_adapter_refused_through_register(env, name):
    _, client, marker = env
    code, details = client.error(client.register, f"api-{name}", f"file://{name}")
    text = BAD[name][3] if name in BAD else "holds only adapter_model.bin, a pickle"
    assert code == INVALID and text in details, (code, details)
    assert not marker.exists()


@pytest.mark.parametrize("adapter_id,source,field", [
    ("../x", "file://good-a", "id"), ("/etc", "file://good-a", "id"),
    ("http://evil.example/a", "file://good-a", "id"), ("", "file://good-a", "id"),
    ("ok-1", "../x", "source"), ("ok-2", "/etc", "source"),
    ("ok-3", "http://evil.example/a", "source"), ("ok-4", "file:///etc/passwd", "source"),
    ("ok-5", "file://../x", "source"), ("ok-6", "file://good-a/../../x", "source"),
    ("ok-7", "file://escape", "resolves outside --adapters-dir"),
    ("ok-8", "file://file-link", "resolves outside --adapters-dir"),
    ("ok-9", "s3://../x", "source"), ("ok-10", "", "source"),
])
def test_names_shaped_like_paths_or_urls(env, adapter_id, source, field):
    _, client, _ = env
    code, details = client.error(client.register, adapter_id, source)
    assert code == INVALID and field in details, (code, details)


def test_bad_owner_alias_and_lookup_names(env):
    _, client, _ = env
    code, details = client.error(client.register, "ok", "file://good-a", owner="a/b")
    assert code == INVALID and details.startswith("owner:")
    code, details = client.error(client.register, "ok", "file://good-a", aliases=["../up"])
    assert code == INVALID and details.startswith("aliases:")
    code, details = client.error(client.resolve, "../x")
    assert code == INVALID and details.startswith("name:")
    code, details = client.error(client.fetch, "/etc/passwd")
    assert code == INVALID and details.startswith("id:")


def test_missing_source_directory(env):
    _, client, _ = env
    code, details = client.error(client.register, "nowhere", "file://no-such-dir")
    assert code == INVALID and "no such adapter directory" in details


def test_failed_adapter_is_failed_precondition(env):
    _, client, _ = env
    code, details = client.error(client.resolve, "dora")
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "use_dora" in details
    code, details = client.error(client.fetch, "dora")
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "use_dora" in details


def test_store_serving_and_good_adapters_still_work(env):
    store, client, marker = env
    assert health_status(store.addr) == health_pb2.HealthCheckResponse.SERVING
    info = client.register("fresh", "file://good-b", owner="t1")
    assert info.state == "READY" and info.rank == 8 and list(info.target_modules) == [
        "q_proj", "v_proj"]
    header, blob, digest = client.fetch("fresh")
    on_disk = (pathlib.Path(store.log_path).parent / "adapters" / "good-b" /
               "adapter_model.safetensors").read_bytes()
    assert blob == on_disk and digest == sha256(on_disk) and header.total_bytes == len(blob)
    for t in header.tensors:  # offsets are absolute in the blob
        assert len(blob[t.offset:t.offset + t.nbytes]) == t.nbytes
    assert client.fetch("good-a")[2] == sha256(
        (pathlib.Path(store.log_path).parent / "adapters" / "good-a" /
         "adapter_model.safetensors").read_bytes())
    assert not marker.exists()
    assert store.proc.poll() is None


@pytest.mark.skipif(not (MODEL_DIR / ".complete").exists(), reason="demo model not generated")
def test_demo_adapters_validate(tmp_path):
    """The PEFT-trained demo adapters (tools/make_tiny_model.py) are accepted against their base."""
    store = Service("adapter_store", ["--model", str(MODEL_DIR), "--adapters-dir",
                                      str(DEMO_ADAPTERS), "--db", ":memory:"], tmp_path)
    client = StoreClient(store.wait().addr)
    try:
        adapters = client.list(all_tenants=True)
        assert adapters and all(client.resolve(a.id).state == "READY" for a in adapters)
    finally:
        client.close()
        assert store.terminate() == 0
