"""One stack, observed: the demo model and adapters served by the three services as processes,
each with /metrics and a --trace-file, the router with its HTTP gateway, after a small mixed
run (gRPC unary and streamed, HTTP completions, the base model, three tenants, a refusal).
The session's `observed` fixture (tests/conftest.py) shares it between the modules that read
metrics, traces and the status page, so the suite starts it once.

The router runs with --metrics-tenants 2, so of the three tenants one is `other` there."""
from __future__ import annotations

import json
import pathlib
import re
import urllib.request

import grpc

from services.client.client import LorafleetClient
from tests.conftest import Stack
from tests.support import DEMO_ADAPTERS, FreePort, MODEL_DIR
# tenant -> [(adapter, transport)]: alpha most, beta next, gamma least (the router's `other`)
RUN = {"alpha": [("pirate", "unary")] * 3 + [("poet", "stream"), ("pirate", "stream")],
       "beta": [("poet", "http"), ("acme-support", "unary"), ("poet", "http")],
       "gamma": [("", "unary")]}
REFUSED = ("gamma", "no-such-adapter")          # NOT_FOUND: counted among gamma's requests
SERIES = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")


def scrape(port: int) -> str:
    return urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()


def samples(text: str) -> list[tuple[str, str, float]]:
    """(name, labels text, value) of every sample in a Prometheus text page."""
    out = []
    for line in text.splitlines():
        m = SERIES.match(line)
        if m and not line.startswith("#"):
            out.append((m.group(1), m.group(2) or "", float(m.group(3))))
    return out


def http_completion(port: int, tenant: str, model: str) -> dict:
    body = json.dumps({"model": model, "prompt": "Tell me about the weather.", "max_tokens": 6,
                       "temperature": 0}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                 headers={"Content-Type": "application/json",
                                          "Authorization": f"Bearer {tenant}"})
    return json.loads(urllib.request.urlopen(req, timeout=60).read())


class Observed:
    def __init__(self, tmp: pathlib.Path):
        self.tmp = tmp
        self.http = FreePort("127.0.0.1:")
        self.metrics = {n: FreePort() for n in ("router", "worker", "store")}
        self.traces = {n: tmp / f"{n}-spans.jsonl" for n in self.metrics}
        flags = {n: ["--metrics-port", self.metrics[n], "--trace-file", str(self.traces[n])]
                 for n in self.metrics}
        self.stack = Stack(MODEL_DIR, DEMO_ADAPTERS, tmp, store_args=flags["store"],
                           worker_args=flags["worker"],
                           router_args=[*flags["router"], "--http-listen",
                                        self.http, "--metrics-tenants", "2"])
        self.requests = {t: 0 for t in RUN}
        try:
            self._run()
        except BaseException:
            self.close()
            raise

    def _run(self) -> None:
        for tenant, calls in RUN.items():
            with LorafleetClient(self.stack.router.addr, token=tenant, timeout=60) as c:
                for adapter, how in calls:
                    if how == "http":
                        http_completion(self.http, tenant, adapter)
                    elif how == "stream":
                        list(c.generate_stream(adapter=adapter, prompt="Hello there",
                                               max_new_tokens=6))
                    else:
                        c.generate(adapter=adapter, prompt="Hello there", max_new_tokens=6)
                    self.requests[tenant] += 1
        tenant, adapter = REFUSED
        with LorafleetClient(self.stack.router.addr, token=tenant, timeout=60) as c:
            try:
                c.generate(adapter=adapter, prompt="Hello", max_new_tokens=2)
            except grpc.RpcError as err:
                assert err.code() == grpc.StatusCode.NOT_FOUND
            else:
                raise AssertionError("an unknown adapter was served")
        self.requests[tenant] += 1

    def pages(self) -> dict[str, str]:
        return {n: scrape(p) for n, p in self.metrics.items()}

    def close(self) -> list[int]:
        return self.stack.terminate()
