"""Issue 41, defect 2: the router's status page (`/status.json`, `/status`) shows a --tenants
file's user only what the API would let it use. `?token=tok-alice` listed bob's private
adapter in `residency` while the API answers alice NOT_FOUND for it (the same answer as for an
adapter that does not exist, so that existence is not disclosed). Now a user sees the shared
adapters and its own, an admin every one; and the Workers table's resident counts are the
figures the Adapters panel sums (they disagreed: by id against by version). Real processes:
store, worker and router with a tenants file, the page rendered by headless Chromium."""
from __future__ import annotations

import html
import json
import re
import urllib.error
import urllib.request

import grpc
import pytest

from services.client.client import LorafleetClient
from tests.conftest import Stack
from tests.support import FreePort
from tests.test_status_page import CHROMIUM, render

pytestmark = pytest.mark.slow
PROMPT = dict(prompt_ids=[5, 6, 7], max_new_tokens=2)
TENANTS = {"tenants": {"alice": {"tokens": ["tok-alice"], "role": "user"},
                       "bob": {"tokens": ["tok-bob"], "role": "user"},
                       "ops": {"tokens": ["tok-ops"], "role": "admin"}}}


@pytest.fixture(scope="module")
def fleet(lora_fleet, tmp_path_factory):
    base, adapters = lora_fleet
    tmp = tmp_path_factory.mktemp("isolation")
    (tmp / "tenants.json").write_text(json.dumps(TENANTS))
    port = FreePort("127.0.0.1:")
    stack = Stack(base, adapters, tmp, router_args=[
        "--tenants", str(tmp / "tenants.json"), "--http-listen", port,
        "--insecure-internal"])
    stack.http = port.port
    try:
        with LorafleetClient(stack.router.addr, "tok-ops", timeout=30) as ops:
            ops.register("bob-secret", "file://a10", tenant="bob")
            ops.register("alice-secret", "file://a11", tenant="alice")
        for token, own in (("tok-bob", "bob-secret"), ("tok-alice", "alice-secret")):
            with LorafleetClient(stack.router.addr, token, timeout=30) as c:
                for name in (own, "a00"):
                    c.generate(adapter=name, **PROMPT)
        yield stack
    finally:
        stack.terminate()


def status(port: int, token: str | None = None, header: bool = False) -> dict:
    query = f"?token={token}" if token and not header else ""
    req = urllib.request.Request(f"http://127.0.0.1:{port}/status.json{query}", headers={
        "Authorization": f"Bearer {token}"} if header else {})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.load(r)


def listed(s: dict) -> set[str]:
    return {r["adapter"] for r in s["residency"]}


def test_a_user_sees_only_the_adapters_the_api_would_serve_it(fleet):
    with LorafleetClient(fleet.router.addr, "tok-alice", timeout=30) as alice:
        with pytest.raises(grpc.RpcError) as err:
            alice.generate(adapter="bob-secret", **PROMPT)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    assert listed(status(fleet.http, "tok-ops")) >= {"bob-secret", "alice-secret", "a00"}
    alice = status(fleet.http, "tok-alice")
    assert listed(alice) == {"alice-secret", "a00"}, alice["residency"]
    assert "bob-secret" not in json.dumps(alice)
    bob = status(fleet.http, "tok-bob", header=True)
    assert listed(bob) == {"bob-secret", "a00"}, bob["residency"]
    assert "alice-secret" not in json.dumps(bob)
    with pytest.raises(urllib.error.HTTPError) as refused:
        status(fleet.http, "tok-nobody")
    assert refused.value.code == 401
    assert "secret" not in refused.value.read().decode()


def test_the_workers_table_counts_what_the_adapters_panel_sums(fleet):
    s = status(fleet.http, "tok-ops")
    (worker,) = s["workers"]
    assert worker["gpu_resident"] == int(s["adapters"]["gpu_resident"]) == 3, s
    assert worker["host_resident"] == int(s["adapters"]["worker_host"]), s


@pytest.mark.skipif(CHROMIUM is None, reason="no Chromium on PATH (chromium or "
                    "chromium-browser): `make browser` installs it")
def test_the_rendered_page_shows_alice_nothing_of_bobs(fleet, tmp_path):
    url = f"http://127.0.0.1:{fleet.http}/status?token=tok-alice"
    dom = render(url, tmp_path / "profile", "--dump-dom").stdout
    body = re.sub(r"<(script|style)\b.*?</\1>", "", dom, flags=re.S)
    cells = [c.strip() for c in html.unescape(re.sub(r"<[^>]+>", "|", body)).split("|")]
    assert "alice-secret" in cells and "a00" in cells, dom[-2000:]
    assert "bob-secret" not in dom
