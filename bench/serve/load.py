"""The serving benchmark's load generator: K client processes (multiprocessing spawn), each
with its own event loop and gRPC channel to the router, each sending every K-th request of a
pre-built list to `GenerationService/GenerateStream`.

Open loop: requests carry send offsets (`Request.at`, Poisson arrivals over the whole list), and
every client keeps the global times from one common start. Closed loop: the concurrency is split
over the clients, each keeping its share in flight. A cold stream (open-loop requests flagged
`cold`) runs beside either and stops when the client's main requests are done; a chained one
(its requests flagged `chain` in `Request.extra`, all sent by the first client) sends each
request once the one before it has its first token, from the first one's send offset.

Per request the client records wall-clock times (`time.time()`, so processes and the worker's
records line up): send, each streamed message's arrival (one token each), end; and the final
message's usage and timings, and the token ids streamed in all (a duplicate would show as more
than asked for). The hot loop appends a timestamp and adds a count per message.
"""
from __future__ import annotations

import asyncio
import multiprocessing as mp
import queue
import time

import grpc

from services.common.gen.lorafleet.v1 import common_pb2
from services.common.gen.lorafleet.v1 import router_pb2 as rpb, router_pb2_grpc

CHANNEL_OPTIONS = [("grpc.max_receive_message_length", 64 << 20),
                   ("grpc.initial_reconnect_backoff_ms", 100),
                   ("grpc.max_reconnect_backoff_ms", 1000)]
TIERS = {common_pb2.GPU: "gpu", common_pb2.WORKER_HOST: "worker_host",
         common_pb2.STORE_HOST: "store_host", common_pb2.SOURCE: "source"}


def to_proto(r) -> rpb.GenerateRequest:
    req = rpb.GenerateRequest(adapter_id=r.adapter, prompt_token_ids=r.prompt,
                              request_id=f"{r.phase}-{r.index}")
    req.stopping.max_new_tokens = r.max_new
    req.stopping.ignore_eos = True
    req.sampling.temperature = 0.0                    # greedy
    return req


async def call(stub, r, proto, timeout: float, first: asyncio.Event | None = None) -> dict:
    """One streamed request; the record of what the client saw. `first` is set once its first
    token has come (or it ended without one)."""
    metadata = (("authorization", f"Bearer {r.tenant}"),)
    times: list[float] = []
    last, status, error, streamed = None, "OK", "", 0
    send = time.time()
    try:
        async for resp in stub.GenerateStream(proto, timeout=timeout, metadata=metadata):
            times.append(time.time())
            if first is not None:
                first.set()
            streamed += len(resp.token_ids)
            last = resp
    except grpc.aio.AioRpcError as err:
        status, error = err.code().name, (err.details() or "")[:300]
    finally:
        if first is not None:
            first.set()
    end = time.time()
    rec = {"index": r.index, "adapter": r.adapter, "tenant": r.tenant, "cold": r.cold,
           "burst": bool(r.extra.get("burst")),
           "phase": r.phase, "prompt": len(r.prompt), "send": send, "end": end,
           "times": times, "status": status, "error": error, "tokens": 0, "timings": None,
           "streamed": streamed}
    if last is not None and last.HasField("timings"):
        t = last.timings
        rec["tokens"] = last.usage.generated_tokens
        rec["timings"] = {"queue_s": t.queue_s, "cold_load_s": t.cold_load_s,
                          "time_to_first_token_s": t.time_to_first_token_s,
                          "total_s": t.total_s, "adapter_tier": TIERS.get(t.adapter_tier)}
    return rec


async def paced(items, start: float, send, stop: asyncio.Event | None = None) -> None:
    """Open loop: send(r, proto) for each item at start + r.at (wall clock); a stop set ends
    the stream (the requests already sent run to their end)."""
    tasks = []
    for r, proto in items:
        delay = start + r.at - time.time()
        if delay > 0 and stop is None:
            await asyncio.sleep(delay)               # pacing the arrivals
        elif delay > 0:
            try:                                     # the same, cut short by a stop
                await asyncio.wait_for(stop.wait(), delay)
            except asyncio.TimeoutError:
                pass
        if stop is not None and stop.is_set():
            break
        tasks.append(asyncio.create_task(send(r, proto)))
    await asyncio.gather(*tasks)


async def chained(items, start: float, send, stop: asyncio.Event) -> None:
    """One at a time from start + the first item's offset: each sent once the one before it
    has its first token (send(r, proto, first) sets `first`); a stop set ends the chain."""
    if not items:
        return
    try:
        await asyncio.wait_for(stop.wait(), max(0.0, start + items[0][0].at - time.time()))
    except asyncio.TimeoutError:
        pass
    tasks = []
    for r, proto in items:
        if stop.is_set():
            break
        first = asyncio.Event()
        tasks.append(asyncio.create_task(send(r, proto, first)))
        await first.wait()
    await asyncio.gather(*tasks)


async def closed(items, concurrency: int, send) -> None:
    """Closed loop: `concurrency` senders, each taking the next item when its last ends."""
    it = iter(items)

    async def loop() -> None:
        for r, proto in it:
            await send(r, proto)
    await asyncio.gather(*(loop() for _ in range(concurrency)))


async def run_job(stub, job: dict, start: float, timeout: float) -> list[dict]:
    """Send one client's share of a phase from `start` (wall clock); returns its records.
    The cold stream (if any) stops when the main requests are done."""
    pairs = [(r, to_proto(r)) for r in job["requests"]]
    records: list[dict] = []
    main_done = asyncio.Event()

    async def send(r, proto, first: asyncio.Event | None = None) -> None:
        records.append(await call(stub, r, proto, timeout, first))

    async def main() -> None:
        opened = [p for p in pairs if not p[0].cold and p[0].at is not None]
        rest = [p for p in pairs if not p[0].cold and p[0].at is None]
        await asyncio.gather(paced(opened, start, send),
                             closed(rest, job["concurrency"] or 1, send))
        main_done.set()

    chain = [p for p in pairs if p[0].cold and p[0].extra.get("chain")]
    cold = [p for p in pairs if p[0].cold and not p[0].extra.get("chain")]
    await asyncio.gather(main(), paced(cold, start, send, main_done),
                         chained(chain, start, send, main_done))
    return records


def client_main(idx: int, router: str, jobs, results, timeout: float) -> None:
    """A client process: connect, then run jobs until None arrives."""
    asyncio.run(_client(idx, router, jobs, results, timeout))


async def _client(idx: int, router: str, jobs, results, timeout: float) -> None:
    loop = asyncio.get_running_loop()
    async with grpc.aio.insecure_channel(router, options=CHANNEL_OPTIONS) as channel:
        await asyncio.wait_for(channel.channel_ready(), 60)
        stub = router_pb2_grpc.GenerationServiceStub(channel)
        results.put(("up", idx, None))
        while True:
            job = await loop.run_in_executor(None, jobs.get)
            if job is None:
                return
            results.put(("ready", idx, None))
            start = await loop.run_in_executor(None, jobs.get)    # the common start time
            results.put(("done", idx, await run_job(stub, job, start, timeout)))


class ClientPool:
    """K client processes kept for the whole run; `run` sends one phase through them."""

    def __init__(self, k: int, router: str, timeout: float):
        ctx = mp.get_context("spawn")
        self.results = ctx.Queue()
        self.jobs = [ctx.Queue() for _ in range(k)]
        self.procs = [ctx.Process(target=client_main, daemon=True,
                                  args=(i, router, self.jobs[i], self.results, timeout))
                      for i in range(k)]
        for p in self.procs:
            p.start()
        self._collect("up", set(range(k)), 120)

    def run(self, requests: list, concurrency: int | None) -> list[dict]:
        """Every request once, from a common start; records sorted by request index.
        concurrency: the closed loop's rows in flight in all (split over the clients); a
        chained cold stream goes to the first client whole, in order."""
        k = len(self.procs) if concurrency is None else min(len(self.procs), concurrency)
        chain = [r for r in requests if r.extra.get("chain")]
        rest = [r for r in requests if not r.extra.get("chain")]
        shares = [rest[i::k] + (chain if i == 0 else []) for i in range(k)]
        conc = [0] * k if concurrency is None else [concurrency // k + (i < concurrency % k)
                                                     for i in range(k)]
        busy = {i for i in range(k) if shares[i]}
        for i in busy:
            self.jobs[i].put({"requests": shares[i], "concurrency": conc[i]})
        self._collect("ready", busy, 120)
        start = time.time() + 0.05
        for i in busy:
            self.jobs[i].put(start)
        done = self._collect("done", busy, None)
        return sorted((r for recs in done.values() for r in recs), key=lambda r: r["index"])

    def _collect(self, kind: str, who: set[int], timeout: float | None) -> dict:
        got: dict[int, object] = {}
        deadline = None if timeout is None else time.monotonic() + timeout
        while len(got) < len(who):
            try:
                what, idx, payload = self.results.get(timeout=5)
            except queue.Empty:
                dead = [i for i in who if not self.procs[i].is_alive() and i not in got]
                if dead:
                    raise RuntimeError(f"client process {dead[0]} died "
                                       f"(exit {self.procs[dead[0]].exitcode})")
                if deadline is not None and time.monotonic() > deadline:
                    raise TimeoutError(f"clients {sorted(who - set(got))}: no {kind!r}")
                continue
            if what != kind:
                raise RuntimeError(f"client {idx}: {what!r} while waiting for {kind!r}")
            got[idx] = payload
        return got

    def stop(self) -> None:
        for q in self.jobs:
            q.put(None)
        for p in self.procs:
            p.join(10)
            if p.is_alive():
                p.terminate()
