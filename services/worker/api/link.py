"""The link between the worker's two processes (torch-free; both import it).

The worker runs as two processes: the core (engine, adapter pool, adapter manager, /metrics)
and the front end (the public gRPC port). They share a socketpair, over which each message is
one length-prefixed pickle frame, `(kind, *fields)`:

    front end -> core   ("ready", port)                 the public port is bound
                        ("gen", h, request, remaining_s, metadata)
                                                        a Generate call: the request's bytes,
                                                        its deadline (None: none) and the
                                                        metadata to trace it by
                        ("abort", h)                    the caller went away
                        ("bye",)                        drained: the public server stopped
    core -> front end   ("ev", [item, ...])             one engine step's events (below)
                        ("drain", fatal)                SIGTERM (fatal False) or a failed
                                                        engine (True: exit 1): stop taking
                                                        calls, drain

An event item is (h, token_ids, text) for tokens, (h, token_ids, text, stop, prompt_tokens,
generated_tokens, queue_s, ttft_s, total_s, error, cold_load_s, tier) for the last one, and
(h, status) for a call refused before it started (status: google.rpc.Status bytes). The core
sends one "ev" frame per engine step, from the engine thread: the per-token work of a
streamed call (a gRPC write and its event-loop wake-up) runs in the front end's process, not
under the engine's GIL.

Frames are pickles: the peer is the process's own child or parent over a socketpair it
created, never a network peer.
"""
from __future__ import annotations

import asyncio
import pickle
import socket
import struct
import threading

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
