"""One serving-benchmark run's phases: the engine in-process (before the services), the
services and client processes, the rate probe, and each gRPC scenario (preload, warmup, the
measured requests with the services' counters read before and after), turned into rows; a gRPC
row keeps the workers' step profile over it ("steps", bench/serve/steps.py)."""
from __future__ import annotations

import argparse
import os
import pathlib
import shutil
import time

from bench.serve import fleet as serve_fleet, metrics as sm, model as serve_model
from bench.serve import report as serve_report, scenarios as ss, steps as serve_steps


def engine_options(args, manifest: dict, ids: list[str]) -> dict:
    """The worker's engine options from the convenience flags (the worker's defaults where
    unset), the pool made large enough to hold every adapter of the run at once."""
    from services.common.runtime import parse_bytes
    from services.worker.config import flag_defaults
    d = flag_defaults()
    elem = 4 if args.device == "cpu" else 2                 # the pool's dtype: fp32 / bf16
    need = sum(elem * manifest["elements"][rank_of(a)] for a in ids)

    def get(key: str):
        value = getattr(args, key)
        return d[key] if value is None else value
    return {"device": args.device, "dtype": "auto",
            "kv_cache_bytes": parse_bytes(get("kv_cache_bytes")),
            "max_batch_tokens": int(get("max_batch_tokens")),
            "max_prefill_with_decode": int(get("max_prefill_with_decode")),
            "max_running": int(get("max_running")),
            "pool_bytes": max(parse_bytes(get("gpu_pool_bytes")), int(1.25 * need) + (16 << 20)),
            "pool_slots": max(int(get("pool_slots")), len(ids) + 1)}


WORKER_FLAGS = ("gpu_pool_bytes", "kv_cache_bytes", "max_running", "max_batch_tokens",
                "max_prefill_with_decode", "host_pool_bytes", "pool_slots", "eviction")


def service_args(args, manifest: dict, s3, shm: str | None) -> tuple[list, list, list]:
    """The store's, the worker's and the router's flags: sources, the shared-memory directory
    (store and worker on this host), the convenience flags that are set, then each service's
    pass-through flags."""
    store = (["--adapters-dir", manifest["dir"]] if s3 is None else
             ["--s3-endpoint", s3.endpoint, "--bucket", s3.bucket])
    if args.store_host_bytes:
        store += ["--host-cache-bytes", str(args.store_host_bytes)]
    worker = ["--device", args.device]
    if shm:
        store += ["--shm-dir", shm]
        worker += ["--store-shm-dir", shm]
    for key in WORKER_FLAGS:
        if getattr(args, key) is not None:
            worker += [f"--{key.replace('_', '-')}", str(getattr(args, key))]
    router = []
    if args.max_in_flight_per_worker:
        router += ["--max-in-flight-per-worker", str(args.max_in_flight_per_worker)]
    return store + args.store_flag, worker + args.worker_flag, router + args.router_flag


def _flag_value(flags: list[str], name: str, default: int) -> int:
    """The value of --name=V or --name V among pass-through flags (the worker's own, so the
    engine in-process warms up as the worker does)."""
    for i, f in enumerate(flags):
        if f.startswith(name + "="):
            return int(f.split("=", 1)[1])
        if f == name and i + 1 < len(flags):
            return int(flags[i + 1])
    return default


def trace_rows(records: list[dict]) -> list[dict]:
    """What bench/capacity/sim.py replays of one phase's client records: arrival offset from
    the phase's first send (s), adapter, tenant, phase, prompt and output tokens, the tier the
    adapter came from (gpu, worker_host, store_host, source), TTFT and end-to-end (s)."""
    if not records:
        return []
    t0 = min(r["send"] for r in records)
    return [{"at": round(r["send"] - t0, 6), "adapter": r["adapter"], "tenant": r["tenant"],
             "phase": r["phase"], "prompt": r["prompt"], "output": r["tokens"],
             "tier": (r["timings"] or {}).get("adapter_tier"), "status": r["status"],
             "ttft_s": round(r["times"][0] - r["send"], 6) if r["times"] else None,
             "e2e_s": round(r["end"] - r["send"], 6)} for r in records]


def rank_of(adapter_id: str) -> int:
    return int(serve_model.ADAPTER_ID.fullmatch(adapter_id).group(1))


class Bench:
    """The run's state: adapters handed out so far, the stack, the client pool, the rows."""

    def __init__(self, args, model: pathlib.Path, cfg: dict, manifest: dict):
        self.args, self.model, self.cfg, self.manifest = args, model, cfg, manifest
        self.vocab = cfg["vocab_size"]
        self.used: set[str] = set()
        self.last_cold: dict[int, list[str]] = {}          # rank -> the last cold stream's
        self.rows: list[dict] = []
        self.cdfs: dict[str, dict] = {}
        self.traces: dict[str, list[dict]] = {}          # scenario -> trace_rows (--trace-out)
        self.stack = self.pool = self.s3 = self.shm = None
        self.header: dict = {}

    def ids(self, s: ss.Scenario) -> list[str]:
        """The scenario's adapters: the first `adapters` generated of its rank (of its ranks
        in turn, for mixed ranks)."""
        if s.ranks and s.adapters:
            return ss.mixed_ids(self.manifest["ids"], s.ranks, s.adapters)
        return self.manifest["ids"].get(s.rank, [])[:s.adapters] if s.adapters else []

    def cold_ids(self, s: ss.Scenario) -> list[str]:
        """The cold stream's adapters: fresh ones, or the last cold stream's of the rank,
        dropped from the worker's pool (cold_adapters host) or from the worker (store)."""
        if s.cold_adapters == "fresh":
            return self.fresh(s)
        from bench.serve.stack import offload
        ids = self.last_cold.get(s.rank, [])[:s.cold_requests]
        if len(ids) < s.cold_requests:
            raise SystemExit(f"scenario {s.name}: cold_adapters={s.cold_adapters} needs an earlier cold "
                             f"stream of {s.cold_requests} rank-{s.rank} adapters")
        offload(self.stack.worker.addr, ids, to_host=s.cold_adapters == "host")
        return ids

    def fresh(self, s: ss.Scenario) -> list[str]:
        """cold_n adapters of the scenario's rank that no scenario has used yet."""
        out = [a for a in self.manifest["ids"].get(s.rank, []) if a not in self.used]
        out = out[:s.cold_requests]
        if len(out) < s.cold_requests:
            raise SystemExit(f"scenario {s.name}: {s.cold_requests} fresh rank-{s.rank} "
                             f"adapters needed, {len(out)} left (--adapters)")
        return out

    def requests(self, s: ss.Scenario, phase: str, n: int | None = None) -> list:
        return ss.build_requests(s, self.ids(s), self.vocab, self.args.tenants, self.args.seed,
                                 phase, n)

    # ---- the engine in-process, before the services ----------------------------------------
    def run_engine(self, scenarios: list[ss.Scenario]) -> None:
        from bench.serve.engine import run_in_subprocess
        jobs, adapters = [], {}
        for s in scenarios:
            adapters.update({a: str(pathlib.Path(self.manifest["dir"]) / a) for a in self.ids(s)})
            jobs.append({"name": s.name, "concurrency": s.concurrency,
                         "warmup": self.requests(s, "warmup", s.warmup) if s.warmup else [],
                         "requests": self.requests(s, "measure")})
        opts = engine_options(self.args, self.manifest, list(adapters))
        print(f"engine: in-process run of {', '.join(s.name for s in scenarios)}", flush=True)
        results = run_in_subprocess({"model": str(self.model), "options": opts,
                                     "adapters": adapters, "jobs": jobs,
                                     "warmup_max_rank": _flag_value(self.args.worker_flag,
                                                                    "--warmup-max-rank", 128)},
                                    3600)
        self.header["engine_options"] = opts
        for s in scenarios:
            self.record(s, results[s.name], None, None)

    # ---- the services -------------------------------------------------------------------------
    def start_services(self, work: pathlib.Path) -> None:
        from bench.serve.load import ClientPool
        from bench.serve.stack import S3_ENV, S3Source, Stack
        logs = work / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        ids = [a for v in self.manifest["ids"].values() for a in v]
        if self.args.source == "s3":
            self.s3 = S3Source(logs)
            self.s3.upload(pathlib.Path(self.manifest["dir"]), ids)
            env.update(S3_ENV)
        if self.args.transfer == "shm":
            self.shm = f"/dev/shm/lorafleet-bench-{os.getpid()}"
            os.makedirs(self.shm, exist_ok=True)
        store, _, router = service_args(self.args, self.manifest, self.s3, self.shm)
        overrides, shared = serve_fleet.layout(self.args)
        workers = [service_args(argparse.Namespace(**{**vars(self.args), **o}), self.manifest,
                                self.s3, self.shm)[1] for o in overrides]
        self.stack = Stack(self.model, logs, store, workers, router, env,
                           0 if self.s3 else len(ids), self.args.start_timeout).start()
        if self.s3 is not None:
            self.s3.register(self.stack.store.addr, ids)
        self.header["services"] = self.stack.commands()
        if len(workers) > 1:
            self.header["workers"] = {"count": len(workers), "layout": shared,
                                      "commands": self.stack.worker_commands()}
        if self.s3 is not None:
            self.header["services"]["moto"] = f"moto.server on {self.s3.endpoint}"
        self.header["logs"] = str(logs)
        self.pool = ClientPool(self.args.clients, self.stack.router.addr,
                               self.args.request_timeout)

    def save_partial(self) -> None:
        """The rows so far, in case a later scenario never finishes (OUT/partial-rows.json)."""
        import json
        out = pathlib.Path(self.args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "partial-rows.json").write_text(json.dumps(self.rows, indent=1, default=str))

    def stop(self) -> None:
        for part in (self.pool, self.stack, self.s3):
            if part is not None:
                try:
                    part.stop()
                except Exception as exc:  # noqa: BLE001 - stop the others too
                    print(f"stopping {type(part).__name__}: {exc}", flush=True)
        if self.shm:
            shutil.rmtree(self.shm, ignore_errors=True)

    def probe(self) -> float:
        """req/s of a closed loop at --probe-concurrency on the base model; returns 90% of it."""
        a = self.args
        s = ss.Scenario("probe", concurrency=a.probe_concurrency, requests=a.probe_requests
                        or 4 * a.probe_concurrency, prompt=a.defaults["prompt"],
                        output=a.defaults["output"])
        self.pool.run(self.requests(s, "warmup", min(s.requests, s.concurrency)), s.concurrency)
        fig = sm.client_figures(self.pool.run(self.requests(s, "measure"), s.concurrency))
        if fig["errors"] or not fig["req_s"]:
            raise SystemExit(f"the rate probe failed: {fig['errors']} {fig['error_examples']}")
        rate = round(0.9 * fig["req_s"], 3)
        self.header["probe"] = {"concurrency": s.concurrency, "requests": s.requests,
                                "req_s": fig["req_s"], "out_tok_s": fig["out_tok_s"],
                                "rate": rate}
        print(f"probe: {fig['req_s']:.2f} req/s at concurrency {s.concurrency}; rate auto = "
              f"{rate:.2f} req/s", flush=True)
        return rate

    def run_grpc(self, s: ss.Scenario) -> list[dict]:
        """Preload and warm up (unmeasured), then the measured requests (with the cold stream
        on fresh adapters), the worker's and the store's counters read around them; returns
        the measured requests' client records."""
        from bench.serve.stack import residency, store_stats, worker_info
        ids, start = self.ids(s), time.monotonic()
        if s.preload:
            self._preload(s, ids)
        warm = []
        if s.warmup:
            warm = self.pool.run(self.requests(s, "warmup", s.warmup), s.concurrency)
        self.used.update(ids)
        cold = self.cold_ids(s)
        self.used.update(cold)
        if cold:
            self.last_cold[s.rank] = cold
        reqs = self.requests(s, "measure") + ss.cold_stream(
            s, cold, self.vocab, self.args.tenants, self.args.seed, s.requests)
        if s.burst:
            reqs += ss.burst_requests(s, ids, self.vocab, self.args.tenants, self.args.seed,
                                      len(reqs), ss.burst_time(s))
        addrs = [w.addr for w in self.stack.workers]
        w0, st0 = [worker_info(a) for a in addrs], store_stats(self.stack.store.addr)
        kill = self._kill_plan(s, w0[s.kill_worker].cold_load_seq if s.kill_at else 0)
        records = self.pool.run(reqs, s.concurrency)
        if kill is not None:
            tail = self.rejoin_tail(s, kill, len(reqs))
            records += self.pool.run(tail, s.concurrency)
            reqs += tail
            kill.finish()
        addrs = [w.addr for w in self.stack.workers]           # a restart keeps the port
        w1 = [worker_info(a, since=b.cold_load_seq if worker_info(a).worker_id == b.worker_id
                          else 0) for a, b in zip(addrs, w0)]
        st1 = store_stats(self.stack.store.addr)
        self.stack.check_alive()
        print(f"{s.name}: {len(records)} requests in {time.monotonic() - start:.1f}s",
              flush=True)
        more, lost = {}, ({kill.index: kill.lost_info} if kill is not None else None)
        more["steps"] = serve_steps.summary(serve_steps.delta(w0, w1, lost))
        if len(addrs) > 1:
            snaps = [residency(a) for a in addrs]
            more["per_worker"] = serve_fleet.worker_rows(w0, w1, snaps, lost)
            more["multi_resident"] = serve_fleet.multi_resident(snaps, records)
        if kill is not None:
            more["killed"] = serve_fleet.classify(records, reqs, kill.events, kill.start_t)
            more["killed"].update(kill.router_retries())
            more["killed"].update(worker=kill.index, served_by_restarted=sum(
                serve_fleet.delta(None, w1[kill.index]).get("gpu", (0, 0))))
        self.record(s, records, (w0, w1, lost), (st0, st1), more)
        self.traces[s.name] = trace_rows(warm) + trace_rows(records)
        return records

    def rejoin_tail(self, s: ss.Scenario, kill, first_index: int) -> list:
        """A kill scenario's last requests, built once the restarted worker is live at the
        router again (so placement can move back to it however long the restart took)."""
        if not kill.wait_rejoined():
            raise RuntimeError(f"scenario {s.name}: worker {kill.index} did not rejoin: "
                               f"{kill.error or 'timed out'}")
        tail = self.requests(s, "rejoin", s.rejoin_requests)
        for r in tail:
            r.index += first_index
        print(f"{s.name}: worker {kill.index} rejoined; {len(tail)} more requests", flush=True)
        return tail

    def _kill_plan(self, s: ss.Scenario, since: int):
        """The kill-and-restart thread of a scenario with kill_at, started (else None)."""
        if not s.kill_at:
            return None
        if not 0 <= s.kill_worker < len(self.stack.workers) or len(self.stack.workers) < 2:
            raise SystemExit(f"scenario {s.name}: kill_worker={s.kill_worker} needs --workers "
                             f">= 2 and an index below it")
        kill = serve_fleet.KillRestart(self.stack, s.kill_worker, time.time(), s.kill_at,
                                       s.restart_after, since)
        kill.start()
        return kill

    def _preload(self, s: ss.Scenario, ids: list[str]) -> None:
        """One short request per adapter, one at a time (setup, not measured)."""
        recs = self.pool.run(ss.preload_requests(ids, self.vocab, self.args.tenants), 1)
        bad = [r for r in recs if r["status"] != "OK"]
        if bad:
            raise SystemExit(f"{s.name}: preload failed: {bad[0]['status']} {bad[0]['error']}")

    def record(self, s: ss.Scenario, records: list[dict], worker, store,
               extra: dict | None = None) -> None:
        """The scenario's rows: client figures, and for a gRPC run the services' deltas
        (worker: every worker's Info before and after, and a killed incarnation's at the
        kill by worker index, or None)."""
        fig = sm.client_figures(records)
        hits, tiers, more = {"gpu_hit_rate": None}, {}, {}
        if worker is not None:
            (w0, w1), (st0, st1) = serve_fleet.fleet_info(*worker), store
            hits = sm.hit_rates(w0, w1, st0, st1)
            recs = list(w1.cold_load_records)
            tiers = sm.cold_by_tier(recs, serve_fleet.histogram_delta(*worker), records)
            more["worker_cold_records"] = len(recs)
            if s.burst or s.cold_arrival == "burst":
                more.update(sm.burst_figures(records))
            if s.cold_requests:
                windows, source = sm.cold_windows(recs, records)
                more.update(sm.itl_split(records, windows), cold_windows_from=source,
                            cold_stream=sm.cold_stream_figures(records))
        more.update(extra or {})
        self.cdfs[s.name] = {"ttft": fig["_ttft"], "itl": fig["_itl"]}
        rows = serve_report.scenario_rows(s, fig, hits, tiers, more)
        for r in rows:
            r["workers"] = len(self.stack.workers) if self.stack else 1
        self.rows += rows
        r = rows[0]
        print(f"{s.name}: {r['out_tok_s']:.0f} tok/s, {r['req_s']:.2f} req/s, TTFT p50 "
              f"{r['ttft_p50_ms']} ms, ITL p50 {r['itl_p50_ms']} ms, errors {r['errors'] or 0}",
              flush=True)
