"""The serving benchmark's saturation suite (`python -m bench.serve.bench --suite saturation`,
issue 42): in one run against one stack, per workload, closed loops at fixed streams, a goodput
search (the highest Poisson rate sustained under the SLO; bench/serve/saturation_search.py) and
open-loop latency at fractions of the base model's goodput; a cold-fleet row (first touches)
before a workload's adapters are touched, steady-state rows after a warm-up pass that is not
measured. Results: OUT/saturation-<card>.{json,md,png} (bench/serve/saturation_report.py).

    python -m bench.serve.bench --suite saturation --quick --out /tmp/sat     # CPU, minutes
    python -m bench.serve.bench --suite saturation --shape 7b --device cuda \\
        --gpu-pool-bytes 4GiB --kv-cache-bytes 40GiB --max-running 256 --max-batch-tokens 4096
"""
from __future__ import annotations

import dataclasses
import math
import pathlib
import shutil

from bench.serve import scenarios as ss

# the GPU defaults (issue 42) and --quick's (tiny model, fp32 adapters in the pool: rank 8 is
# 112 KiB, rank 64 896 KiB; a pool of 3 MiB holds at most a quarter of the 128 rank-8 adapters
# and of the 32 mixed ones, and three rank-64 adapters at once: with room for one only, two
# waiting rank-64 loads were seen to stall each other)
GPU = {"sat_workloads": "zipf:1000,resident:32,zipf:2000,mixed:280,zipf:5,zipf:100",
       "sat_cold": "1000", "sat_open": "base,resident:32,zipf:1000", "streams": "64,128",
       "probe_s": 5.0, "slo_ttft_ms": 1000.0, "slo_itl_ms": 60.0, "warm_requests": 384,
       "probe_min_requests": 120}
QUICK = {"sat_workloads": "zipf:128,resident:2,mixed:32,zipf:2,zipf:8,zipf:32",
         "sat_cold": "128", "sat_open": "base,resident:2,zipf:128", "streams": "8,16",
         "probe_s": 2.5, "slo_ttft_ms": 1500.0, "slo_itl_ms": 400.0, "warm_requests": 48,
         "probe_min_requests": 24, "gpu_pool_bytes": "3MiB", "host_pool_bytes": "6MiB"}
MIXED_RANKS = (8, 16, 32, 64)
KINDS = ("base", "zipf", "resident", "mixed")


@dataclasses.dataclass(frozen=True)
class Workload:
    """One adapter population: base (none), zipf (rank 8, Zipf popularity), resident (rank
    16, uniform, preloaded), mixed (ranks 8-64 in turn, Zipf)."""
    kind: str
    adapters: int = 0
    zipf: float = 1.0

    @property
    def name(self) -> str:
        return "base" if self.kind == "base" else f"{self.kind}-{self.adapters}"

    @property
    def ranks(self) -> tuple[int, ...]:
        return {"base": (), "zipf": (8,), "resident": (16,), "mixed": MIXED_RANKS}[self.kind]

    def scenario(self, name: str, **load) -> ss.Scenario:
        """A Scenario of this workload; load: rate or concurrency, requests, prompt, output."""
        return ss.Scenario(name=name, adapters=self.adapters, rank=self.ranks[0] if
                           self.ranks else 8, zipf=0.0 if self.kind == "resident" else self.zipf,
                           ranks=self.ranks if self.kind == "mixed" else (),
                           preload=self.kind == "resident", **load)


def parse_workloads(text: str, zipf: float = 1.0) -> list[Workload]:
    """'zipf:1000,resident:32,mixed:280' -> workloads (base is always added first)."""
    out = [Workload("base")]
    for item in filter(None, (x.strip() for x in text.split(","))):
        kind, _, n = item.partition(":")
        if kind not in KINDS[1:] or not n.isdigit() or int(n) < 1:
            raise SystemExit(f"--sat-workloads: {item!r} is not KIND:N with KIND one of "
                             f"zipf, resident, mixed")
        if kind == "mixed" and int(n) % len(MIXED_RANKS):
            raise SystemExit(f"--sat-workloads: {item}: a multiple of {len(MIXED_RANKS)}")
        out.append(Workload(kind, int(n), zipf))
    names = [w.name for w in out]
    if len(set(names)) != len(names):
        raise SystemExit(f"--sat-workloads: repeated: {names}")
    return out


def add_flags(p) -> None:
    g = p.add_argument_group("saturation suite (--suite saturation; GPU / --quick defaults)")
    a = g.add_argument
    a("--sat-workloads", help="KIND:N,... in the order run after the base model, KIND zipf "
      f"(rank 8), resident (rank 16), mixed (ranks 8-64) ({GPU['sat_workloads']} / "
      f"{QUICK['sat_workloads']})")
    a("--sat-cold", help="Zipf adapter counts also measured as a cold fleet (first touches, "
      f"closed loop at the first of --streams) before anything touches them "
      f"({GPU['sat_cold']} / {QUICK['sat_cold']}; none: no cold rows)")
    a("--sat-open", help="workloads with open-loop rows at --open-fracs of the base model's "
      f"goodput ({GPU['sat_open']} / {QUICK['sat_open']}; all: every one)")
    a("--streams", help="closed-loop streams (64,128 / 8,16)")
    a("--closed-rounds", type=int, default=3, help="closed-loop requests = ROUNDS x streams")
    a("--probe-s", type=float, help="seconds of Poisson arrivals per probe and open row (5 / 2.5)")
    a("--probe-min-requests", type=int, help="fewest requests of a probe (120 / 24)")
    a("--max-probes", type=int, default=4, help="goodput probes per workload")
    a("--search-tol", type=float, default=0.05, help="stop once (hi - lo) / lo <= this")
    a("--search-step", type=float, default=1.25, help="bracketing factor")
    a("--slo-ttft-ms", type=float, help="SLO: TTFT p99 (1000 / 1500)")
    a("--slo-itl-ms", type=float, help="SLO: ITL p99 (60 / 400)")
    a("--min-ratio", type=float, default=0.97, help="sustained: achieved >= this x offered")
    a("--open-fracs", default="0.25,0.5,0.75", help="open-loop rates, fractions of base goodput")
    a("--warm-requests", type=int, help="the unmeasured Zipf pass before a steady workload "
      "(384 / 48)")
    a("--deadline-s", type=float, default=0.0, help="stop probing this many seconds after the "
      "process started (writing the model and adapters and the start-up count; 0: never); "
      "what is left is skipped and said so, the results still written")


def defaults(args) -> None:
    """Fill in the suite's flags for the machine (before bench.serve.bench.resolve)."""
    gpu = not args.quick and args.device != "cpu"
    for key, value in (QUICK if args.quick else GPU).items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    args.stream_counts = [int(x) for x in str(args.streams).split(",") if x.strip()]
    args.fracs = [float(x) for x in args.open_fracs.split(",") if x.strip()]
    if not args.stream_counts or min(args.stream_counts) < 1:
        raise SystemExit("--streams: positive counts")
    args.gpu_run = gpu


def cold_list(args, workloads: list[Workload]) -> list[Workload]:
    counts = {int(x) for x in str(args.sat_cold).split(",") if x.strip().isdigit()}
    return [w for w in workloads if w.kind == "zipf" and w.adapters in counts]


def open_list(args, workloads: list[Workload]) -> list[str]:
    if args.sat_open == "all":
        return [w.name for w in workloads]
    names = {x.strip().replace(":", "-") for x in args.sat_open.split(",")}
    return [w.name for w in workloads if w.name in names]


def all_scenarios(workloads: list[Workload]) -> list[ss.Scenario]:
    """One scenario per workload (what prepare() generates adapters for)."""
    return [w.scenario(w.name, concurrency=1) for w in workloads]


def _bytes_to_write(args, workloads: list[Workload], work: pathlib.Path) -> int:
    """What prepare() would still write: the checkpoint (unless --model or already there)
    and every adapter of the workloads not on disk yet."""
    from bench.serve import model as serve_model
    cfg = serve_model.model_config(args.shape)
    elem = 2 if args.adapter_dtype == "bf16" else 4
    total = 0
    if not args.model and not (work / f"model-{args.shape}" / "config.json").exists():
        total += sum(2 * math.prod(d) for _, d in serve_model._tensor_shapes(cfg))
    targets = [t for t in args.targets.split(",") if t]
    for rank, n in ss.adapter_needs(all_scenarios(workloads)).items():
        have = sum((work / "adapters" / serve_model.adapter_id(rank, i) /
                    "adapter_model.safetensors").exists() for i in range(n))
        total += (n - have) * elem * serve_model.adapter_elements(cfg, rank, targets)
    return total


def fit_disk(args, workloads: list[Workload], work: pathlib.Path,
             reserve: int = 4 << 30) -> tuple[list[Workload], str]:
    """The workloads with the mixed-ranks set shrunk (halved, a multiple of 4, at least 16;
    else left out) until what is to be written fits the work directory's free space less
    `reserve`; and a note saying what was shrunk ('' when nothing)."""
    work.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(work).free - reserve
    out, note = list(workloads), ""
    while _bytes_to_write(args, out, work) > free:
        i = next((k for k, w in enumerate(out) if w.kind == "mixed"), None)
        if i is None:
            break
        n = out[i].adapters // 2 // len(MIXED_RANKS) * len(MIXED_RANKS)
        was = out[i].name
        out = out[:i] + ([dataclasses.replace(out[i], adapters=n)] if n >= 16 else []) \
            + out[i + 1:]
        note = f"{was} -> {out[i].name if n >= 16 else 'left out'}: too little disk " \
               f"({free / 2**30:.1f} GiB free less {reserve >> 30} GiB kept)"
        print(f"saturation: {note}", flush=True)
    return out, note
