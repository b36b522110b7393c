"""Capacity simulator: replays a synthetic multi-tenant workload through the very CachePolicy and
placement code the services run, to size GPU / host tiers and worker counts.

Workload: A adapters (10k-100k, ranks 8-64, bytes ~ rank) owned by N tenants, Zipf popularity
within a tenant; tenant "bursty" owns a large share of them and sends ``burst_factor`` times its
rate for ``burst_on_s`` of every ``burst_period_s`` over a flatter popularity. Fleet: W workers,
each a GPU tier of G adapters' worth of bytes (a running request pins its adapter) over a host tier
of H (GPU victims are demoted there), over the store's host tier of S, over S3. Loads are instant:
the simulator counts them; it does not time them. Placement: "rendezvous" (affinity, rendezvous
hashing, load bound) or "least_loaded" (an adapter-blind balancer). Runs: caps on/off x both
placements, then sweeps of G and of A (caps on). Writes bench/results/capacity_sim.{json,md,png}.

    python bench/capacity_sim.py [--adapters 20000] [--workers 8] [--gpu 128] [--host 1024] ...
"""
from __future__ import annotations

import argparse
import bisect
import heapq
import itertools
import json
import platform
import random
import sys
import time
from dataclasses import asdict, dataclass, replace
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runnable as a plain script
from services.common.cache_policy import CachePolicy, NoRoom  # noqa: E402
from services.router.placement import WorkerView, choose_worker  # noqa: E402

RANKS, RANK_WEIGHTS = (8, 16, 32, 64), (0.3, 0.4, 0.2, 0.1)
BYTES_PER_RANK = 2 << 20  # ~ q,k,v,o of a 7B model in fp16: 2 MiB per unit of rank
RESULTS = Path(__file__).resolve().parent / "results"


@dataclass(frozen=True)
class WorkloadConfig:
    """The synthetic workload."""

    adapters: int = 20_000
    tenants: int = 8
    requests: int = 30_000
    rate: float = 400.0  # requests/s of all tenants outside bursts
    zipf: float = 1.2
    bursty_zipf: float = 0.6  # flatter: a burst sweeps over many of its adapters
    bursty_adapters: float = 0.3  # share of the adapters owned by the bursty tenant
    burst_factor: float = 20.0
    burst_period_s: float = 30.0
    burst_on_s: float = 6.0
    service_s: float = 0.3  # mean time a request runs (its adapter stays pinned)
    seed: int = 0


@dataclass(frozen=True)
class FleetConfig:
    """Workers and tier sizes (in adapters of mean size) and the policies under test."""

    workers: int = 8
    gpu: int = 128
    host: int = 1024
    store: int = 8192
    caps: bool = True
    tenant_share: float = 0.5
    placement: str = "rendezvous"  # or "least_loaded"
    window_s: float = 10.0  # working-set window
    warmup: float = 0.2  # share of the requests replayed before counting starts


@dataclass
class Workload:
    """A generated request stream: arrival times, tenant and adapter per request."""

    config: WorkloadConfig
    tenant_names: list[str]
    owner: list[int]  # adapter -> tenant index
    sizes: list[int]  # adapter -> bytes
    times: list[float]
    adapters: list[int]
    services: list[float]


def _zipf_cum(n: int, s: float) -> list[float]:
    return list(itertools.accumulate(1.0 / (j + 1) ** s for j in range(n)))


def _arrivals(rng: random.Random, rate: float, horizon: float, burst: tuple | None) -> list[float]:
    """Poisson arrivals; with burst=(factor, period, on) the rate is multiplied while 'on'."""
    peak = rate * (burst[0] if burst else 1.0)
    out, t = [], 0.0
    while True:
        t += rng.expovariate(peak)
        if t >= horizon:
            return out
        if burst is None or t % burst[1] < burst[2] or rng.random() < 1.0 / burst[0]:
            out.append(t)


def make_workload(cfg: WorkloadConfig) -> Workload:
    """Generate the request stream (deterministic for a seed)."""
    rng = random.Random(cfg.seed)
    sizes = [r * BYTES_PER_RANK for r in rng.choices(RANKS, RANK_WEIGHTS, k=cfg.adapters)]
    n_bursty = int(cfg.adapters * cfg.bursty_adapters)
    steady = (cfg.adapters - n_bursty) // (cfg.tenants - 1)
    spans = [(0, n_bursty)] + [(n_bursty + i * steady, steady) for i in range(cfg.tenants - 1)]
    owner = [0] * cfg.adapters
    for tenant, (start, count) in enumerate(spans):
        owner[start:start + count] = [tenant] * count
    per_tenant = cfg.rate / cfg.tenants
    duty = cfg.burst_on_s / cfg.burst_period_s
    mean_rate = cfg.rate + per_tenant * (cfg.burst_factor - 1) * duty
    horizon = 1.1 * cfg.requests / mean_rate
    stream = []
    for tenant, (start, count) in enumerate(spans):
        burst = (cfg.burst_factor, cfg.burst_period_s, cfg.burst_on_s) if tenant == 0 else None
        cum = _zipf_cum(count, cfg.bursty_zipf if tenant == 0 else cfg.zipf)
        for t in _arrivals(rng, per_tenant, horizon, burst):
            j = bisect.bisect_left(cum, rng.random() * cum[-1])
            stream.append((t, start + min(j, count - 1), rng.expovariate(1.0 / cfg.service_s)))
    stream.sort()
    stream = stream[:cfg.requests]
    names = ["bursty"] + [f"steady{i}" for i in range(1, cfg.tenants)]
    return Workload(cfg, names, owner, sizes, [s[0] for s in stream], [s[1] for s in stream],
                    [s[2] for s in stream])


class _Worker:
    __slots__ = ("gpu", "host", "view", "seen")

    def __init__(self, fleet: FleetConfig, mean_bytes: float) -> None:
        self.gpu = _policy(fleet.gpu * mean_bytes, fleet)
        self.host = _policy(fleet.host * mean_bytes, fleet)
        self.view = WorkerView(resident=self.gpu)
        self.seen: set[int] = set()


def _policy(capacity: float, fleet: FleetConfig) -> CachePolicy:
    if not fleet.caps:
        return CachePolicy.plain_lru(int(capacity))
    return CachePolicy(int(capacity), tenant_share=fleet.tenant_share)


class _Tally:
    """Counters of one run."""

    def __init__(self, wl: Workload, t0: float) -> None:
        self.tier = {"gpu": 0, "host": 0, "store": 0, "source": 0}
        n = len(wl.tenant_names)
        self.requests, self.gpu_hits, self.no_room, self.t0 = [0] * n, [0] * n, 0, t0
        self.in_burst = [0, 0]  # steady tenants' requests and GPU hits while the burst is on
        self.windows: list[tuple[int, float]] = []  # (fleet working set, mean per worker)
        self.seen: set[int] = set()

    def record(self, tenant: int, adapter: int, hit: bool, bursting: bool) -> None:
        """Count one request."""
        self.requests[tenant] += 1
        self.gpu_hits[tenant] += hit
        if tenant and bursting:
            self.in_burst[0] += 1
            self.in_burst[1] += hit
        self.seen.add(adapter)

    def close_window(self, workers: list[_Worker]) -> None:
        """Record the working sets of the window that ends, start the next."""
        self.windows.append((len(self.seen), sum(len(w.seen) for w in workers) / len(workers)))
        self.seen.clear()
        for w in workers:
            w.seen.clear()


def simulate(wl: Workload, fleet: FleetConfig) -> dict:
    """Replay wl through a fleet; returns the run's figures."""
    mean_bytes = sum(wl.sizes) / len(wl.sizes)  # a tier of G adapters holds G * mean_bytes
    workers = [_Worker(fleet, mean_bytes) for _ in range(fleet.workers)]
    views, index = {f"w{i}": w.view for i, w in enumerate(workers)}, {}
    index.update((f"w{i}", i) for i in range(fleet.workers))
    store = _policy(fleet.store * mean_bytes, fleet)
    keys, done = [f"a{i}" for i in range(len(wl.sizes))], []
    affinity, cfg = fleet.placement == "rendezvous", wl.config
    start = int(fleet.warmup * len(wl.times))
    tally, window_end = _Tally(wl, 0.0), float("inf")  # the warm-up's tally is discarded
    for i, (t, adapter, service) in enumerate(zip(wl.times, wl.adapters, wl.services)):
        _complete(done, workers, t)
        if i == start or t >= window_end:
            if i == start:
                tally, window_end = _Tally(wl, t), t
            tally.close_window(workers)
            window_end += fleet.window_s
        key = keys[adapter]
        w = index[choose_worker(key if affinity else None, views)]
        pinned = _serve(workers[w], store, wl, adapter, key, tally)
        tally.record(wl.owner[adapter], adapter, pinned == "hit",
                     t % cfg.burst_period_s < cfg.burst_on_s)
        workers[w].view.running += 1
        workers[w].seen.add(adapter)
        heapq.heappush(done, (t + service, w, key, pinned is not None))
    tally.windows.pop(0)  # the one closed at the end of the warm-up
    return _figures(wl, fleet, tally, wl.times[-1] - tally.t0)


def _complete(done: list[tuple], workers: list[_Worker], now: float) -> None:
    """Finish the requests that ended by now: free their rows, unpin their adapters."""
    while done and done[0][0] <= now:
        _, w, key, pinned = heapq.heappop(done)
        workers[w].view.running -= 1
        if pinned:
            workers[w].gpu.unpin(key)


def _serve(worker: _Worker, store: CachePolicy, wl: Workload, adapter: int, key: str,
           tally: _Tally) -> str | None:
    """One request's adapter path through the tiers; returns "hit"/"load" (pinned) or None."""
    tenant, nbytes = wl.tenant_names[wl.owner[adapter]], wl.sizes[adapter]
    if worker.gpu.touch(key):
        worker.gpu.pin(key)
        tally.tier["gpu"] += 1
        return "hit"
    if worker.host.touch(key):
        tally.tier["host"] += 1
    else:
        if store.touch(key):
            tally.tier["store"] += 1
        else:
            tally.tier["source"] += 1
            store.admit(key, tenant, nbytes)
        worker.host.admit(key, tenant, nbytes)
    try:
        victims = worker.gpu.admit(key, tenant, nbytes, pin=True)
    except NoRoom:
        tally.no_room += 1  # the request would wait for an unpin; counted, served unpinned
        return None
    for victim in victims:  # demote GPU victims to the host tier
        if not worker.host.contains(victim):
            v = int(victim[1:])
            worker.host.admit(victim, wl.tenant_names[wl.owner[v]], wl.sizes[v], count_miss=False)
    return "load"


def _figures(wl: Workload, fleet: FleetConfig, tally: _Tally, duration: float) -> dict:
    n, duration = sum(tally.requests), max(duration, 1e-9)
    gpu_miss = n - tally.tier["gpu"]
    host_miss = gpu_miss - tally.tier["host"]
    hit_rate = {name: round(h / r, 4) if r else 0.0
                for name, h, r in zip(wl.tenant_names, tally.gpu_hits, tally.requests)}
    steady = [v for k, v in hit_rate.items() if k != "bursty"]
    windows = tally.windows or [(0, 0.0)]
    return {
        "placement": fleet.placement, "caps": fleet.caps, "gpu_slots": fleet.gpu,
        "adapters": wl.config.adapters,
        "gpu_hit_rate": round(tally.tier["gpu"] / n, 4),
        "host_hit_rate": round(tally.tier["host"] / gpu_miss, 4) if gpu_miss else 1.0,
        "store_hit_rate": round(tally.tier["store"] / host_miss, 4) if host_miss else 1.0,
        "gpu_loads_per_s": round(gpu_miss / duration, 1),
        "source_loads_per_s": round(tally.tier["source"] / duration, 1),
        "tenant_gpu_hit_rate": hit_rate,
        "steady_mean_hit_rate": round(sum(steady) / len(steady), 4),
        "steady_min_hit_rate": min(steady),
        "steady_hit_rate_in_bursts": round(tally.in_burst[1] / max(1, tally.in_burst[0]), 4),
        "working_set_fleet": round(sum(w[0] for w in windows) / len(windows)),
        "working_set_per_worker": round(sum(w[1] for w in windows) / len(windows)),
        "no_room": tally.no_room,
    }


def run_all(wcfg: WorkloadConfig, fleet: FleetConfig, gpu_sweep: list[int],
            adapter_sweep: list[int]) -> list[dict]:
    """Caps on/off x placements at the configured sizes, then (caps on) a sweep of GPU slots per
    worker and a sweep of registered adapters, each for both placements."""
    workloads = {wcfg.adapters: make_workload(wcfg)}
    runs = []
    for placement in ("least_loaded", "rendezvous"):
        base = replace(fleet, placement=placement)
        runs += [simulate(workloads[wcfg.adapters], replace(base, caps=c)) for c in (False, True)]
        for gpu in (g for g in gpu_sweep if g != fleet.gpu):
            runs.append(simulate(workloads[wcfg.adapters], replace(base, caps=True, gpu=gpu)))
        for adapters in (a for a in adapter_sweep if a != wcfg.adapters):
            if adapters not in workloads:
                workloads[adapters] = make_workload(replace(wcfg, adapters=adapters))
            runs.append(simulate(workloads[adapters], replace(base, caps=True)))
    return runs


_COLUMNS = ("placement | caps | adapters | GPU slots | GPU hit | host hit | store hit | GPU loads/s"
            " | S3 loads/s | steady mean / min / in bursts | bursty | WS fleet / worker | NoRoom")


def _row(r: dict) -> str:
    cells = [r["placement"], "on" if r["caps"] else "off", r["adapters"], r["gpu_slots"],
             *(f"{r[k]:.3f}" for k in ("gpu_hit_rate", "host_hit_rate", "store_hit_rate")),
             r["gpu_loads_per_s"], r["source_loads_per_s"],
             " / ".join(f"{r[k]:.3f}" for k in ("steady_mean_hit_rate", "steady_min_hit_rate",
                                                "steady_hit_rate_in_bursts")),
             f"{r['tenant_gpu_hit_rate']['bursty']:.3f}",
             f"{r['working_set_fleet']} / {r['working_set_per_worker']}", r["no_room"]]
    return "| " + " | ".join(str(c) for c in cells) + " |"


def write_markdown(path: Path, meta: dict, runs: list[dict]) -> None:
    """A short table of the runs, with date and Python version."""
    lines = [f"# Capacity simulator ({meta['date']}, Python {meta['python']}, "
             f"{meta['seconds']} s)", "", f"Workload: `{json.dumps(meta['workload'])}`", "",
             f"Fleet: `{json.dumps(meta['fleet'])}`", "", f"| {_COLUMNS} |",
             "|" + "---|" * (_COLUMNS.count("|") + 1), *map(_row, runs), "",
             "GPU hit: per request; host / store hit: per miss of the tier above. Steady: GPU hit "
             "rate of the steady tenants (mean, worst, while the burst is on). WS: distinct "
             "adapters requested per window (fleet, mean per worker). NoRoom: GPU admissions "
             "refused because the tier was all pinned.", ""]
    path.write_text("\n".join(lines))


def plot(path: Path, runs: list[dict], fleet: FleetConfig, adapters: int) -> bool:
    """GPU hit rate vs GPU slots per worker, and vs registered adapters (caps on)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    panels = (("gpu_slots", "adapters", adapters, "GPU adapter slots per worker"),
              ("adapters", "gpu_slots", fleet.gpu, "registered adapters"))
    for ax, (x, fixed, value, label) in zip(axes, panels):
        for placement in ("least_loaded", "rendezvous"):
            points = sorted((r[x], r["gpu_hit_rate"]) for r in runs if r["caps"]
                            and r["placement"] == placement and r[fixed] == value)
            if points:
                ax.plot(*zip(*points), marker="o", label=placement)
        ax.set_xscale("log", base=2 if x == "gpu_slots" else 10)
        ax.set(xlabel=label, ylabel="GPU hit rate", ylim=(0, 1))
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"{fleet.workers} workers, per-tenant caps on")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> None:
    """CLI: sizes and workload knobs as flags; writes the results files."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for name, default in {**asdict(WorkloadConfig()), **asdict(FleetConfig())}.items():
        if name not in ("caps", "placement"):
            p.add_argument(f"--{name.replace('_', '-')}", type=type(default), default=default)
    p.add_argument("--sweep", default="32,64,128,256", help="GPU slots per worker to sweep")
    p.add_argument("--adapter-sweep", default="10000,100000", help="registered adapters to sweep")
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--no-plot", action="store_true")
    args = vars(p.parse_args(argv))
    wcfg = WorkloadConfig(**{k: args[k] for k in asdict(WorkloadConfig())})
    fcfg = FleetConfig(**{k: args[k] for k in asdict(FleetConfig()) if k in args})
    started = time.perf_counter()
    runs = run_all(wcfg, fcfg, _ints(args["sweep"]), _ints(args["adapter_sweep"]))
    meta = {"date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "python": platform.python_version(), "workload": asdict(wcfg),
            "fleet": asdict(fcfg), "seconds": round(time.perf_counter() - started, 1)}
    args["out"].mkdir(parents=True, exist_ok=True)
    (args["out"] / "capacity_sim.json").write_text(json.dumps({**meta, "runs": runs}, indent=1))
    write_markdown(args["out"] / "capacity_sim.md", meta, runs)
    plotted = not args["no_plot"] and plot(args["out"] / "capacity_sim.png", runs, fcfg,
                                           wcfg.adapters)
    print((args["out"] / "capacity_sim.md").read_text())
    print(f"{meta['seconds']} s; plot {'written' if plotted else 'skipped'}")


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v.strip()]


if __name__ == "__main__":
    main()
