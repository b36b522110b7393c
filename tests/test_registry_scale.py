"""10,000 adapters (issue 27): the real store, worker and router on loopback with an
--adapters-dir of 10,000 tiny-model adapters (one real adapter hard-linked; one with a NaN
weight that only the full validation finds), listed in pages through the router over gRPC and
through the CLI: counts, order, no duplicates, filters, AIP-158 tokens; the NaN adapter fails
on use with FAILED_PRECONDITION while the others serve."""
from __future__ import annotations

import json
import subprocess
import sys
import time

import grpc
import pytest

from bench.stack.registry import adapter_id, make_fleet
from services.client.client import LorafleetClient
from tests.conftest import Stack
from tests.support import MODEL_DIR

pytestmark = pytest.mark.slow
N = 10_000
NAN = 5000
INVALID = grpc.StatusCode.INVALID_ARGUMENT


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("registry-scale")
    adapters = make_fleet(tmp, N, nan=(NAN,))
    started = time.monotonic()
    stack = Stack(MODEL_DIR, adapters, tmp,        # validated on first use, as a user's
                  store_args=("--background-validate-threads", "0"))
    start_s = time.monotonic() - started
    with LorafleetClient(stack.router.addr, "acme", 60.0) as admin:
        for i in range(3):                       # dev mode: any tenant registers
            admin.register(f"acme-{i}", f"file://{adapter_id(i)}", tenant="acme")
    yield stack, start_s
    assert all(code == 0 for code in stack.terminate())


def _pages(client: LorafleetClient, **kw) -> list[list[str]]:
    pages, token = [], ""
    while True:
        page = client.adapters_page(page_token=token, **kw)
        pages.append([a.id for a in page.adapters])
        token = page.next_page_token
        if not token:
            return pages


def test_store_starts_without_reading_the_weights(fleet):
    stack, start_s = fleet
    assert start_s < 60, start_s
    log = stack.store.log()
    assert f"adapters dir: {N} of {N} scanned" in log and "Traceback" not in log


def test_pages_through_the_router(fleet):
    stack, _ = fleet
    with LorafleetClient(stack.router.addr, "acme", 60.0) as c:
        pages = _pages(c)
        assert [len(p) for p in pages] == [1000] * 10 + [3]
        ids = [i for p in pages for i in p]
        assert ids == sorted(set(ids)) and len(ids) == N + 3
        small = _pages(c, page_size=777)
        assert all(len(p) == 777 for p in small[:-1]) and sum(map(len, small)) == N + 3
        assert [i for p in small for i in p] == ids
        assert len(c.adapters_page(page_size=50_000).adapters) == 1000    # the maximum
        assert [len(p) for p in _pages(c, prefix="a012")] == [100]
        assert _pages(c, owner="acme") == [["acme-0", "acme-1", "acme-2"]]
    with LorafleetClient(stack.router.addr, "globex", 60.0) as other:
        ids = [i for p in _pages(other) for i in p]
        assert len(ids) == N and not any(i.startswith("acme-") for i in ids)
        assert _pages(other, owner="acme") == [[]]


def test_registration_between_pages_is_neither_skipped_nor_repeated(fleet):
    stack, _ = fleet
    with LorafleetClient(stack.router.addr, "acme", 60.0) as c:
        first = c.adapters_page(page_size=1000)
        c.register("zz-late", f"file://{adapter_id(1)}")               # after the cursor
        c.register("a00000-early", f"file://{adapter_id(1)}")          # before it
        ids = [a.id for a in first.adapters]
        token = first.next_page_token
        while token:
            page = c.adapters_page(page_size=1000, page_token=token)
            ids += [a.id for a in page.adapters]
            token = page.next_page_token
        assert ids == sorted(set(ids)) and "zz-late" in ids and "a00000-early" not in ids
        for name in ("zz-late", "a00000-early"):
            c.delete(name)


def test_bad_tokens_and_sizes_are_invalid_argument(fleet):
    stack, _ = fleet
    with LorafleetClient(stack.router.addr, "acme", 60.0) as c:
        token = c.adapters_page(page_size=10).next_page_token
        for kw, field in ((dict(page_token="not-a-token"), "page_token"),
                          (dict(page_token=token, prefix="a0"), "page_token"),
                          (dict(page_token=token[:-3] + "xyz"), "page_token"),
                          (dict(page_size=-1), "page_size"),
                          (dict(prefix="../etc"), "prefix")):
            with pytest.raises(grpc.RpcError) as err:
                c.adapters_page(**kw)
            assert err.value.code() == INVALID and field in err.value.details(), kw
    with LorafleetClient(stack.router.addr, "globex", 60.0) as other:
        with pytest.raises(grpc.RpcError) as err:      # bound to the tenant that listed
            other.adapters_page(page_token=token)
        assert err.value.code() == INVALID


def test_cli_lists_every_page(fleet):
    stack, _ = fleet
    cli = [sys.executable, "-m", "services.client.cli", "--router", stack.router.addr,
           "--token", "acme", "adapters", "--json"]
    out = json.loads(subprocess.run(cli, capture_output=True, text=True, timeout=60,
                                    check=True).stdout)["adapters"]
    assert len(out) == N + 3 and {"id", "owner", "rank", "state"} <= set(out[0])
    ids = [a["id"] for a in out]
    assert ids == sorted(set(ids))
    paged = json.loads(subprocess.run([*cli, "--page-size", "2500"], capture_output=True,
                                      text=True, timeout=60, check=True).stdout)["adapters"]
    assert [a["id"] for a in paged] == ids
    few = json.loads(subprocess.run([*cli, "--limit", "5", "--prefix", "a09"],
                                    capture_output=True, text=True, timeout=60,
                                    check=True).stdout)["adapters"]
    assert [a["id"] for a in few] == [adapter_id(i) for i in range(9000, 9005)]


def test_nan_adapter_fails_on_use_and_the_others_serve(fleet):
    stack, _ = fleet
    bad = adapter_id(NAN)
    with LorafleetClient(stack.router.addr, "globex", 60.0) as c:
        assert c.adapters(prefix=bad)[0].state == "REGISTERED"
        with pytest.raises(grpc.RpcError) as err:
            c.generate("hello", adapter=bad, max_new_tokens=2)
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "NaN" in err.value.details() and bad in err.value.details()
        listed = c.adapters(prefix=bad)[0]
        assert listed.state == "FAILED" and "NaN" in listed.failure_reason
        for i in (NAN - 1, NAN + 1, N - 1):
            resp = c.generate("hello", adapter=adapter_id(i), max_new_tokens=2)
            assert len(resp.token_ids) == 2 and resp.adapter_id == adapter_id(i)
        assert c.adapters(prefix=adapter_id(N - 1))[0].state == "READY"
        with pytest.raises(grpc.RpcError) as err:           # still FAILED, still precise
            c.generate("hello", adapter=bad, max_new_tokens=2)
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
