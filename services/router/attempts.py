"""A failed worker attempt: may the request path try it again, and if not, what the client is
told (no torch; the request path in generate.py runs the attempts).

Nothing may be sent to the client twice, so an attempt is retried only when the client has been
sent nothing of it: before its first message (a lost or failing worker), or, for a unary call,
which sends nothing before its end, after a lost connection (UNAVAILABLE) mid-generation. Never
a client error or a deadline. Out of attempts, the client gets the failure's own cause: a cold
load that failed UNAVAILABLE names the adapter and, when the router cannot reach the
adapter-store either, the store (the worker stages from it, so the worker is not at fault), not
"no live worker".
"""
from __future__ import annotations

import grpc

from services.common.errors import LorafleetError, Unavailable, from_rpc_error
from services.common.gen.lorafleet.v1 import adapter_store_pb2 as spb
from services.router.resolve import STORE_DOWN

RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.INTERNAL,
             grpc.StatusCode.UNKNOWN)
STORE_PROBE_S = 1.0         # how long a failed cold load waits to learn whether the store is up


class AttemptFailed(Exception):
    """A worker call that failed before its first message, or lost its worker after it.

    started: messages had come (a stream has sent them on). cold: the worker did not hold the
    adapter on its GPU when the call was sent (it had to load it)."""

    def __init__(self, error: grpc.RpcError, addr: str, started: bool, cold: bool):
        super().__init__(str(error))
        self.error, self.addr, self.started, self.cold = error, addr, started, cold


def retryable(failed: AttemptFailed, unary: bool, context) -> bool:
    """Whether the attempt may be tried again, within the request's deadline: before the first
    message, a lost or failing worker (RETRYABLE); after it, only for a unary call and only a
    lost connection (UNAVAILABLE)."""
    remaining = context.time_remaining()
    if remaining is not None and remaining <= 0:
        return False
    code = failed.error.code()
    if not failed.started:
        return code in RETRYABLE
    return unary and code == grpc.StatusCode.UNAVAILABLE


async def cause(failed: AttemptFailed, adapter_id: str | None, store, context) -> LorafleetError:
    """The client's error for an attempt no other attempt follows. store: the AdapterStoreStub,
    probed when a cold load failed UNAVAILABLE."""
    err = failed.error
    if failed.started:
        return Unavailable(f"worker {failed.addr} lost mid-stream: {err.details()}")
    out = from_rpc_error(err)
    if err.code() != grpc.StatusCode.UNAVAILABLE:
        return out                  # the worker's own answer (a field, a quota): as it is
    if not failed.cold:
        out.message = f"worker {failed.addr} failed before the first token: {err.details()}"
        return out
    why = err.details()
    down = await store_down(store, context)
    if down is not None:
        seen = "" if down.details() == why else f"; the worker saw: {why}"
        why = f"the adapter-store is unreachable ({down.code().name}: {down.details()}){seen}"
    out.message = f"adapter {adapter_id!r} could not be loaded on worker {failed.addr}: {why}"
    return out


async def store_down(store, context) -> grpc.RpcError | None:
    """The error of a short call to the adapter-store if it is unreachable; None if it answers
    (or no time is left to ask)."""
    remaining = context.time_remaining()
    timeout = STORE_PROBE_S if remaining is None else min(STORE_PROBE_S, remaining)
    if timeout <= 0:
        return None
    try:
        await store.Stats(spb.StoreStatsRequest(), timeout=timeout)
    except grpc.RpcError as err:
        if err.code() in STORE_DOWN:
            return err
    return None
