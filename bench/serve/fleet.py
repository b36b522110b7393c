"""The serving benchmark with W workers behind the router: where each worker runs (its own
device, or all on one device with the memory budgets divided by W), each worker's figures over
a scenario (GPU hit rate, requests, working set from its residency snapshot), adapters resident
on more than one worker, and a worker killed (SIGKILL) mid-run and started again on its port,
with every request of the run classified by how it ended.

Plain Python apart from the gRPC snapshots bench/serve/stack.py takes.
"""
from __future__ import annotations

import collections
import threading
import time

from services.common.gen.lorafleet.v1 import common_pb2

BUDGETS = ("gpu_pool_bytes", "kv_cache_bytes", "host_pool_bytes")


def layout(args) -> tuple[list[dict], str]:
    """One dict of worker flag overrides per worker, and how they share the machine.
    --devices D0,D1,...: worker i on Di. --device cuda with W GPUs visible: cuda:i each.
    Else all on --device, each with 1/W of --gpu-pool-bytes, --kv-cache-bytes and
    --host-pool-bytes (the worker's defaults where unset)."""
    w = args.workers
    if w == 1:
        return [{}], "one worker"
    if args.devices:
        devs = [d.strip() for d in args.devices.split(",") if d.strip()]
        if len(devs) != w:
            raise SystemExit(f"--devices {args.devices}: {len(devs)} devices for --workers {w}")
        return [{"device": d} for d in devs], "one device each: " + ",".join(devs)
    if args.device == "cuda" and _cuda_count() >= w:
        return ([{"device": f"cuda:{i}"} for i in range(w)],
                "one device each: " + ",".join(f"cuda:{i}" for i in range(w)))
    from services.common.runtime import parse_bytes
    from services.worker.config import flag_defaults
    d = flag_defaults()
    share = {}
    for key in BUDGETS:
        total = parse_bytes(getattr(args, key) or d[key])
        share[key] = str(total // w)
    note = (f"all {w} on {args.device}, each with 1/{w} of the memory budgets ("
            + ", ".join(f"--{k.replace('_', '-')} {v}" for k, v in share.items()) + ")")
    return [dict(share) for _ in range(w)], note


def _cuda_count() -> int:
    try:
        import torch
        return torch.cuda.device_count()
    except ImportError:
        return 0


# ------------------------------------------------------------------------------ per worker
def counters(info) -> dict[str, tuple[int, int]]:
    return {c.tier: (c.hits, c.misses) for c in info.cache}


def delta(before, after) -> dict[str, tuple[int, int]]:
    """Per tier (hits, misses) gained from before to after; a new incarnation (another
    worker_id: restarted) counts from zero."""
    a = counters(after)
    b = counters(before) if before is not None and before.worker_id == after.worker_id else {}
    return {t: (h - b.get(t, (0, 0))[0], m - b.get(t, (0, 0))[1]) for t, (h, m) in a.items()}


def _add(x: dict, y: dict) -> dict:
    return {t: (x.get(t, (0, 0))[0] + y.get(t, (0, 0))[0],
                x.get(t, (0, 0))[1] + y.get(t, (0, 0))[1]) for t in set(x) | set(y)}


def fleet_info(before: list, after: list, lost: dict | None = None) -> tuple:
    """Every worker's Info before and after a scenario as one worker's (what
    metrics.hit_rates and cold_by_tier read): a single worker's as they are; else zero
    counters before, the summed gains after (a killed incarnation's up to the kill included)
    and every incarnation's cold-load records, oldest first."""
    if len(before) == 1 and not lost:
        return before[0], after[0]
    from services.common.gen.lorafleet.v1 import worker_pb2 as wpb
    total: dict = {}
    recs = []
    for i, (b, a) in enumerate(zip(before, after)):
        total = _add(total, delta(b, a))
        recs += list(a.cold_load_records)
        if lost and i in lost:
            total = _add(total, delta(b, lost[i]))
            recs += list(lost[i].cold_load_records)
    recs.sort(key=lambda r: r.end_unix_s)
    out = wpb.WorkerInfoResponse(cache=[wpb.CacheCounters(tier=t, hits=h, misses=m)
                                        for t, (h, m) in sorted(total.items())])
    out.cold_load_records.extend(recs)
    return wpb.WorkerInfoResponse(), out


def histogram_delta(before: list, after: list, lost: dict | None = None) -> dict:
    """metrics.histogram_delta over every worker (a restarted one from zero)."""
    from bench.serve.metrics import histogram_delta as one
    from services.common.gen.lorafleet.v1 import worker_pb2 as wpb
    out: dict[str, list[float]] = {}
    pairs = list(zip(before, after)) + [(before[i], info) for i, info in (lost or {}).items()]
    for b, a in pairs:
        base = b if b.worker_id == a.worker_id else wpb.WorkerInfoResponse()
        for tier, xs in one(base, a).items():
            out.setdefault(tier, []).extend(xs)
    return out


def gpu_ids(snapshot) -> set[str]:
    return {a.id for a in snapshot.adapters if a.tier == common_pb2.GPU and not a.loading}


def worker_rows(before: list, after: list, snaps: list, lost: dict | None = None) -> list[dict]:
    """Each worker's figures over a scenario. before / after: its Info around the scenario;
    snaps: its residency snapshot at the end; lost: worker index -> the Info of its killed
    incarnation taken just before the kill (its counters up to then count too). gpu_lookups:
    its GPU pool's hits + misses (one per adapter request it took, but for a request that
    joined a load already in progress, which counts in neither)."""
    out = []
    union = set().union(*(gpu_ids(s) for s in snaps)) if snaps else set()
    for i, (b, a, snap) in enumerate(zip(before, after, snaps)):
        d = delta(b, a)
        if lost and i in lost:
            d = _add(d, delta(b, lost[i]))
        h, m = d.get("gpu", (0, 0))
        res = gpu_ids(snap)
        out.append({"worker": i, "worker_id": a.worker_id, "gpu_lookups": h + m,
                    "gpu_hit_rate": round(h / (h + m), 4) if h + m else None,
                    "resident": len(res),
                    "resident_frac": round(len(res) / len(union), 4) if union else None,
                    "host_resident": sum(1 for x in snap.adapters
                                         if x.tier == common_pb2.WORKER_HOST)})
    return out


def multi_resident(snaps: list, records: list[dict]) -> dict:
    """Adapters on the GPU of more than one worker at the scenario's end, and how many of the
    scenario's requests they took (the router exposes no count of load spills: a hot adapter
    on two workers is one the placement spilled, or one a failover moved)."""
    where = collections.Counter(a for s in snaps for a in gpu_ids(s))
    multi = sorted(a for a, n in where.items() if n > 1)
    uses = collections.Counter(r["adapter"] for r in records)
    total = sum(uses.values())
    return {"count": len(multi), "union": len(where), "adapters": multi[:20],
            "request_share": round(sum(uses[a] for a in multi) / total, 4) if total else None}


# ------------------------------------------------------------------------ kill and restart
class KillRestart(threading.Thread):
    """At kill_at seconds after `start` (wall clock): worker I's Info kept, SIGKILL, then (after
    restart_after s) the same command on the same port, waited for SERVING, then for the
    router to count it live again, then for its first request (its GPU counters move)."""

    def __init__(self, stack, index: int, start: float, kill_at: float, restart_after: float,
                 since: int = 0):
        """since: the worker's cold-load seq at the scenario's start (the records of the
        killed incarnation after it are kept)."""
        super().__init__(daemon=True, name="kill-restart")
        self.since = since
        self.stack, self.index, self.start_t = stack, index, start
        self.kill_at, self.restart_after = kill_at, restart_after
        self.events: dict[str, float] = {}
        self.lost_info = None
        self.error: BaseException | None = None
        self.done = threading.Event()
        self.router_log = stack.router.log_path
        self.router_log_at = self.router_log.stat().st_size

    def router_retries(self) -> dict:
        """What the router logged during the scenario: attempts retried on another worker
        after failing before their first token, and mid-generation (unary calls only)."""
        with open(self.router_log, errors="replace") as f:
            f.seek(self.router_log_at)
            text = f.read()
        lines = [ln for ln in text.splitlines() if "retrying elsewhere" in ln]
        return {"retried_before_token": sum("before the first token" in ln for ln in lines),
                "retried_mid_generation": sum("mid-generation" in ln for ln in lines),
                "router_saw_drop": text.count(" dropped")}

    def _mark(self, what: str) -> None:
        self.events[what] = round(time.time() - self.start_t, 3)
        print(f"kill-restart: {what} at {self.events[what]:.2f}s", flush=True)

    def run(self) -> None:
        from bench.serve.stack import router_workers, worker_info
        try:
            time.sleep(max(0.0, self.start_t + self.kill_at - time.time()))
            w = self.stack.workers[self.index]
            self.lost_info = worker_info(w.addr, since=self.since)
            self.stack.kill_worker(self.index)
            self._mark("killed")
            time.sleep(self.restart_after)
            self._mark("restart_started")
            self.stack.restart_worker(self.index)
            self._mark("serving")
            n = len(self.stack.workers)
            while router_workers(self.stack.router.addr) < n and not self.done.is_set():
                time.sleep(0.05)
            self._mark("router_sees")
            addr = self.stack.workers[self.index].addr
            while not self.done.is_set():
                c = counters(worker_info(addr)).get("gpu", (0, 0))
                if sum(c):
                    self._mark("first_request")
                    break
                time.sleep(0.1)
        except BaseException as exc:  # noqa: BLE001 - reported by the scenario
            self.error = exc

    def wait_rejoined(self, timeout: float = 180.0) -> bool:
        """Block until the router counts the restarted worker live again (True), the thread
        failed or `timeout` passed (False)."""
        deadline = time.monotonic() + timeout
        while "router_sees" not in self.events:
            if not self.is_alive() or time.monotonic() > deadline:
                return "router_sees" in self.events
            time.sleep(0.05)
        return True

    def finish(self, timeout: float = 120.0) -> None:
        """After the scenario's requests: stop waiting for a first request; wait for the
        restart itself to be done (the worker must serve again before the next scenario)."""
        deadline = time.monotonic() + timeout
        while "router_sees" not in self.events and self.is_alive():
            if time.monotonic() > deadline:
                break
            time.sleep(0.1)
        self.done.set()
        self.join(timeout)
        if self.error is not None:
            raise RuntimeError(f"kill-restart of worker {self.index}: {self.error}") \
                from self.error


def classify(records: list[dict], requests: list, events: dict, start: float) -> dict:
    """Every measured request by how it ended: OK; failed after streaming tokens (status
    named); failed before any token (the router retries those elsewhere: should be none);
    duplicated (more tokens streamed than asked for, or than the final usage counts)."""
    want = {r.index: r.max_new for r in requests}
    out = collections.Counter()
    after_tokens = collections.Counter()
    before = collections.Counter()
    examples = []
    for r in records:
        streamed = r.get("streamed", len(r["times"]))
        dup = streamed > want.get(r["index"], streamed) or (
            r["status"] == "OK" and streamed != r["tokens"])
        out["duplicated"] += dup
        if r["status"] == "OK":
            out["ok"] += 1
        elif r["times"]:
            after_tokens[r["status"]] += 1
        else:
            before[r["status"]] += 1
            if len(examples) < 3:
                examples.append(r["error"])
    killed_at = events.get("killed")
    rejoined = events.get("router_sees")
    sent_after = [r for r in records if rejoined is not None and r["send"] - start > rejoined]
    return {"requests": len(records), "ok": out["ok"],
            "failed_after_tokens": dict(after_tokens),
            "failed_before_token": dict(before), "failed_before_token_n": sum(before.values()),
            "before_token_examples": examples, "duplicated": out["duplicated"],
            # in flight over every worker: the client cannot tell which worker served it
            "in_flight_at_kill": sum(1 for r in records if killed_at is not None and
                                     r["send"] - start <= killed_at <= r["end"] - start),
            "sent_after_rejoin": len(sent_after), "events_s": dict(events)}
