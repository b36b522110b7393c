"""Scenarios of the serving benchmark: parsing (`name:key=value,...;...`), the preset suites, and
the reproducible request lists (Zipf adapter popularity, Poisson arrivals, length ranges).

Plain Python (no torch, no gRPC), so the client processes and the tests import it cheaply.
"""
from __future__ import annotations

import dataclasses
import itertools
import random
from dataclasses import dataclass, field

KEYS = ("adapters", "rank", "zipf", "rate", "concurrency", "requests", "warmup", "prompt",
        "output", "preload", "cold", "cold_n", "cold_adapters", "path", "twin", "burst",
        "burst_prompt", "burst_at", "kill_at", "kill_worker", "restart_after", "after_rejoin",
        "cold_arrival")
COLD_ADAPTERS = ("fresh", "store", "host")
COLD_ARRIVALS = ("poisson", "burst", "chain")


def parse_range(text: str, what: str) -> tuple[int, int]:
    """'128' -> (128, 128); '64:256' -> (64, 256)."""
    lo, _, hi = str(text).partition(":")
    try:
        lo_i, hi_i = int(lo), int(hi or lo)
    except ValueError:
        raise ValueError(f"{what}: {text!r} is not N or LO:HI") from None
    if not 1 <= lo_i <= hi_i:
        raise ValueError(f"{what}: {text!r} needs 1 <= LO <= HI")
    return lo_i, hi_i


@dataclass(frozen=True)
class Scenario:
    """One measured workload. Exactly one of rate (open loop, req/s; "auto" until the probe
    ran) and concurrency (closed loop) is set. adapters 0 = the base model."""
    name: str
    adapters: int = 0
    rank: int = 8
    zipf: float = 1.0
    rate: float | str | None = None
    concurrency: int | None = None
    requests: int = 100
    warmup: int = 0
    prompt: tuple[int, int] = (128, 128)
    output: tuple[int, int] = (128, 128)
    preload: bool = False
    cold: float = 0.0                   # an extra open-loop stream, req/s, one adapter each
    cold_n: int = 0                     # most requests of that stream (each its own adapter)
    # the stream's adapters: fresh (never used: loads from the source), or the previous cold
    # stream's of this rank, dropped from the worker (store: loads from the store's host
    # tier) or from its pool only (host: loads from the worker's host tier)
    cold_adapters: str = "fresh"
    # how the cold stream arrives: poisson (at `cold` req/s), burst (all at burst_at s into the
    # stream), chain (one at a time from burst_at s, each once the one before it has its first
    # token); burst and chain need no rate, only cold_n
    cold_arrival: str = "poisson"
    path: str = "grpc"                  # grpc: through the services; engine: in-process
    twin: str = ""                      # replay this scenario's requests (the engine's twin)
    # rate=sat*F: F times the saturation the probe measured (the base model's closed-loop
    # req/s); rate is "auto" until the probe ran
    rate_frac: float | None = None
    burst: int = 0                      # requests that all arrive at burst_at (a prefill burst)
    burst_prompt: tuple[int, int] = (1024, 1024)
    burst_at: float = 0.0               # seconds into the measured stream (0: half way)
    # kill_at > 0: worker kill_worker is SIGKILLed that many seconds into the measured stream
    # and started again restart_after seconds later (same flags, same port)
    kill_at: float = 0.0
    kill_worker: int = 0
    restart_after: float = 0.0
    # requests sent once the restarted worker is live at the router again (open loop at the
    # scenario's rate, or its closed loop): 0 = a tenth of `requests` in a kill scenario
    after_rejoin: int = 0
    # mixed ranks (S-LoRA's row): the adapters taken from these ranks in turn (rank unused)
    ranks: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if (self.rate is None) == (self.concurrency is None):
            raise ValueError(f"scenario {self.name}: give exactly one of rate and concurrency")
        if self.rate not in (None, "auto") and not float(self.rate) > 0:
            raise ValueError(f"scenario {self.name}: rate must be > 0 or auto")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError(f"scenario {self.name}: concurrency must be >= 1")
        if self.adapters < 0 or self.requests < 1 or self.warmup < 0 or self.zipf < 0:
            raise ValueError(f"scenario {self.name}: adapters, warmup, zipf >= 0; requests >= 1")
        if self.path not in ("grpc", "engine"):
            raise ValueError(f"scenario {self.name}: path is grpc or engine")
        if self.cold_arrival not in COLD_ARRIVALS:
            raise ValueError(f"scenario {self.name}: cold_arrival is one of "
                             f"{', '.join(COLD_ARRIVALS)}")
        if (self.cold > 0 or self.cold_arrival != "poisson") and self.cold_n < 1:
            raise ValueError(f"scenario {self.name}: a cold stream needs cold_n >= 1")
        if self.rate_frac is not None and not 0 < self.rate_frac <= 2:
            raise ValueError(f"scenario {self.name}: rate=sat*F needs 0 < F <= 2")
        if self.burst < 0 or self.burst_at < 0:
            raise ValueError(f"scenario {self.name}: burst and burst_at must be >= 0")
        if min(self.kill_at, self.kill_worker, self.restart_after, self.after_rejoin) < 0:
            raise ValueError(f"scenario {self.name}: kill_at, kill_worker, restart_after, "
                             f"after_rejoin >= 0")
        if self.cold_adapters not in COLD_ADAPTERS:
            raise ValueError(f"scenario {self.name}: cold_adapters is one of {', '.join(COLD_ADAPTERS)}")

    @property
    def cold_requests(self) -> int:
        return self.cold_n if self.cold > 0 or self.cold_arrival != "poisson" else 0

    @property
    def rejoin_requests(self) -> int:
        """The requests of a kill scenario's tail, sent after the restarted worker rejoined."""
        return (self.after_rejoin or max(1, self.requests // 10)) if self.kill_at else 0


def parse_scenario(text: str, defaults: dict) -> Scenario:
    """'name:key=value,...' over `defaults` (a dict of Scenario fields)."""
    name, _, body = text.strip().partition(":")
    if not name:
        raise ValueError(f"--scenarios: {text!r} has no name")
    given = {}
    for item in filter(None, (x.strip() for x in body.split(","))):
        key, eq, value = item.partition("=")
        if not eq or key not in KEYS:
            raise ValueError(f"scenario {name}: {item!r} is not KEY=VALUE with KEY one of "
                             f"{', '.join(KEYS)}")
        if key == "rate" and value.startswith("sat*"):
            given["rate"], given["rate_frac"] = "auto", _value("zipf", value[4:], name)
            continue
        given[key] = _value(key, value, name)
    values = {**defaults, **given}
    if "rate" in given and "concurrency" not in given:      # the mode given replaces the default
        values["concurrency"] = None
    if "concurrency" in given and "rate" not in given:
        values["rate"] = None
    return Scenario(name=name, **values)


def _value(key: str, value: str, name: str):
    try:
        if key in ("prompt", "output", "burst_prompt"):
            return parse_range(value, f"scenario {name}: {key}")
        if key == "rate":
            return "auto" if value == "auto" else float(value)
        if key in ("zipf", "cold", "burst_at", "kill_at", "restart_after"):
            return float(value)
        if key == "preload":
            return value not in ("0", "false", "no", "")
        if key in ("path", "cold_adapters", "twin", "cold_arrival"):
            return value
        return int(value)
    except ValueError as exc:
        raise ValueError(f"scenario {name}: {key}={value!r}: {exc}") from None


def parse_scenarios(text: str, defaults: dict) -> list[Scenario]:
    out = [parse_scenario(t, defaults) for t in text.split(";") if t.strip()]
    names = [s.name for s in out]
    if len(set(names)) != len(names):
        raise ValueError(f"--scenarios: names repeat: {names}")
    return out


# ------------------------------------------------------------------------------------- suites
def suite(name: str, g) -> list[str]:
    """A preset's scenario strings; g holds the suite-wide values (rate, concurrency, ...)."""
    if name == "slora":
        return [f"slora-{'base' if n == 0 else n}:adapters={n},rank=8,zipf=1.0,rate={g.rate}"
                for n in (0, 5, 100, 1000, 2000)]
    if name == "resident":
        return [f"resident-base:adapters=0,concurrency={g.concurrency}",
                f"resident-32:adapters=32,rank=16,zipf=0,concurrency={g.concurrency},preload=1"]
    if name == "cold":
        steady = f"adapters=32,rank=16,zipf=0,rate={g.steady_rate or g.rate},preload=1"
        stream = f"{steady},cold={g.cold_rate},cold_n={g.cold_requests}"
        return [f"cold-off:{steady}", f"cold-on:{stream}",
                f"cold-store:{stream},cold_adapters=store", f"cold-host:{stream},cold_adapters=host"]
    if name == "latency":                # open loop from 20% to 100% of saturation, and a burst
        rows = [f"lat-{'base' if n == 0 else n}-{int(f * 100)}:adapters={n},rank=16,zipf=1.0,"
                f"rate=sat*{f}" for n in (0, 32) for f in (0.2, 0.4, 0.6, 0.8, 1.0)]
        return rows + ["prefill_burst:adapters=32,rank=16,zipf=1.0,rate=sat*0.5,burst=64,"
                       f"burst_prompt={g.burst_prompt}"]
    if name == "quick":
        small = "prompt=8:16,output=4:8"
        resident = f"adapters=2,rank=8,zipf=0,concurrency=4,preload=1,requests=48,warmup=4,{small}"
        return [f"quick-base:adapters=0,concurrency=4,requests=24,warmup=4,{small}",
                f"quick-2:adapters=2,rank=8,zipf=1.0,rate=15,requests=24,warmup=4,{small}",
                # more adapters than the pool holds: loads from every tier, several at once
                f"quick-many:adapters=16,rank=8,zipf=0.5,concurrency=4,requests=48,{small}",
                f"quick-resident:{resident}",
                f"quick-cold:{resident},cold=10,cold_n=4",
                f"quick-cold-store:{resident},cold=10,cold_n=4,cold_adapters=store"]
    if name == "saturation":
        raise ValueError("--suite saturation runs alone (bench/serve/saturation.py)")
    raise ValueError(f"--suite: unknown suite {name!r} (slora, resident, cold, latency, quick, "
                     "engine, saturation)")


def engine_twin(scenarios: list[Scenario], g) -> Scenario:
    """The in-process engine run of the suite's resident case: the last preloaded closed-loop
    scenario with adapters, else the `resident` suite's 32-adapter case."""
    for s in reversed(scenarios):
        if s.path == "grpc" and s.preload and s.concurrency and s.adapters and not s.cold:
            return dataclasses.replace(s, name=f"{s.name}-engine", path="engine", cold=0.0,
                                       cold_n=0, twin=s.name)
    return dataclasses.replace(
        parse_scenario(suite("resident", g)[1], g.defaults), name="resident-32-engine",
        path="engine", twin="resident-32")


def mixed_ids(ids: dict[int, list[str]], ranks: tuple[int, ...], n: int) -> list[str]:
    """n adapters taken from `ranks` in turn (the first of each, then the second, ...), so
    every popularity level holds each rank alike."""
    out = [ids.get(r, [])[i // len(ranks)] if i // len(ranks) < len(ids.get(r, [])) else None
           for i, r in zip(range(n), itertools.cycle(ranks))]
    if None in out:
        raise SystemExit(f"{n} adapters of ranks {ranks}: too few generated")
    return out


def rank_counts(s: Scenario) -> dict[int, int]:
    """rank -> adapters of it the scenario uses."""
    if not s.ranks:
        return {s.rank: s.adapters}
    return {r: len(range(i, s.adapters, len(s.ranks))) for i, r in enumerate(s.ranks)}


def adapter_needs(scenarios: list[Scenario]) -> dict[int, int]:
    """rank -> adapters to generate: the largest scenario's count plus one fresh adapter per
    cold-stream request."""
    need: dict[int, int] = {}
    for s in scenarios:
        for rank, n in rank_counts(s).items():
            need[rank] = max(need.get(rank, 0), n)
    for s in scenarios:
        if s.cold_requests and s.cold_adapters == "fresh":
            need[s.rank] = need.get(s.rank, 0) + s.cold_requests
    return {r: n for r, n in need.items() if n}


# ------------------------------------------------------------------------------- request lists
@dataclass
class Request:
    """One request as the client sends it (plain data: pickled to client processes)."""
    index: int
    adapter: str                         # "" = base model
    tenant: str
    prompt: list[int]
    max_new: int
    at: float | None = None              # open loop: send at start + at (s); None: closed loop
    cold: bool = False                   # part of the cold stream
    phase: str = "measure"
    extra: dict = field(default_factory=dict)


def zipf_weights(n: int, alpha: float) -> list[float]:
    """Popularity of adapter i (0-based) ~ 1 / (i + 1)^alpha (alpha 0 = uniform)."""
    return [1.0 / (i + 1) ** alpha for i in range(n)]


def poisson_times(rng: random.Random, rate: float, n: int) -> list[float]:
    return list(itertools.accumulate(rng.expovariate(rate) for _ in range(n)))


def build_requests(s: Scenario, adapter_ids: list[str], vocab: int, tenants: int, seed: int,
                   phase: str = "measure", n: int | None = None) -> list[Request]:
    """The scenario's requests for one phase (measure or warmup), the same for the same seed.
    adapter_ids: the scenario's adapters (empty for the base model)."""
    rng = random.Random(f"{seed}:{s.twin or s.name}:{phase}")
    n = s.requests if n is None else n
    if adapter_ids:
        picks = rng.choices(range(len(adapter_ids)), zipf_weights(len(adapter_ids), s.zipf), k=n)
    else:
        picks = [None] * n
    times = poisson_times(rng, float(s.rate), n) if s.rate is not None else [None] * n
    out = []
    for i, (pick, at) in enumerate(zip(picks, times)):
        plen, olen = rng.randint(*s.prompt), rng.randint(*s.output)
        tenant = f"t{(pick if pick is not None else i) % tenants}"
        out.append(Request(i, adapter_ids[pick] if pick is not None else "", tenant,
                           [rng.randrange(10, vocab) for _ in range(plen)], olen, at,
                           phase=phase))
    return out


def cold_stream(s: Scenario, cold_ids: list[str], vocab: int, tenants: int, seed: int,
                first_index: int) -> list[Request]:
    """Requests each on its own adapter that is not on the GPU (Scenario.cold_adapters says
    where it comes from), arriving as Scenario.cold_arrival says: open loop at s.cold req/s;
    all at burst_time(s) (flagged burst); or from then one at a time (flagged chain: the client
    sends each once the one before it has its first token)."""
    rng = random.Random(f"{seed}:{s.name}:cold")
    if s.cold_arrival == "poisson":
        times, flag = poisson_times(rng, s.cold, len(cold_ids)), {}
    else:
        times, flag = [burst_time(s)] * len(cold_ids), {s.cold_arrival: True}
    out = []
    for k, (aid, at) in enumerate(zip(cold_ids, times)):
        plen, olen = rng.randint(*s.prompt), rng.randint(*s.output)
        out.append(Request(first_index + k, aid, f"t{k % tenants}",
                           [rng.randrange(10, vocab) for _ in range(plen)], olen, at, cold=True,
                           extra=dict(flag)))
    return out


def preload_requests(adapter_ids: list[str], vocab: int, tenants: int) -> list[Request]:
    """One short request per adapter (closed loop), so each is resident before measuring."""
    return [Request(i, a, f"t{i % tenants}", [10 + i % max(1, vocab - 10)] * 4, 1,
                    phase="preload") for i, a in enumerate(adapter_ids)]


def burst_requests(s: Scenario, adapter_ids: list[str], vocab: int, tenants: int, seed: int,
                   first_index: int, at: float) -> list[Request]:
    """s.burst requests that all arrive at `at` (s from the stream's start), with prompts of
    s.burst_prompt tokens, on the scenario's adapters as its stream picks them."""
    rng = random.Random(f"{seed}:{s.name}:burst")
    picks = (rng.choices(range(len(adapter_ids)), zipf_weights(len(adapter_ids), s.zipf),
                         k=s.burst) if adapter_ids else [None] * s.burst)
    out = []
    for k, pick in enumerate(picks):
        plen, olen = rng.randint(*s.burst_prompt), rng.randint(*s.output)
        out.append(Request(first_index + k, adapter_ids[pick] if pick is not None else "",
                           f"t{k % tenants}", [rng.randrange(10, vocab) for _ in range(plen)],
                           olen, at, extra={"burst": True}))
    return out


def burst_time(s: Scenario) -> float:
    """When the burst arrives: burst_at, else half way through the stream's arrivals."""
    return s.burst_at or (s.requests / float(s.rate) / 2 if s.rate else 0.0)
