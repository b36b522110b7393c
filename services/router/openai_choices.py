"""`n` > 1 choices of an OpenAI request: n GenerateStreams of the same request, each its own
sequence at the worker. Choice i samples with seed + i when the body gives a seed (so the n
choices are reproducible whatever else is batched), else with a seed of its own.

The first choice starts alone and the others once it has streamed its first message: by then
its prompt's KV blocks are computed and published at the worker, which gives them to the
other choices' sequences (same tenant, adapter and prompt: services.worker.engine.block_manager) so
the prompt is computed once rather than n times. The others' first tokens come one prefill
later than the first's.
"""
from __future__ import annotations

import asyncio
from typing import AsyncIterator

from services.common.errors import LorafleetError
from services.common.gen.lorafleet.v1 import router_pb2 as rpb

MAX_CHOICES = 16
_END = object()


def requests(req: rpb.GenerateRequest, n: int, seeded: bool) -> list[rpb.GenerateRequest]:
    """The n requests: choice i with seed + i (seeded), else each with its own random seed
    (seed 0: the worker draws one); request ids suffixed with the choice."""
    out = []
    for i in range(n):
        r = rpb.GenerateRequest()
        r.CopyFrom(req)
        if seeded:
            r.sampling.seed = (req.sampling.seed + i) & ((1 << 64) - 1)
        if req.request_id:
            r.request_id = f"{req.request_id}-{i}"
        out.append(r)
    return out


async def fan_out(servicer, reqs: list[rpb.GenerateRequest], ctx
                  ) -> AsyncIterator[tuple[int, rpb.GenerateResponse]]:
    """Every choice's messages as they come, tagged with the choice's index; a choice's error
    is raised (the others are cancelled). Closing the iterator cancels what still runs."""
    queue: asyncio.Queue = asyncio.Queue()
    first_seen = asyncio.Event()

    async def pump(i: int, req: rpb.GenerateRequest) -> None:
        if i:
            await first_seen.wait()
        stream = servicer.GenerateStream(req, ctx)
        try:
            async for resp in stream:
                first_seen.set()
                await queue.put((i, resp))
        except LorafleetError as err:
            await queue.put((i, err))
        finally:
            first_seen.set()
            await stream.aclose()
            await queue.put((i, _END))

    tasks = [asyncio.create_task(pump(i, r)) for i, r in enumerate(reqs)]
    try:
        live = len(tasks)
        while live:
            i, item = await queue.get()
            if item is _END:
                live -= 1
            elif isinstance(item, LorafleetError):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def gather(servicer, reqs: list[rpb.GenerateRequest], ctx) -> list[dict]:
    """Every choice to its end: per choice its text, token infos, stop reason and usage."""
    out = [{"text": [], "tokens": [], "stop": 0, "usage": None, "prompt_tokens": [],
            "tool_calls": []} for _ in reqs]
    async for i, resp in fan_out(servicer, reqs, ctx):
        c = out[i]
        c["text"].append(resp.text)
        c["prompt_tokens"].extend(resp.prompt_tokens)
        c["tokens"].extend(resp.tokens)
        c["tool_calls"].extend(resp.tool_calls)
        if resp.stop_reason:
            c["stop"], c["usage"] = resp.stop_reason, resp.usage
    for c in out:
        c["text"] = "".join(c["text"])
    return out
