"""The router's live status page (services/router/status_page.py) on the shared observed
stack's HTTP port (tests/observed.py): /status.json carries the run's figures, and /status,
rendered by a real headless Chromium (its script run, status.json fetched and drawn), shows
them: the workers, the tenants with their request counts, Jain's index, the cache tiers, the
charts as SVG. The page fetches nothing but status.json from the router.

Needs Chromium (`chromium` or `chromium-browser` on PATH): `make browser` installs it from
Debian's packages (the Dockerfile's base); without it the browser test is skipped, naming
that target."""
from __future__ import annotations

import html
import json
import re
import shutil
import subprocess
import urllib.request

import pytest

pytestmark = pytest.mark.slow

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def get(port: int, path: str) -> tuple[str, str]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as r:
        return r.headers["Content-Type"], r.read().decode()


def test_status_json_has_the_fleet_and_the_tenants(observed):
    kind, body = get(observed.http, "/status.json")
    assert kind.startswith("application/json")
    s = json.loads(body)
    tenants = {t["tenant"]: t for t in s["tenants"]}
    assert {k: int(tenants[k]["requests"]) for k in observed.requests} == observed.requests
    assert int(tenants["alpha"]["tokens_served"]) > 0
    assert float(tenants["alpha"]["p99_latency_s"]) > 0
    assert 0 < s["jain_index"] <= 1
    (worker,) = s["workers"]
    assert worker["address"] == observed.stack.workers[0].addr and worker["live"]
    assert worker["gpu_resident"] == 3
    assert {r["adapter"] for r in s["residency"]} == {"pirate", "poet", "acme-support"}
    assert {c["tier"] for c in s["cache"]} == {"gpu", "worker_host", "store_host"}
    assert {c["tier"] for c in s["cold_load"]} == {"worker_host", "store_host", "source"}
    assert int(s["adapters"]["gpu_resident"]) == 3


def test_the_page_is_self_contained(observed):
    kind, page = get(observed.http, "/status")
    assert kind.startswith("text/html")
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", page)
    assert "<script src" not in page and "<link" not in page
    assert re.findall(r"""fetch\(\s*["']([^"']+)""", page) == ["status.json"]


def render(url: str, out, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([CHROMIUM, "--headless", "--disable-gpu", "--no-sandbox",
                           "--window-size=1280,1600", "--virtual-time-budget=5000",
                           f"--user-data-dir={out}", *extra, url],
                          capture_output=True, text=True, timeout=120, check=False)


@pytest.mark.skipif(CHROMIUM is None, reason="no Chromium on PATH (chromium or "
                    "chromium-browser): `make browser` installs it")
def test_chromium_renders_the_run(observed, tmp_path):
    url = f"http://127.0.0.1:{observed.http}/status"
    shot = tmp_path / "status-page.png"
    done = render(url, tmp_path / "profile-shot", f"--screenshot={shot}")
    assert shot.exists() and shot.stat().st_size > 10_000, done.stderr[-2000:]
    done = render(url, tmp_path / "profile-dom", "--dump-dom")
    dom = done.stdout
    assert "<svg" in dom and "polyline" in dom and "<rect" in dom, dom[-2000:]
    body = re.sub(r"<(script|style)\b.*?</\1>", "", dom, flags=re.S)
    text = html.unescape(re.sub(r"<[^>]+>", "|", body))
    assert "loading..." not in text and "status.json: HTTP" not in text
    cells = [c.strip() for c in text.split("|") if c.strip()]
    for tenant, count in observed.requests.items():       # the tenants table: name, requests
        i = cells.index(tenant)
        assert cells[i + 1] == str(count), (tenant, cells[i:i + 6])
    assert observed.stack.workers[0].addr in cells
    assert "workers live 1 of 1" in text
    for tier in ("gpu", "worker_host", "store_host"):
        assert tier in cells
