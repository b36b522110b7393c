"""The adapter-store down, through the running services: a tenant that never resolved a shared
adapter (or a shared alias) before still reaches it on the worker that holds it, from another
tenant's earlier answer; another tenant's private adapter is never served that way; a name
nobody resolved gets UNAVAILABLE naming the unreachable store."""
from __future__ import annotations

import grpc
import pytest

from services.client.client import LorafleetClient
from tests.conftest import Stack

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
