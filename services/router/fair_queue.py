"""Weighted fair queuing by Virtual Token Counter (Sheng et al., OSDI 2024, "Fairness in Serving
Large Language Models"), and an asyncio gate that admits requests in that order (no torch).

Every tenant has a counter of the service it received: ``(w_in * input + w_out * output) / weight``
tokens. The next request comes from the backlogged tenant with the smallest counter (ties: the
earlier request). Input tokens are charged when a request is dispatched, output tokens as they are
generated. When a tenant becomes backlogged again its counter is lifted to the smallest counter of
the backlogged tenants (or, with none backlogged, to the counter of the last tenant that left the
queue), so idle time banks no credit. While two tenants stay backlogged, the service they
received differs by a bounded amount (the paper's bound: twice the largest charge of one request),
however much more one of them asks for.

``fair=False`` serves in arrival order (FIFO) and keeps the counters for statistics only, for the
measured comparison.

The gate's slots are a router-side proxy for worker capacity and, unlike the paper's engine (where
a new request joins the running batch at the next step), a slot frees only when a request ends.
So a light tenant arriving while a heavy one holds every slot would wait for a whole heavy request
to finish, however fair the order. ``foothold`` slots bound that: a tenant with nothing in flight
may go past the limit by up to that many requests (in VTC order among such tenants), so every
active tenant keeps one request moving; a tenant already served waits its turn as usual.
"""
from __future__ import annotations

import asyncio
import itertools
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Collection, Mapping


class VirtualTokenCounter:
    """Per-tenant queues ordered by virtual token counters. Not thread-safe (one event loop).

    w_in / w_out: charge per input / output token (the paper uses 1 and 2).
    weights: per-tenant weight; a tenant of weight 2 receives twice the service (default 1).
    """

    def __init__(self, w_in: float = 1.0, w_out: float = 2.0,
                 weights: Mapping[str, float] | None = None, fair: bool = True) -> None:
        if w_in < 0 or w_out < 0:
            raise ValueError("w_in and w_out must be >= 0")
        self.w_in, self.w_out, self.fair = w_in, w_out, fair
        self._weights: dict[str, float] = {}
        for tenant, weight in (weights or {}).items():
            self.set_weight(tenant, weight)
        self._counters: dict[str, float] = {}
        self._served: dict[str, float] = {}  # weighted tokens charged, before weight division
        self._queues: dict[str, deque[tuple[int, Any, int]]] = {}  # (seq, item, est_tokens)
        self._seq = itertools.count()
        self._len = 0
        self._last_left: str | None = None

    def set_weight(self, tenant: str, weight: float) -> None:
        """Set a tenant's weight (> 0)."""
        if weight <= 0:
            raise ValueError(f"weight of {tenant!r} must be > 0, got {weight}")
        self._weights[tenant] = float(weight)

    def __len__(self) -> int:
        return self._len

    def counter(self, tenant: str) -> float:
        """The tenant's virtual token counter."""
        return self._counters.get(tenant, 0.0)

    def counters(self) -> dict[str, float]:
        """All counters (a copy)."""
        return dict(self._counters)

    def served(self) -> dict[str, float]:
        """Weighted tokens charged per tenant (w_in * input + w_out * output), a copy."""
        return dict(self._served)

    def backlogged(self) -> list[str]:
        """Tenants with queued requests."""
        return list(self._queues)

    def push(self, tenant: str, item: Any, est_tokens: int = 0) -> None:
        """Queue item; est_tokens (input tokens) are charged when it is popped."""
        queue = self._queues.get(tenant)
        if queue is None:
            self._lift(tenant)
            queue = self._queues[tenant] = deque()
        queue.append((next(self._seq), item, est_tokens))
        self._len += 1

    def _lift(self, tenant: str) -> None:
        """A tenant becoming backlogged catches up with the others: idle time banks no credit."""
        if self._queues:
            floor = min(self._counters.get(t, 0.0) for t in self._queues)
        elif self._last_left is not None:
            floor = self._counters.get(self._last_left, 0.0)
        else:
            floor = 0.0
        self._counters[tenant] = max(self._counters.get(tenant, 0.0), floor)

    def pop(self, among: Collection[str] | None = None) -> tuple[str, Any]:
        """Dequeue the next (tenant, item) and charge its est_tokens; `among` limits the choice
        to those backlogged tenants. IndexError when there is none."""
        candidates = self._queues if among is None else [t for t in among if t in self._queues]
        if not candidates:
            raise IndexError("pop from an empty VirtualTokenCounter")
        tenant = min(candidates, key=self._order_key)
        queue = self._queues[tenant]
        _, item, est_tokens = queue.popleft()
        self._len -= 1
        if not queue:
            del self._queues[tenant]
            self._last_left = tenant
        self.charge(tenant, input_tokens=est_tokens)
        return tenant, item

    def _order_key(self, tenant: str) -> tuple[float, int]:
        head_seq = self._queues[tenant][0][0]
        return (self._counters.get(tenant, 0.0), head_seq) if self.fair else (0.0, head_seq)

    def remove(self, tenant: str, item: Any) -> bool:
        """Drop a queued item (by identity), e.g. a cancelled request. False if not queued."""
        queue = self._queues.get(tenant, ())
        for entry in queue:
            if entry[1] is item:
                queue.remove(entry)
                self._len -= 1
                if not queue:
                    del self._queues[tenant]
                return True
        return False

    def charge(self, tenant: str, input_tokens: float = 0, output_tokens: float = 0) -> None:
        """Charge served tokens to the tenant's counter (negative values refund)."""
        cost = self.w_in * input_tokens + self.w_out * output_tokens
        self._served[tenant] = self._served.get(tenant, 0.0) + cost
        weight = self._weights.get(tenant, 1.0)
        self._counters[tenant] = self._counters.get(tenant, 0.0) + cost / weight


@dataclass(eq=False)
class Ticket:
    """One admitted request's slot; hand it back to FairGate.release exactly once."""

    tenant: str
    est_tokens: int
    queued_at: float = field(default_factory=time.monotonic)
    admitted_at: float | None = None
    charged_in: float = 0
    charged_out: float = 0
    released: bool = False

    @property
    def queue_seconds(self) -> float:
        """Time spent waiting for a slot (0 while still waiting)."""
        return 0.0 if self.admitted_at is None else self.admitted_at - self.queued_at


class FairGate:
    """Admit at most max_concurrency requests at once; when saturated, hand out slots in VTC order
    (or FIFO with fair=False). For one asyncio event loop; not thread-safe.

    Usage: ``t = await gate.acquire(tenant, prompt_tokens)``; ``gate.progress(t, n)`` as tokens
    stream; ``gate.release(t, input_tokens, output_tokens)`` in a finally block.
    """

    def __init__(self, max_concurrency: int, *, fair: bool = True, w_in: float = 1.0,
                 w_out: float = 2.0, weights: Mapping[str, float] | None = None,
                 foothold: int = 0) -> None:
        if max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
        if foothold < 0:
            raise ValueError(f"foothold must be >= 0, got {foothold}")
        self.vtc = VirtualTokenCounter(w_in, w_out, weights, fair)
        self._max = max_concurrency
        self._foothold = foothold if fair else 0     # FIFO is the plain baseline
        self._in_flight = 0
        self._by_tenant: dict[str, int] = {}

    @property
    def in_flight(self) -> int:
        """Requests holding a slot."""
        return self._in_flight

    @property
    def waiting(self) -> int:
        """Requests queued for a slot."""
        return len(self.vtc)

    def would_wait(self, tenant: str) -> bool:
        """Whether a request of tenant acquiring now would have to queue."""
        if self._in_flight < self._max and not len(self.vtc):
            return False
        foothold = self._in_flight < self._max + self._foothold
        return not (foothold and not self._by_tenant.get(tenant)
                    and tenant not in self.vtc.backlogged())

    def set_max_concurrency(self, max_concurrency: int, foothold: int | None = None) -> None:
        """Resize (e.g. when workers come and go); queued requests are admitted if room appears."""
        if max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
        self._max = max_concurrency
        if foothold is not None and self.vtc.fair:
            self._foothold = max(0, foothold)
        self._dispatch()

    async def acquire(self, tenant: str, est_tokens: int = 0) -> Ticket:
        """Wait for a slot; est_tokens (prompt tokens) are charged on admission.

        Cancellation while queued removes the request; nothing is charged for it.
        """
        ticket = Ticket(tenant, est_tokens)
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        item = (ticket, future)
        self.vtc.push(tenant, item, est_tokens)
        self._dispatch()
        try:
            await future
        except asyncio.CancelledError:
            if future.done() and not future.cancelled():  # granted just as we were cancelled
                self.release(ticket, input_tokens=0, output_tokens=0)
            else:
                self.vtc.remove(tenant, item)
            raise
        return ticket

    def enqueue(self, tenant: str, est_tokens: int, on_grant: Callable[[Ticket], None]) -> Ticket:
        """acquire() without an event loop (bench/capacity_sim.py drives the gate on simulated
        time): on_grant(ticket) is called when the slot is handed out, at once if one is free.
        Give the slot back with release(ticket) as usual."""
        ticket = Ticket(tenant, est_tokens)
        self.vtc.push(tenant, (ticket, _Grant(ticket, on_grant)), est_tokens)
        self._dispatch()
        return ticket

    def _dispatch(self) -> None:
        while len(self.vtc):
            if self._in_flight < self._max:
                tenant, (ticket, future) = self.vtc.pop()
            elif self._in_flight < self._max + self._foothold:
                idle = [t for t in self.vtc.backlogged() if not self._by_tenant.get(t)]
                if not idle:
                    return
                tenant, (ticket, future) = self.vtc.pop(among=idle)
            else:
                return
            if future.done():  # cancelled while queued, not yet removed: refund its charge
                self.vtc.charge(tenant, input_tokens=-ticket.est_tokens)
                continue
            self._in_flight += 1
            self._by_tenant[tenant] = self._by_tenant.get(tenant, 0) + 1
            ticket.charged_in = ticket.est_tokens
            ticket.admitted_at = time.monotonic()
            future.set_result(None)

    def progress(self, ticket: Ticket, output_tokens: int) -> None:
        """Charge output tokens as they are generated (keeps the counters current mid-stream)."""
        if not ticket.released:
            self.vtc.charge(ticket.tenant, output_tokens=output_tokens)
            ticket.charged_out += output_tokens

    def release(self, ticket: Ticket, input_tokens: int | None = None,
                output_tokens: int | None = None) -> None:
        """Free the slot and settle the charge to the actual totals (None: keep what was charged).

        Idempotent: a second release of the same ticket does nothing.
        """
        if ticket.released:
            return
        ticket.released = True
        actual_in = ticket.charged_in if input_tokens is None else input_tokens
        actual_out = ticket.charged_out if output_tokens is None else output_tokens
        self.vtc.charge(ticket.tenant, actual_in - ticket.charged_in,
                        actual_out - ticket.charged_out)
        ticket.charged_in, ticket.charged_out = actual_in, actual_out
        self._in_flight -= 1
        left = self._by_tenant.get(ticket.tenant, 1) - 1
        if left > 0:
            self._by_tenant[ticket.tenant] = left
        else:
            self._by_tenant.pop(ticket.tenant, None)
        self._dispatch()


class _Grant:
    """What enqueue() queues in place of acquire()'s future: done() / set_result() as the
    dispatch uses them, calling back instead of waking a coroutine."""

    __slots__ = ("ticket", "on_grant", "granted")

    def __init__(self, ticket: Ticket, on_grant: Callable[[Ticket], None]) -> None:
        self.ticket, self.on_grant, self.granted = ticket, on_grant, False

    def done(self) -> bool:
        return self.granted

    def set_result(self, _value: None) -> None:
        self.granted = True
        self.on_grant(self.ticket)
