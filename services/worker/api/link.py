"""The link between the worker's two processes (torch-free; both import it): its messages, as
the types below, and their framing.

The worker runs as two processes: the core (engine, adapter pool, adapter manager, /metrics)
and the front end (the public gRPC port). They share a socketpair, over which each message is
one length-prefixed pickle frame of one of these types:

    front end -> core   Ready       the public port is bound
                        Generate    a Generate call: the request's bytes, its deadline, the
                                    metadata to trace it by
                        Abort       the caller went away
                        Bye         drained: the public server stopped
    core -> front end   StepEvents  one engine step's events (sent from the engine thread)
                        Refused     a call refused before it started (a google.rpc.Status)
                        Drain       SIGTERM (fatal False) or a failed engine (True: exit 1):
                                    stop taking calls, drain

A StepEvents carries the step's token events as columns (a call's handle, token ids, text and
token details at the same index of each), so the engine thread pickles lists of plain values
and no object per row; a call's last event is a Final. The core sends one StepEvents per engine
step: the per-token work of a streamed call (a gRPC write and its event-loop wake-up) runs in
the front end's process, not under the engine's GIL. The front end hands each call its events
as Tokens and Final (services.worker.api.responses turns them into responses).

Frames are pickles: the peer is the process's own child or parent over a socketpair it
created, never a network peer.
"""
from __future__ import annotations

import asyncio
import pickle
import socket
import struct
import threading
from typing import NamedTuple


class Ready(NamedTuple):
    """front end -> core: the public port is bound."""
    port: int


class Generate(NamedTuple):
    """front end -> core: a Generate call."""
    h: int                        # the call's handle on the link
    request: bytes                # the WorkerGenerateRequest's bytes
    remaining_s: float | None     # its deadline (None: none)
    metadata: tuple               # the caller's metadata ((key, value), ...): trace context


class Abort(NamedTuple):
    """front end -> core: the caller of call h went away (cancelled, past its deadline)."""
    h: int


class Bye(NamedTuple):
    """front end -> core: drained; the public server has stopped."""


class Drain(NamedTuple):
    """core -> front end: stop taking calls and drain; fatal: the engine failed (exit 1)."""
    fatal: bool = False


class Refused(NamedTuple):
    """core -> front end: call h refused before it started."""
    h: int
    status: bytes                 # google.rpc.Status bytes


class Tokens(NamedTuple):
    """One call's tokens of one step (a StepEvents column entry, as the front end queues it)."""
    token_ids: list[int]
    text: str
    details: tuple | None         # (token details, prompt token details): responses.details


class Final(NamedTuple):
    """A call's last event: its last tokens, why it stopped, its usage and timings."""
    h: int
    token_ids: list[int]
    text: str
    stop: int                     # lorafleet.v1.StopReason
    prompt_tokens: int
    generated_tokens: int
    queue_s: float
    ttft_s: float
    total_s: float
    error: str                    # with stop ERROR: what failed
    cold_load_s: float            # its adapter's cold load (0: none)
    tier: int                     # lorafleet.v1.Tier the adapter came from
    details: tuple | None         # as Tokens.details


class StepEvents(NamedTuple):
    """core -> front end: one engine step's events: per call that got tokens, at one index of
    each column, its handle, token ids, text and details; then the calls that ended."""
    calls: tuple[int, ...]
    token_ids: tuple[list[int], ...]
    texts: tuple[str, ...]
    details: tuple
    finals: list[Final]

    @classmethod
    def of(cls, tokens: list[tuple], finals: list[Final]) -> "StepEvents":
        """From the step's (h, token_ids, text, details) rows, turned into columns."""
        calls, ids, texts, details = tuple(zip(*tokens)) or ((), (), (), ())
        return cls(calls, ids, texts, details, finals)


HEADER = struct.Struct("<I")
MAX_FRAME = 1 << 30


def encode(msg) -> bytes:
    data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
    return HEADER.pack(len(data)) + data


class BlockingEnd:
    """One end of the link used from threads: sends under a lock, reads on one thread."""

    def __init__(self, sock: socket.socket):
        sock.setblocking(True)
        self.sock = sock
        self._lock = threading.Lock()

    def send(self, msg) -> bool:
        """Send one message; False when the peer is gone."""
        data = encode(msg)
        try:
            with self._lock:
                self.sock.sendall(data)
            return True
        except OSError:
            return False

    def recv(self):
        """The next message, or None at end of stream."""
        head = self._exactly(HEADER.size)
        if head is None:
            return None
        body = self._exactly(HEADER.unpack(head)[0])
        return None if body is None else pickle.loads(body)

    def _exactly(self, n: int) -> bytes | None:
        buf = bytearray()
        while len(buf) < n:
            try:
                chunk = self.sock.recv(min(n - len(buf), 1 << 20))
            except OSError:
                return None
            if not chunk:
                return None
            buf += chunk
        return bytes(buf)

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


async def read_message(reader: asyncio.StreamReader):
    """The next message from an asyncio end of the link, or None at end of stream."""
    try:
        head = await reader.readexactly(HEADER.size)
        (n,) = HEADER.unpack(head)
        if n > MAX_FRAME:
            raise ValueError(f"link frame of {n} bytes")
        return pickle.loads(await reader.readexactly(n))
    except (asyncio.IncompleteReadError, ConnectionError):
        return None
