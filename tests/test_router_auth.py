"""Through the running services with a --tenants file: tokens name tenants, only admins manage
adapters, a tenant sees its own and shared adapters and gets the unknown-id NOT_FOUND for another
tenant's, quotas answer RESOURCE_EXHAUSTED with a RetryInfo delay, a user's stats show its own
tenant only, and a moved alias or version is picked up at once (the resolution cache is
invalidated, not waited out)."""
from __future__ import annotations

import json
import time

import grpc
import pytest

from services.client.client import LorafleetClient
from services.common.errors import retry_after_of
from services.common.gen.lorafleet.v1 import adapter_store_pb2 as spb, adapter_store_pb2_grpc
from services.common.gen.lorafleet.v1 import worker_pb2 as wpb, worker_pb2_grpc
from tests.conftest import Stack

pytestmark = pytest.mark.slow

TENANTS = {
    "tenants": {
        "ops": {"tokens": ["tok-ops"], "role": "admin"},
        "acme": {"tokens": ["tok-acme"], "weight": 2.0},
        "beta": {"tokens": ["tok-beta"]},
        "slow": {"tokens": ["tok-slow"], "quota": {"requests_per_s": 2, "request_burst": 1}},
    },
    "default_quota": {"requests_per_s": 1000, "max_in_flight": 64},
}
PROMPT = dict(prompt_ids=[5, 6, 7], max_new_tokens=3)


@pytest.fixture(scope="module")
def stack(lora_fleet, tmp_path_factory):
    base, adapters = lora_fleet
    log_dir = tmp_path_factory.mktemp("auth")
    tenants = log_dir / "tenants.json"
    tenants.write_text(json.dumps(TENANTS))
    # A long resolve TTL: anything seen "at once" below is invalidation, not expiry.
    s = Stack(base, adapters, log_dir, router_args=["--tenants", str(tenants),
                                                     "--insecure-internal",
                                                     "--resolve-ttl", "600"])
    yield s
    assert all(code == 0 for code in s.terminate())


def client(stack, token=None) -> LorafleetClient:
    return LorafleetClient(stack.router.addr, token, timeout=30)


def rpc_error(fn, *args, **kw) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        fn(*args, **kw)
    return info.value


def test_missing_or_unknown_token_is_unauthenticated(stack):
    for token in (None, "tok-nobody"):
        with client(stack, token) as c:
            for call in (lambda: c.generate(adapter="a00", **PROMPT), c.adapters, c.stats):
                assert rpc_error(call).code() == grpc.StatusCode.UNAUTHENTICATED
    with client(stack, "tok-acme") as c:
        assert c.generate(adapter="a00", **PROMPT).adapter_id == "a00"


def test_only_admins_register_or_delete(stack):
    with client(stack, "tok-acme") as c:
        err = rpc_error(c.register, "mine", "file://a01", tenant="acme")
        assert err.code() == grpc.StatusCode.PERMISSION_DENIED
        assert rpc_error(c.delete, "a00").code() == grpc.StatusCode.PERMISSION_DENIED
    with client(stack, "tok-ops") as c:
        assert c.register("ops-tmp", "file://a01").id == "ops-tmp"
        c.delete("ops-tmp")


def test_private_adapters_are_invisible_to_other_tenants(stack):
    with client(stack, "tok-ops") as ops:
        info = ops.register("acme-private", "file://a01", tenant="acme")
        assert info.owner == "acme" and not info.shared
    with client(stack, "tok-acme") as acme:
        assert acme.generate(adapter="acme-private", **PROMPT).adapter_id == "acme-private"
        mine = {a.id for a in acme.adapters()}
        assert {"acme-private", "a00", "a49"} <= mine
    with client(stack, "tok-beta") as beta:
        hidden = rpc_error(beta.generate, adapter="acme-private", **PROMPT)
        unknown = rpc_error(beta.generate, adapter="no-such-adapter", **PROMPT)
        assert hidden.code() == unknown.code() == grpc.StatusCode.NOT_FOUND
        assert (hidden.details().replace("acme-private", "X")
                == unknown.details().replace("no-such-adapter", "X"))
        visible = {a.id for a in beta.adapters()}
        assert "acme-private" not in visible and {"a00", "a49"} <= visible   # shared: seen
        assert beta.generate(adapter="a07", **PROMPT).adapter_id == "a07"


def test_quota_answers_resource_exhausted_with_retry_delay(stack):
    with client(stack, "tok-slow") as c:
        c.generate(adapter="a00", **PROMPT)
        err = rpc_error(c.generate, adapter="a00", **PROMPT)
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        delay = retry_after_of(err)
        assert delay is not None and 0 < delay <= 0.5 + 0.05, delay
        time.sleep(delay + 0.05)
        assert c.generate(adapter="a00", **PROMPT).stop_reason
    with client(stack, "tok-ops") as ops:
        slow = {t.tenant: t for t in ops.stats().tenants}["slow"]
        assert (slow.requests, slow.throttled) == (3, 1)      # the refused one counts too


def test_a_tenant_sees_only_its_own_row_of_the_stats(stack):
    """Per-tenant usage is the operators' (admins') to see: a user's GetStats carries its own
    tenant row beside the fleet-wide figures, an admin's every tenant's."""
    for token in ("tok-acme", "tok-beta"):
        with client(stack, token) as c:
            c.generate(adapter="a00", **PROMPT)
    with client(stack, "tok-beta") as beta:
        seen = beta.stats()
        assert [t.tenant for t in seen.tenants] == ["beta"]
        assert seen.adapters.registered > 0 and seen.cache
    with client(stack, "tok-ops") as ops:
        assert {"acme", "beta"} <= {t.tenant for t in ops.stats().tenants}


def test_alias_move_is_seen_at_once(stack):
    with client(stack, "tok-ops") as ops, client(stack, "tok-acme") as acme:
        ops.register("acme-v1", "file://a02", tenant="acme", aliases=["acme-chat"])
        assert acme.generate(adapter="acme-chat", **PROMPT).adapter_id == "acme-v1"
        with pytest.raises(grpc.RpcError) as err:          # the alias is taken
            ops.register("acme-v2", "file://a03", tenant="acme", aliases=["acme-chat"])
        assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS
        ops.register("acme-v2", "file://a03", tenant="acme", aliases=["acme-chat"],
                     replace=True)                          # ... and moves, told to
        assert acme.generate(adapter="acme-chat", **PROMPT).adapter_id == "acme-v2"
        with pytest.raises(grpc.RpcError) as err:          # the id exists
            ops.register("acme-v1", "file://a04", tenant="acme")
        assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS
        old = ops.register("acme-v1", "file://a04", tenant="acme", replace=True)  # new version
        resp = acme.generate(adapter="acme-v1", **PROMPT)
        assert (resp.adapter_id, resp.adapter_version) == ("acme-v1", old.version)


def test_version_moved_behind_the_routers_back_is_retried(stack):
    """The store gets a new version directly (as through another router); the worker, sent the
    cached old version, gets FAILED_PRECONDITION from the store; the router resolves again."""
    with client(stack, "tok-ops") as ops, client(stack, "tok-acme") as acme:
        first = ops.register("acme-v3", "file://a05", tenant="acme")
        assert acme.generate(adapter="acme-v3", **PROMPT).adapter_version == first.version
        with grpc.insecure_channel(stack.workers[0].addr) as ch:   # not cached on the worker
            worker_pb2_grpc.WorkerStub(ch).OffloadAdapter(
                wpb.OffloadAdapterRequest(id="acme-v3", to_host=False), timeout=10)
        with grpc.insecure_channel(stack.store.addr) as ch:
            second = adapter_store_pb2_grpc.AdapterStoreStub(ch).Register(spb.RegisterRequest(
                id="acme-v3", source="file://a06", owner="acme", replace=True),
                timeout=30).adapter
        assert second.version != first.version
        resp = acme.generate(adapter="acme-v3", **PROMPT)
        assert (resp.adapter_id, resp.adapter_version) == ("acme-v3", second.version)


def test_a_pinned_version_and_an_alias_rolled_back(stack):
    """NAME@VERSION runs a version the store keeps even after a newer one is registered, and
    an alias pointed at ID@VERSION (a rollback) runs that version until pointed back."""
    with client(stack, "tok-ops") as ops, client(stack, "tok-acme") as acme:
        v1 = ops.register("acme-pin", "file://a07", tenant="acme").version
        first = acme.generate(adapter="acme-pin", **PROMPT)
        v2 = ops.register("acme-pin", "file://a08", tenant="acme", replace=True).version
        assert v1 != v2 and acme.generate(adapter="acme-pin", **PROMPT).adapter_version == v2
        pinned = acme.generate(adapter=f"acme-pin@{v1}", **PROMPT)
        assert (pinned.adapter_version, list(pinned.token_ids)) == (v1, list(first.token_ids))
        info = ops.set_alias("acme-stable", f"acme-pin@{v1}")
        assert (info.version, info.pinned) == (v1, True)
        assert acme.generate(adapter="acme-stable", **PROMPT).adapter_version == v1
        assert ops.set_alias("acme-stable", "acme-pin").version == v2      # follows again
        assert acme.generate(adapter="acme-stable", **PROMPT).adapter_version == v2
        with pytest.raises(grpc.RpcError) as err:                    # a version never kept
            acme.generate(adapter="acme-pin@0123456789abcdef", **PROMPT)
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
        with pytest.raises(grpc.RpcError) as err:                    # admins only
            acme.set_alias("acme-stable", f"acme-pin@{v1}")
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
        with client(stack, "tok-beta") as beta, pytest.raises(grpc.RpcError) as err:
            beta.generate(adapter=f"acme-pin@{v1}", **PROMPT)          # another tenant's
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
