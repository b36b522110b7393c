"""The engine's in-process figure for the serving benchmark: the same workload as a gRPC scenario (a
closed loop, or open-loop arrivals at their times), run through
`services.worker.startup.factory.build_engine` + `Engine.submit` (no gRPC, no router, no store),
with every adapter placed in the pool up front.

It runs in a subprocess started (and finished) before the services: it needs the GPU memory the
worker will take. Records have the client records' shape (bench/serve/load.py), so the same
metrics apply.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import queue
import time


def run_in_subprocess(params: dict, timeout: float) -> dict:
    """run(params) in a spawned process; returns {scenario: records}."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    proc = ctx.Process(target=_child, args=(params, out))
    proc.start()
    deadline = time.monotonic() + timeout
    while True:
        try:
            result = out.get(timeout=5)
            break
        except queue.Empty:
            if not proc.is_alive():
                raise RuntimeError(f"the engine subprocess died (exit {proc.exitcode})")
            if time.monotonic() > deadline:
                proc.terminate()
                raise TimeoutError(f"the engine subprocess ran past {timeout:.0f}s")
    proc.join(60)
    if isinstance(result, str):
        raise RuntimeError(f"the engine subprocess failed: {result}")
    return result


def _child(params: dict, out) -> None:
    try:
        out.put(run(params))
    except Exception as exc:  # noqa: BLE001 - reported to the parent, which raises
        import traceback
        traceback.print_exc()
        out.put(f"{type(exc).__name__}: {exc}")


def run(params: dict) -> dict:
    """params: model, options (EngineOptions fields), cpu_threads, adapters {id: dir}, jobs
    [{name, concurrency, warmup: [Request], requests: [Request]}]."""
    import torch
    from services.worker.adapters.layout import staged_from_peft_dir
    from services.worker.config import EngineOptions
    from services.worker.perf_config import PerfConfig
    from services.worker.startup.factory import build_engine
    # the worker's own performance choices (it reads LORAFLEET_* in its config)
    opts = EngineOptions(**params["options"], perf=PerfConfig.from_env(os.environ))
    threads = params.get("cpu_threads", 1)          # as the worker's --cpu-threads default
    if opts.device == "cpu" and threads > 0:
        torch.set_num_threads(threads)
    start = time.monotonic()
    built = build_engine(params["model"], opts)
    if params.get("warmup", opts.device != "cpu"):   # as the worker does before SERVING
        from services.worker.startup.warmup import Warmup
        report = Warmup(built.engine, built.pool, built.spec, opts.max_batch_tokens,
                        max_rank=params.get("warmup_max_rank", 128),
                        max_running=opts.max_running,
                        prefill_with_decode=opts.max_prefill_with_decode).run()
        print(f"engine: warm-up {report.steps} steps in {report.seconds:.1f}s", flush=True)
    slots = {aid: built.pool.place(aid, staged_from_peft_dir(path, built.spec))
             for aid, path in params["adapters"].items()}
    print(f"engine: built in {time.monotonic() - start:.1f}s, {len(slots)} adapters placed",
          flush=True)
    results = {}
    for job in params["jobs"]:
        run = (closed_loop if job["concurrency"] else
               lambda e, s, reqs, _: open_loop(e, s, reqs))
        if job["warmup"]:
            run(built.engine, slots, job["warmup"], job["concurrency"])
        results[job["name"]] = run(built.engine, slots, job["requests"], job["concurrency"])
        print(f"engine: {job['name']} done", flush=True)
    return results


def closed_loop(engine, slots: dict, requests: list, concurrency: int) -> list[dict]:
    """Keep `concurrency` requests submitted, stepping the engine on this thread; a request's
    sink records each token's wall-clock arrival."""
    todo = list(reversed(requests))
    finished: list[dict] = []
    records: list[dict] = []
    submit = _submitter(engine, slots, finished)
    for _ in range(min(concurrency, len(todo))):
        submit(todo.pop())
    while len(records) < len(requests):
        engine.step()
        while finished:
            records.append(finished.pop())
            if todo:
                submit(todo.pop())
    return sorted(records, key=lambda r: r["index"])


def open_loop(engine, slots: dict, requests: list) -> list[dict]:
    """Submit each request at its arrival time (Request.at after the start), stepping the engine
    on this thread in between (so arrivals land between steps, as the worker's inbox does)."""
    todo = sorted(requests, key=lambda r: r.at, reverse=True)
    finished: list[dict] = []
    submit = _submitter(engine, slots, finished)
    start = time.time()
    while len(finished) < len(requests):
        while todo and todo[-1].at <= time.time() - start:
            submit(todo.pop())
        if not engine.step() and todo:
            time.sleep(max(0.0, min(0.001, start + todo[-1].at - time.time())))
    return sorted(finished, key=lambda r: r["index"])


def _submitter(engine, slots: dict, finished: list):
    """submit(request): hand it to the engine; its record lands in `finished` when it ends."""
    from services.worker.engine.sequence import Sequence, Stopping

    def submit(r) -> None:
        rec = {"index": r.index, "adapter": r.adapter, "tenant": r.tenant, "cold": False,
               "phase": r.phase, "prompt": len(r.prompt), "times": [], "status": "OK",
               "error": "", "tokens": 0, "timings": None}
        times = rec["times"]

        def sink(ev) -> None:
            times.append(time.time())
            if ev.stop:
                _finish(rec, ev)
                finished.append(rec)
        seq = Sequence(f"{r.phase}-{r.index}", list(r.prompt),
                       slot=slots[r.adapter] if r.adapter else -1, adapter=r.adapter,
                       tenant=r.tenant, stopping=Stopping(max_new_tokens=r.max_new,
                                                          ignore_eos=True))
        rec["send"] = time.time()
        engine.submit(seq, sink)
    return submit


def _finish(rec: dict, ev) -> None:
    rec["end"] = rec["times"][-1]
    if ev.error:
        rec["status"], rec["error"] = "ERROR", ev.error
    rec["tokens"] = ev.generated_tokens
    rec["timings"] = {"queue_s": ev.queue_s, "cold_load_s": 0.0,
                      "time_to_first_token_s": ev.ttft_s, "total_s": ev.total_s,
                      "adapter_tier": "gpu" if rec["adapter"] else None}
