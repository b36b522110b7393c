"""A bounded soak of the running services with injected faults (issue 29), on loopback.

The store (the demo adapters beside hostile ones: a directory as adapter_config.json, a FIFO as
the weights, a backtracking target_modules regex, DoRA), two CPU workers and a router with a
tenants file and the HTTP gateway run as processes. Client threads send, until the end:
gRPC Generate and GenerateStream on the demo adapters and the base model (some tenants over
their quotas), HTTP completions whose clients hang up mid-stream, bad requests, and hostile
registrations through the router. Meanwhile a fault thread SIGKILLs a worker and starts it again
on its port, and restarts the store on its port and registry.

It checks what issue 29 asks: no unexpected status (UNKNOWN, INTERNAL, or anything a request
of its kind should not get), no ERROR and no traceback in any service's log, the services'
RSS flat (the last samples within 25% of those a minute in), and every KV block free at the end.

    python -m bench.stack.soak --minutes 10 --out bench/results          # soak-cpu.json / .md
    python -m bench.stack.soak --minutes 1 --out /tmp/soak               # a short one
"""
from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import pathlib
import platform
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request

import grpc

from bench.lib.header import RESULTS, ROOT
from bench.serve.stack import free_port
from services.client.client import LorafleetClient

MODEL, DEMO = ROOT / "models" / "tiny-llama", ROOT / "models" / "adapters"
TENANTS = {"tenants": {
    "ops": {"tokens": ["tok-ops"], "role": "admin"},
    "acme": {"tokens": ["tok-acme"]},
    "tiny": {"tokens": ["tok-tiny"], "quota": {"requests_per_s": 2, "request_burst": 2}}}}
# what each kind of request may end with (anything else is unexpected)
EXPECTED = {
    "generate": {"OK", "UNAVAILABLE", "CANCELLED"},
    "stream": {"OK", "UNAVAILABLE", "CANCELLED"},
    "quota": {"OK", "RESOURCE_EXHAUSTED", "UNAVAILABLE"},
    # an unknown adapter while the store restarts: UNAVAILABLE (naming the store) is right
    "bad": {"INVALID_ARGUMENT", "NOT_FOUND", "UNAVAILABLE"},
    "hostile": {"INVALID_ARGUMENT", "UNAVAILABLE", "RESOURCE_EXHAUSTED"},
    "http_hangup": {"sent"},
    "http": {"200", "503"},
}


class Proc:
    """A service process on a fixed port, restartable (its log appended to)."""

    def __init__(self, name: str, args: list[str], log_dir: pathlib.Path, env: dict):
        self.name, self.port, self.args, self.env = name, free_port(), args, env
        self.addr = f"127.0.0.1:{self.port}"
        self.log_path = log_dir / f"{name}.log"
        self.proc = None
        self.start()

    def start(self) -> None:
        log = open(self.log_path, "a")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", f"services.{self.name.split('-')[0]}", "--listen",
             self.addr, "--metrics-port", str(self.metrics), *self.args],
            cwd=ROOT, env=self.env, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        self.wait()

    @property
    def metrics(self) -> int:
        if not hasattr(self, "_metrics"):
            self._metrics = free_port()
        return self._metrics

    def wait(self, timeout: float = 120.0) -> None:
        from grpc_health.v1 import health_pb2, health_pb2_grpc
        end = time.monotonic() + timeout
        with grpc.insecure_channel(self.addr) as ch:
            while time.monotonic() < end:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"{self.name} exited {self.proc.returncode}")
                try:
                    if health_pb2_grpc.HealthStub(ch).Check(
                            health_pb2.HealthCheckRequest(), timeout=1).status == 1:
                        return
                except grpc.RpcError:
                    pass
                time.sleep(0.1)
        raise TimeoutError(f"{self.name} not SERVING")

    def rss_mb(self) -> float:
        """The process's resident memory and its children's (the worker's front end)."""
        pids = [self.proc.pid]
        try:
            out = subprocess.run(["pgrep", "-P", str(self.proc.pid)], capture_output=True,
                                 text=True).stdout
            pids += [int(p) for p in out.split()]
        except OSError:
            pass
        total = 0.0
        for pid in pids:
            try:
                for line in open(f"/proc/{pid}/status"):
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1]) / 1024
            except OSError:
                pass
        return total

    def stop(self, sig=signal.SIGTERM) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def hostile_adapters(root: pathlib.Path) -> None:
    """The demo adapters and four hostile ones beside them."""
    shutil.copytree(DEMO, root, dirs_exist_ok=True)
    good = DEMO / "pirate"
    (root / "dirconfig").mkdir()
    (root / "dirconfig" / "adapter_config.json").mkdir()
    shutil.copy(good / "adapter_model.safetensors", root / "dirconfig")
    (root / "fifo").mkdir()
    shutil.copy(good / "adapter_config.json", root / "fifo")
    os.mkfifo(root / "fifo" / "adapter_model.safetensors")
    for name, change in (("regex", {"target_modules": r"model\.lay(.|.)*!"}),
                         ("dora", {"use_dora": True})):
        (root / name).mkdir()
        cfg = json.loads((good / "adapter_config.json").read_text())
        (root / name / "adapter_config.json").write_text(json.dumps({**cfg, **change}))
        shutil.copy(good / "adapter_model.safetensors", root / name)


class Tally:
    def __init__(self):
        self.lock = threading.Lock()
        self.counts = collections.Counter()
        self.unexpected = []

    def add(self, kind: str, status: str, detail: str = "") -> None:
        with self.lock:
            self.counts[f"{kind}:{status}"] += 1
            if status not in EXPECTED[kind]:
                self.unexpected.append({"kind": kind, "status": status, "detail": detail[:300],
                                        "t": time.time()})


def client_loop(router: str, http: str, end: float, tally: Tally, seed: int) -> None:
    rng = random.Random(seed)
    adapters = ["pirate", "poet", "acme-support", ""]
    while time.monotonic() < end:
        kind = rng.choices(["generate", "stream", "quota", "bad", "hostile", "http_hangup",
                            "http"], weights=[30, 25, 10, 8, 3, 10, 14])[0]
        try:
            run_one(kind, router, http, rng, adapters, tally)
        except grpc.RpcError as err:
            tally.add(kind, err.code().name, err.details() or "")


def run_one(kind, router, http, rng, adapters, tally) -> None:
    token = {"quota": "tok-tiny", "hostile": "tok-ops"}.get(kind, "tok-acme")
    with LorafleetClient(router, token, timeout=60) as c:
        if kind == "generate":
            c.generate("Tell me about the weather.", adapter=rng.choice(adapters),
                       max_new_tokens=rng.randint(1, 24))
        elif kind == "stream":
            for _ in c.generate_stream("Hello!", adapter=rng.choice(adapters),
                                       max_new_tokens=rng.randint(1, 24), temperature=0.7):
                pass
        elif kind == "quota":
            c.generate("Hi", max_new_tokens=2)
        elif kind == "bad":
            rng.choice([lambda: c.generate("", max_new_tokens=4),
                        lambda: c.generate("x", adapter="no-such-adapter", max_new_tokens=2),
                        lambda: c.generate("x", temperature=-1.0),
                        lambda: c.generate("x", max_new_tokens=1 << 30)])()
        elif kind == "hostile":
            c.register(f"h-{rng.randint(0, 10**6)}", "file://" + rng.choice(
                ["dirconfig", "fifo", "regex", "dora", "../etc"]))
        elif kind in ("http", "http_hangup"):
            tally.add(kind, http_call(http, kind == "http_hangup", rng))
            return
    tally.add(kind, "OK")


def http_call(http: str, hang_up: bool, rng) -> str:
    body = json.dumps({"model": rng.choice(["pirate", "poet"]), "prompt": "Hello!",
                       "max_tokens": 24, "stream": hang_up}).encode()
    if hang_up:                                 # send, read a little, leave
        host, port = http.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=30) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
                      b"tok-acme\r\nContent-Type: application/json\r\nContent-Length: "
                      + str(len(body)).encode() + b"\r\n\r\n" + body)
            s.recv(256)
        return "sent"
    req = urllib.request.Request(http + "/v1/completions", data=body, method="POST",
                                 headers={"Content-Type": "application/json",
                                          "Authorization": "Bearer tok-acme"})
    try:
        return str(urllib.request.urlopen(req, timeout=60).status)
    except urllib.error.HTTPError as err:
        return str(err.code)


def faults(stack: dict, end: float, log: list, period: float) -> None:
    """Every period (due at fixed times from the start, so a slow restart does not push the
    later faults past the end): SIGKILL a worker and start it again; every other time,
    restart the store."""
    start, i = time.monotonic(), 0
    while start + (i + 1) * period < end:
        time.sleep(max(0.0, start + (i + 1) * period - time.monotonic()))
        i += 1
        w = stack["workers"][i % 2]
        w.stop(signal.SIGKILL)
        log.append({"t": time.time(), "fault": f"SIGKILL {w.name}"})
        w.start()
        if i % 2 == 0:
            stack["store"].stop()
            log.append({"t": time.time(), "fault": "store restarted"})
            stack["store"].start()


# ERROR lines that an injected fault explains: a SIGKILLed worker core's front end ends its
# calls and says so (the one error a supervisor should see)
EXPLAINED = ("worker core exited: ending every call",)


def log_errors(paths) -> tuple[list[str], list[str]]:
    """(tracebacks and ERROR lines no injected fault explains, the explained ERROR lines)."""
    bad = re.compile(r" ERROR |Traceback \(most recent call last\)")
    lines = [f"{p.name}: {line}" for p in paths
             for line in p.read_text(errors="replace").splitlines() if bad.search(line)]
    explained = [x for x in lines if any(e in x for e in EXPLAINED)]
    return [x for x in lines if x not in explained], explained


def kv_used(worker: Proc) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{worker.metrics}/metrics",
                                  timeout=10).read().decode()
    return float(next(line.split()[-1] for line in text.splitlines()
                      if line.startswith("vllm:kv_cache_usage_perc")))


def sample_rss(stack: dict, end: float, out: list) -> None:
    while time.monotonic() < end:
        out.append({"t": round(time.monotonic() - end, 1), **{
            p.name: round(p.rss_mb(), 1) for p in stack["all"]}})
        time.sleep(10)


def rss_flat(samples: list[dict], names: list[str]) -> dict:
    """Per service: the mean of the samples a minute in and of the last ones, and whether
    the last are within 25% of the first."""
    out = {}
    if len(samples) < 8:
        return out
    for n in names:
        first = [s[n] for s in samples[6:9] if s.get(n)]
        last = [s[n] for s in samples[-3:] if s.get(n)]
        if first and last:
            a, b = sum(first) / len(first), sum(last) / len(last)
            out[n] = {"first_mb": round(a, 1), "last_mb": round(b, 1), "flat": b <= 1.25 * a}
    return out


def start_stack(work: pathlib.Path) -> dict:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    adapters = work / "adapters"
    hostile_adapters(adapters)
    (work / "tenants.json").write_text(json.dumps(TENANTS))
    store = Proc("adapter_store", ["--adapters-dir", str(adapters), "--model", str(MODEL),
                                   "--db", str(work / "registry.sqlite")], work, env)
    workers = [Proc(f"worker-{i}", ["--model", str(MODEL), "--store", store.addr, "--device",
                                    "cpu", "--kv-cache-bytes", "32MiB"], work, env)
               for i in range(2)]
    http = free_port()
    router = Proc("router", ["--store", store.addr, *[x for w in workers
                                                      for x in ("--worker", w.addr)],
                             "--tenants", str(work / "tenants.json"), "--insecure-internal",
                             "--http-listen",
                             f"127.0.0.1:{http}"], work, env)
    return {"store": store, "workers": workers, "router": router,
            "http": f"http://127.0.0.1:{http}", "all": [store, *workers, router]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--clients", type=int, default=6)
    p.add_argument("--fault-every", type=float, default=45.0, help="seconds between faults")
    p.add_argument("--work", type=pathlib.Path, default=ROOT / "tmp" / "soak")
    p.add_argument("--out", type=pathlib.Path, default=RESULTS)
    a = p.parse_args(argv)
    shutil.rmtree(a.work, ignore_errors=True)
    a.work.mkdir(parents=True)
    stack = start_stack(a.work)
    print(f"soak: {a.minutes:g} min, {a.clients} clients, a fault every {a.fault_every:g} s",
          flush=True)
    end = time.monotonic() + 60 * a.minutes
    tally, fault_log, rss = Tally(), [], []
    threads = [threading.Thread(target=client_loop, args=(stack["router"].addr, stack["http"],
                                                          end, tally, i), daemon=True)
               for i in range(a.clients)]
    threads += [threading.Thread(target=faults, args=(stack, end, fault_log, a.fault_every),
                                 daemon=True),
                threading.Thread(target=sample_rss, args=(stack, end, rss), daemon=True)]
    for t in threads:
        t.start()
    while time.monotonic() < end:
        time.sleep(min(30, max(0.1, end - time.monotonic())))
        print(f"soak: {round(end - time.monotonic())} s left; {sum(tally.counts.values())} "
              f"requests, {len(tally.unexpected)} unexpected, {len(fault_log)} faults",
              flush=True)
    for t in threads:
        t.join(timeout=90)
    time.sleep(3)                               # the last cancels settle
    kv = {w.name: kv_used(w) for w in stack["workers"]}
    for proc in reversed(stack["all"]):
        proc.stop()
    errors, explained = log_errors([proc.log_path for proc in stack["all"]])
    result = {
        "header": {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(
            timespec="seconds"), "machine": f"{platform.machine()}, {os.cpu_count()} cpus",
            "python": platform.python_version(), "minutes": a.minutes, "clients": a.clients,
            "fault_every_s": a.fault_every},
        "requests": dict(sorted(tally.counts.items())), "unexpected": tally.unexpected,
        "faults": fault_log, "log_errors": errors[:50], "log_error_count": len(errors),
        "explained_errors": explained,
        "kv_used_at_end": kv, "rss": rss_flat(rss, [p.name for p in stack["all"]]),
        "rss_samples": rss}
    result["passed"] = (not tally.unexpected and not errors and all(v == 0 for v in kv.values())
                        and all(r["flat"] for r in result["rss"].values()))
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "soak-cpu.json").write_text(json.dumps(result, indent=1) + "\n")
    (a.out / "soak-cpu.md").write_text(markdown(result))
    print((a.out / "soak-cpu.md").read_text(), flush=True)
    return 0 if result["passed"] else 1


def markdown(r: dict) -> str:
    h = r["header"]
    lines = [f"# Soak with injected faults, {h['date']}", "",
             f"{h['minutes']:g} minutes on loopback ({h['machine']}, python {h['python']}): "
             f"{h['clients']} clients, a worker SIGKILLed and restarted every "
             f"{h['fault_every_s']:g} s, the store restarted every other time. "
             f"Passed: **{r['passed']}**.", "",
             "| request : status | count |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in r["requests"].items()]
    lines += ["", f"Unexpected statuses: {len(r['unexpected'])}; tracebacks or ERROR lines in "
              f"the logs that no injected fault explains: {r['log_error_count']} (explained: "
              f"{len(r['explained_errors'])}, the front end of a SIGKILLed worker core); faults: "
              f"{len(r['faults'])}; KV used at the end: {r['kv_used_at_end']}.", "",
              "| service | RSS a minute in | at the end | flat |",
              "|---|---|---|---|"]
    lines += [f"| {n} | {v['first_mb']} MB | {v['last_mb']} MB | {v['flat']} |"
              for n, v in r["rss"].items()]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
