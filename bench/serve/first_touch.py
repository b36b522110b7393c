"""Issue 43's benchmark: the first use of an adapter, and a fresh worker, through the services as
processes (the serving benchmark's stack, model, adapters, load and figures).

One stack runs the parts burst, one and churn, in that order; start runs after it, in its own
stacks (python -m bench.stack.startup):

  burst  the background alone (--base-streams base streams decoding, a closed loop: twice as
         many warm-up requests, then --base-requests measured), then the same background with
         --burst-adapters never-used rank --first-rank adapters requested at once, --first-at
         seconds in: their TTFT, the worker's cold loads of them stage by stage, and the base
         streams' ITL p99 while they waited, against the background alone's
  one    the same background with --one-adapters never-used adapters one at a time (each sent
         once the last one has its first token), and the base streams' own TTFT beside them
  churn  a closed loop of --base-streams streams over --churn-adapters rank --churn-rank
         adapters, Zipf 1.0, the pool smaller than the working set, no warm-up: the loads whose
         tier is the store's source (the worker's records say the tier)
  start  bench.stack.startup with the --burst-adapters workload (no preload, so the first run's
         requests are its adapters' first uses): start to SERVING on an empty and a warm kernel
         cache, the first run's tok/s against the second's

Results: OUT/first-touch-<card>.{json,md} ({"header", "rows", "cold_start_s", "warm_start_s",
"first_run_tok_s", "second_run_tok_s"}; rows: bench/serve/first_touch_report.py), and each
invocation's parts as OUT/first-touch-parts/PARTS-<card>.json, which --merge combines.

Expected on an H100, 7B shape (from bench/device/h200_serve.sh's estimates and issue 43's
figures: 64 base streams ~6,800 tok/s, ~53 req/s at 128/128 tokens; start to SERVING 142-184 s
on an empty kernel cache, ~22-40 s on a warm one):
  a fresh machine writes the checkpoint (13.5 GB) and 1,000 rank-8 + 48 rank-16 adapters
    (18 GB), whichever parts run                                                  60-120 s
  burst, one, churn (one stack): start to SERVING ~40 s (an empty kernel cache: 140-185 s),
    the background's warm-up and alone ~22 s, burst ~20 s, one ~20 s, churn (1,280 requests,
    first touches) ~30 s                                                  ~130 s (~280 s)
  start: two starts (empty kernel cache 140-185 s, warm ~25 s), the workload twice (640
    requests, ~12 s each) and the store and router each time                    ~230-280 s
so one device call for burst,one,churn and one for start (bash bench/device/h200_serve.sh
first-touch with PART=stack, then PART=start; PART=merge where both part files are).

    python -m bench.serve.first_touch --quick --out /tmp/ft          # CPU, tiny model, ~2 min
    python -m bench.serve.first_touch --shape 7b --device cuda --work /data/serve-work \\
        --gpu-pool-bytes 4GiB --kv-cache-bytes 40GiB --parts burst,one,churn
    python -m bench.serve.first_touch --merge OUT/first-touch-parts/*.json --out bench/results
"""
from __future__ import annotations

import dataclasses
import json
import pathlib
import shutil
import subprocess
import sys
import tempfile

from bench.lib.header import ROOT, card, card_slug
from bench.serve import bench as serve_bench, first_touch_report as rep, scenarios as ss
from bench.serve.run import WORKER_FLAGS, Bench

GPU = {"base_streams": 64, "base_requests": 1024, "burst_adapters": 32, "one_adapters": 16,
       "first_at": 3.0, "churn_adapters": 1000, "churn_requests": 1280, "start_requests": 640}
# the tiny model on a CPU: longer outputs so the background outlasts the first uses; a pool of
# 3 MiB (27 of the tiny model's rank-8 adapters in fp32, a fifth of the churn's 128)
QUICK = {"base_streams": 8, "base_requests": 128, "burst_adapters": 8, "one_adapters": 4,
         "first_at": 1.0, "churn_adapters": 128, "churn_requests": 192, "start_requests": 96,
         "output": "16:32", "gpu_pool_bytes": "3MiB", "host_pool_bytes": "6MiB"}
STACK_PARTS = ("burst", "one", "churn")


def parser():
    p = serve_bench.parser()
    p.description = __doc__.split("\n\n")[0]
    g = p.add_argument_group("first touch (GPU / --quick defaults)")
    a = g.add_argument
    a("--parts", default=",".join(rep.PARTS), help="which to run, of burst, one, churn, start")
    a("--merge", nargs="+", metavar="PART_JSON", help="only combine part files (OUT/"
      "first-touch-parts/*.json) into OUT/NAME.{json,md}")
    a("--base-streams", type=int, help="base streams decoding in the background, closed "
      "loop; the churn's and the start workload's streams too (64 / 8)")
    a("--base-requests", type=int, help="the background's measured requests per phase "
      "(1024 / 128): it must outlast the burst and the chain (a row says how many were sent)")
    a("--burst-adapters", type=int, help="never-used adapters requested at once; the start "
      "workload's adapters (32 / 8)")
    a("--one-adapters", type=int, help="never-used adapters one at a time (16 / 4)")
    a("--first-rank", type=int, default=16, help="their rank (16)")
    a("--first-at", type=float, help="seconds into the background when the burst and the "
      "chain start (3 / 1)")
    a("--churn-adapters", type=int, help="the churn's Zipf-1.0 adapters (1000 / 128)")
    a("--churn-requests", type=int, help="its measured requests (1280 / 192)")
    a("--churn-rank", type=int, default=8, help="their rank (8)")
    a("--start-requests", type=int, help="the start workload's requests, run twice (640 / 96)")
    return p


def resolve(args):
    for key, value in {**GPU, **(QUICK if args.quick else {})}.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args = serve_bench.resolve(args)
    args.part_list = [p.strip() for p in args.parts.split(",") if p.strip()]
    bad = [p for p in args.part_list if p not in rep.PARTS]
    if bad or not args.part_list:
        raise SystemExit(f"--parts: {args.parts!r}: a list of {', '.join(rep.PARTS)}")
    if args.workers != 1:
        raise SystemExit("first touch runs one worker (--workers 1)")
    return args


def scenarios(args) -> dict[str, ss.Scenario]:
    """The background, the burst and the chain on it (the background's own requests: twin),
    and the churn."""
    d = args.defaults
    bg = ss.Scenario("ft-background", concurrency=args.base_streams, requests=args.base_requests,
                     warmup=2 * args.base_streams, prompt=d["prompt"], output=d["output"])
    first = dict(rank=args.first_rank, warmup=0, twin=bg.name, burst_at=args.first_at)
    return {"background": bg,
            "burst": dataclasses.replace(bg, name="ft-burst", cold_n=args.burst_adapters,
                                         cold_arrival="burst", **first),
            "one": dataclasses.replace(bg, name="ft-one", cold_n=args.one_adapters,
                                       cold_arrival="chain", **first),
            "churn": ss.Scenario("ft-churn", adapters=args.churn_adapters,
                                 rank=args.churn_rank, zipf=1.0, concurrency=args.base_streams,
                                 requests=args.churn_requests, prompt=d["prompt"],
                                 output=d["output"])}


# ----------------------------------------------------------------------------- one stack
def measure(bench: Bench, s: ss.Scenario) -> tuple[list[dict], list]:
    """The serving bench's run of a scenario, and the worker's cold-load records over it."""
    from bench.serve.stack import worker_info
    addr = bench.stack.worker.addr
    seq = worker_info(addr).cold_load_seq
    records = bench.run_grpc(s)
    return records, list(worker_info(addr, since=seq).cold_load_records)


def serve_row(bench: Bench, s: ss.Scenario) -> dict:
    return next(r for r in reversed(bench.rows) if r["scenario"] == s.name)


def stack_rows(bench: Bench, sc: dict, parts: list[str], streams: int) -> list[dict]:
    rows = []
    if "burst" in parts or "one" in parts:
        recs, _ = measure(bench, sc["background"])
        rows.append(rep.background_row("background", recs, streams,
                                       serve_row(bench, sc["background"])))
    for part, label in (("burst", "burst"), ("one", "one-at-a-time")):
        if part in parts:
            s = sc[part]
            recs, loads = measure(bench, s)
            at_once = s.cold_n if s.cold_arrival == "burst" else 1
            rows.append(rep.first_use_row(label, at_once, recs, loads,
                                          bench.last_cold[s.rank], streams, serve_row(bench, s)))
            if rows[-1]["requests"] < s.cold_n:
                print(f"{label}: the background ended after {rows[-1]['requests']} of "
                      f"{s.cold_n} first uses were sent (raise --base-requests)", flush=True)
    if "churn" in parts:
        recs, loads = measure(bench, sc["churn"])
        rows.append(rep.churn_row("churn", sc["churn"], recs, loads,
                                  serve_row(bench, sc["churn"])))
    rep.link(rows)
    return rows


def run_stack(args, work: pathlib.Path, prepared, sc: dict, parts: list[str]) -> dict:
    """The stack parts in one stack: a part document."""
    model, cfg, manifest = prepared
    bench = Bench(args, model, cfg, manifest)
    try:
        bench.start_services(work)
        rows = stack_rows(bench, sc, parts, args.base_streams)
    except BaseException:
        print(f"failed; the work dir {work} (service logs in logs/) is kept", flush=True)
        raise
    finally:
        bench.stop()
    ran = [sc["background"]] * ("burst" in parts or "one" in parts) + [sc[p] for p in parts]
    header = serve_bench.header(args, model, cfg, manifest, ran, bench)
    return {"header": header, "parts": parts, "rows": rows}


# ------------------------------------------------------------------------------ start-up
def startup_argv(args, work: pathlib.Path, out: pathlib.Path, name: str, groups: str,
                 first: str) -> list[str]:
    """python -m bench.stack.startup with this run's model, adapters, services and streams:
    the measured workload `first` (the burst's adapters, no preload), then a short base run
    (its own varied workload is bench/device/h200_serve.sh startup's)."""
    a, (plo, phi), (olo, ohi) = args, args.defaults["prompt"], args.defaults["output"]
    lengths = f"prompt={plo}:{phi},output={olo}:{ohi},warmup=0,concurrency={a.base_streams}"
    argv = [sys.executable, "-m", "bench.stack.startup", "--work", str(work), "--out", str(out),
            "--name", name, "--adapters", groups, "--device", a.device, "--shape", a.shape,
            "--targets", a.targets, "--adapter-dtype", a.adapter_dtype, "--source", a.source,
            "--transfer", a.transfer, "--clients", str(a.clients), "--seed", str(a.seed),
            "--tenants", str(a.tenants), "--request-timeout", str(a.request_timeout),
            "--start-timeout", str(a.start_timeout),
            "--measure", f"{first}:adapters={a.burst_adapters},rank={a.first_rank},zipf=0,"
                         f"requests={a.start_requests},{lengths}",
            "--varied", f"ft-start-base:adapters=0,requests={a.base_streams},{lengths}"]
    argv += ["--quick"] * a.quick + ["--model", a.model] * bool(a.model) \
        + ["--commit", a.commit] * bool(a.commit)
    for key in (*WORKER_FLAGS, "store_host_bytes", "max_in_flight_per_worker"):
        if getattr(a, key) is not None:
            argv.append(f"--{key.replace('_', '-')}={getattr(a, key)}")
    for svc in ("store", "worker", "router"):
        argv += [f"--{svc}-flag={f}" for f in getattr(a, f"{svc}_flag")]
    return argv


def run_start(args, work: pathlib.Path, manifest: dict, slug: str) -> dict:
    """The start part through bench.stack.startup (its own stacks): a part document."""
    out = pathlib.Path(args.out) / "first-touch-parts" / "startup"     # not a part file
    name, first = f"startup-{slug}", f"ft-start-{args.burst_adapters}"
    groups = ",".join(f"{g['count']}x{g['rank']}" for g in manifest["groups"])
    argv = startup_argv(args, work, out, name, groups, first)
    print("start: " + " ".join(argv[1:]), flush=True)
    subprocess.run(argv, cwd=ROOT, check=True)
    result = json.loads((out / f"{name}.json").read_text())
    header = dict(result["header"])
    header["startup"] = {k: v for k, v in result.items()
                         if k not in ("header", "rows", *rep.START_FIELDS)}
    header["startup"]["results"] = str(out / f"{name}.json")
    return {"header": header, "parts": ["start"], "rows": rep.start_rows(result, first),
            "start": {k: result[k] for k in rep.START_FIELDS}}


# ---------------------------------------------------------------------------------- files
def write(out: pathlib.Path, name: str, doc: dict) -> pathlib.Path:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(doc, indent=1, default=str) + "\n")
    (out / f"{name}.md").write_text(rep.markdown(doc))
    print(f"wrote {out / name}.json and .md", flush=True)
    return out / f"{name}.md"


def run(args) -> pathlib.Path:
    """Prepare the model and every part's adapters (so a later part's call finds them), run the
    parts asked for, write each invocation's part file and the combined results."""
    parts, sc = args.part_list, scenarios(args)
    tmp = None if args.work else tempfile.mkdtemp(prefix="first-touch-")
    work = pathlib.Path(args.work or tmp).resolve()
    slug = card_slug(card(args.device), args.device)
    prepared = serve_bench.prepare(args, work, list(sc.values()))
    docs = []
    stack = [p for p in STACK_PARTS if p in parts]
    if stack:
        docs.append(run_stack(args, work, prepared, sc, stack))
    if "start" in parts:
        docs.append(run_start(args, work, prepared[2], slug))
    out = pathlib.Path(args.out)
    for d in docs:
        path = out / "first-touch-parts" / f"{'+'.join(d['parts'])}-{slug}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(d, indent=1, default=str) + "\n")
    if tmp:                  # a temp work dir is not reused: drop the model and adapters
        for part in work.iterdir():
            if part.name != "logs":
                shutil.rmtree(part, ignore_errors=True)
        print(f"service logs kept in {work / 'logs'}", flush=True)
    return write(out, args.name or f"first-touch-{slug}", rep.merge(docs))


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    if args.merge:
        docs = [json.loads(pathlib.Path(f).read_text()) for f in args.merge]
        h = docs[0]["header"]
        md = write(pathlib.Path(args.out),
                   args.name or f"first-touch-{card_slug(h['card'], h['device'])}",
                   rep.merge(docs))
    else:
        md = run(resolve(args))
    print(md.read_text(), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
