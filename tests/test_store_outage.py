"""The adapter-store down, through the running services: a tenant that never resolved a shared
adapter (or a shared alias) before still reaches it on the worker that holds it, from another
tenant's earlier answer; another tenant's private adapter is never served that way; a name
nobody resolved gets UNAVAILABLE naming the unreachable store."""
from __future__ import annotations

import time

import grpc
import pytest

from services.client.client import LorafleetClient
from tests.conftest import Stack
from tests.support import Service

pytestmark = pytest.mark.slow

PROMPT = dict(prompt_ids=[5, 6, 7], max_new_tokens=2)


def _error(fn, **kw) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        fn(**kw)
    return info.value


def test_store_down_answers_from_other_tenants_resolutions(lora_fleet, tmp_path):
    base, adapters = lora_fleet
    stack = Stack(base, adapters, tmp_path)            # dev mode: the token names the tenant
    try:
        with LorafleetClient(stack.router.addr, "alice", timeout=30) as a:
            a.register("alice-own", "file://a01", tenant="alice")
            a.register("team", "file://a02", aliases=["team-chat"])      # shared
            for name in ("a03", "team-chat", "alice-own"):   # resolved by alice, now resident
                a.generate(adapter=name, **PROMPT)
        stack.store.kill()
        with LorafleetClient(stack.router.addr, "bob", timeout=30) as b:
            assert b.generate(adapter="a03", **PROMPT).adapter_id == "a03"
            assert b.generate(adapter="team-chat", **PROMPT).adapter_id == "team"
            private = _error(b.generate, adapter="alice-own", **PROMPT)
            unseen = _error(b.generate, adapter="a04", **PROMPT)
        with LorafleetClient(stack.router.addr, "alice", timeout=30) as a:
            assert a.generate(adapter="alice-own", **PROMPT).adapter_id == "alice-own"
        assert private.code() in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.UNAVAILABLE)
        assert "alice-own" not in private.details() or "unreachable" in private.details()
        for err in (private, unseen):
            if err.code() == grpc.StatusCode.UNAVAILABLE:
                assert f"adapter store unreachable at {stack.store.addr}" in err.details(), \
                    err.details()
        assert unseen.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        stack.terminate()


def _until_served(client, name: str, timeout: float = 60.0) -> None:
    end = time.monotonic() + timeout
    while True:
        try:
            assert client.generate(adapter=name, **PROMPT).adapter_id == name
            return
        except grpc.RpcError as err:
            if err.code() != grpc.StatusCode.UNAVAILABLE or time.monotonic() > end:
                raise
            time.sleep(0.5)


def test_an_admin_write_keeps_the_other_names_outage_fallback(lora_fleet, tmp_path):
    """Issue 41, defect 7: Register, SetAlias and DeleteAdapter dropped every cached answer, so
    after one admin write a store outage failed every tenant's resident adapters UNAVAILABLE.
    Now a write drops only the names it touched (in every tenant's scope): the others still
    serve through the outage, the touched ones are not answered from before the write; and the
    outage is logged once when it starts and once when the store is back, not per request."""
    base, adapters = lora_fleet
    stack = Stack(base, adapters, tmp_path)
    try:
        with LorafleetClient(stack.router.addr, "alice", timeout=30) as a:
            a.register("alice-own", "file://a01", tenant="alice")
            a.register("team", "file://a02", aliases=["team-chat"])
            for name in ("a03", "team-chat", "alice-own", "a06"):
                a.generate(adapter=name, **PROMPT)
            a.register("fresh", "file://a05")                  # three admin writes, each
            a.set_alias("team-chat", "a04")                    # touching one name
            a.delete("a06")
        port = stack.store.port
        stack.store.kill()
        with LorafleetClient(stack.router.addr, "bob", timeout=30) as b:
            for _ in range(5):
                assert b.generate(adapter="a03", **PROMPT).adapter_id == "a03"
            moved = _error(b.generate, adapter="team-chat", **PROMPT)
            deleted = _error(b.generate, adapter="a06", **PROMPT)
        with LorafleetClient(stack.router.addr, "alice", timeout=30) as a:
            assert a.generate(adapter="alice-own", **PROMPT).adapter_id == "alice-own"
            assert a.generate(adapter="a03", **PROMPT).adapter_id == "a03"
            during = _error(a.set_alias, alias="x", target="a03")   # a write in the outage
            assert a.generate(adapter="a03", **PROMPT).adapter_id == "a03"
        assert moved.code() == deleted.code() == grpc.StatusCode.UNAVAILABLE
        assert during.code() == grpc.StatusCode.UNAVAILABLE
        stack.store = Service("adapter_store", ["--adapters-dir", str(adapters), "--model",
                                                str(base), "--db", ":memory:"], tmp_path,
                              port=port).wait()
        with LorafleetClient(stack.router.addr, "bob", timeout=30) as b:
            _until_served(b, "a07")         # the router's channel reconnects after its backoff
        log = stack.router.log()
        assert log.count("adapter store unreachable at") == 1, log[-3000:]
        assert log.count("answers again") == 1, log[-3000:]
    finally:
        stack.terminate()
