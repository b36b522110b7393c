"""Virtual Token Counter ordering, the lift rule, bounded service difference, FIFO mode, and the
asyncio FairGate (no torch)."""
from __future__ import annotations

import asyncio

import pytest

from services.router.fair_queue import FairGate, VirtualTokenCounter

pytestmark = pytest.mark.policy     # torch-free: `make test-policy`


def test_pops_smallest_counter_and_charges_input() -> None:
    vtc = VirtualTokenCounter(w_in=1.0, w_out=2.0)
    vtc.push("a", "a1", est_tokens=100)
    vtc.push("a", "a2", est_tokens=100)
    vtc.push("b", "b1", est_tokens=10)
    assert vtc.pop() == ("a", "a1")  # tie at 0: earlier request first
    assert vtc.counter("a") == 100
    assert vtc.pop() == ("b", "b1")
    vtc.charge("b", output_tokens=50)  # b: 10 + 2 * 50 = 110 > a's 100
    vtc.push("b", "b2")
    assert vtc.pop() == ("a", "a2")
    assert vtc.served() == {"a": 200.0, "b": 110.0}
    with pytest.raises(IndexError):
        VirtualTokenCounter().pop()


def test_weights_scale_service() -> None:
    vtc = VirtualTokenCounter(weights={"gold": 2.0})
    for i in range(30):
        vtc.push("gold", i, est_tokens=10)
        vtc.push("free", i, est_tokens=10)
    served = {"gold": 0, "free": 0}
    for _ in range(30):
        tenant, _ = vtc.pop()
        served[tenant] += 1
    assert served == {"gold": 20, "free": 10}


def test_lift_rule_idle_time_banks_no_credit() -> None:
    vtc = VirtualTokenCounter()
    for i in range(50):
        vtc.push("heavy", i, est_tokens=100)
    for _ in range(20):
        vtc.pop()
    assert vtc.counter("light") == 0
    vtc.push("light", "x", est_tokens=100)  # lifted to the backlogged minimum: heavy's 2000
    assert vtc.counter("light") == vtc.counter("heavy") == 2000
    for i in range(5):
        vtc.push("light", f"x{i}", est_tokens=100)
    order = [vtc.pop()[0] for _ in range(6)]
    assert order == ["heavy", "light", "heavy", "light", "heavy", "light"]  # alternates


def test_lift_when_nobody_is_backlogged_uses_last_tenant_to_leave() -> None:
    vtc = VirtualTokenCounter()
    vtc.push("heavy", 1, est_tokens=500)
    vtc.pop()
    vtc.push("light", 2)
    assert vtc.counter("light") == 500


def _serve(vtc: VirtualTokenCounter, steps: int, check) -> dict[str, float]:
    """Capacity one: pop, serve 20 input + 30 output tokens (charged as generated), repeat."""
    for _ in range(steps):
        tenant, _ = vtc.pop()
        for _ in range(30):
            vtc.charge(tenant, output_tokens=1)
        check(vtc)
    return vtc.served()


def test_heavy_tenant_cannot_starve_light_one() -> None:
    vtc = VirtualTokenCounter(w_in=1.0, w_out=2.0)
    for i in range(1000):
        vtc.push("heavy", i, est_tokens=20)
    for i in range(100):
        vtc.push("light", i, est_tokens=20)
    bound = 2 * (1.0 * 20 + 2.0 * 30)  # the paper's bound: 2 * max request cost

    def check(q: VirtualTokenCounter) -> None:
        if {"heavy", "light"} <= set(q.backlogged()):
            served = q.served()
            assert abs(served.get("heavy", 0) - served.get("light", 0)) <= bound

    served = _serve(vtc, 150, check)
    assert served["light"] >= 70 * 80  # light got about half of the service


def test_fifo_mode_differs() -> None:
    def order(fair: bool) -> list[str]:
        vtc = VirtualTokenCounter(fair=fair)
        for i in range(10):
            vtc.push("heavy", i, est_tokens=100)
        vtc.push("light", "l", est_tokens=100)
        return [vtc.pop()[0] for _ in range(11)]

    assert order(fair=False).index("light") == 10
    assert order(fair=True).index("light") <= 1


def test_remove_queued_item() -> None:
    vtc = VirtualTokenCounter()
    item = object()
    vtc.push("a", item)
    assert vtc.remove("a", item) and not vtc.remove("a", item)
    assert len(vtc) == 0 and vtc.backlogged() == []


def test_gate_admits_up_to_limit_then_in_vtc_order() -> None:
    async def scenario() -> list[str]:
        gate = FairGate(max_concurrency=2)
        first = [await gate.acquire("heavy", 100), await gate.acquire("heavy", 100)]
        order: list[str] = []

        async def request(tenant: str) -> None:
            ticket = await gate.acquire(tenant, 100)
            order.append(tenant)
            await asyncio.sleep(0)
            gate.progress(ticket, 10)
            gate.release(ticket, output_tokens=50)

        tasks = [asyncio.create_task(request("heavy")) for _ in range(4)]
        await asyncio.sleep(0)
        tasks.append(asyncio.create_task(request("light")))
        await asyncio.sleep(0)
        assert gate.in_flight == 2 and gate.waiting == 5
        for ticket in first:
            gate.release(ticket, output_tokens=50)
        await asyncio.gather(*tasks)
        assert gate.in_flight == 0 and gate.waiting == 0
        assert gate.vtc.served()["heavy"] == 6 * (100 + 2 * 50)
        return order

    order = asyncio.run(scenario())
    assert order.index("light") == 0  # light jumps the heavy backlog


def test_gate_fifo_mode() -> None:
    async def scenario() -> list[str]:
        gate = FairGate(max_concurrency=1, fair=False)
        held = await gate.acquire("heavy", 100)
        order: list[str] = []

        async def request(tenant: str) -> None:
            ticket = await gate.acquire(tenant, 100)
            order.append(tenant)
            gate.release(ticket)

        tasks = [asyncio.create_task(request(t)) for t in ["heavy"] * 3 + ["light"]]
        await asyncio.sleep(0)
        gate.release(held)
        await asyncio.gather(*tasks)
        return order

    assert asyncio.run(scenario()) == ["heavy", "heavy", "heavy", "light"]


def test_gate_cancellation_while_queued_frees_nothing_and_charges_nothing() -> None:
    async def scenario() -> None:
        gate = FairGate(max_concurrency=1)
        held = await gate.acquire("a", 10)
        waiter = asyncio.create_task(gate.acquire("b", 1000))
        await asyncio.sleep(0)
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert gate.waiting == 0 and gate.vtc.served().get("b", 0) == 0
        gate.release(held)
        gate.release(held)  # idempotent
        assert gate.in_flight == 0
        again = await asyncio.wait_for(gate.acquire("b", 5), timeout=1)
        assert again.queue_seconds >= 0 and gate.in_flight == 1

    asyncio.run(scenario())


def test_gate_cancellation_racing_a_grant_returns_the_slot() -> None:
    async def scenario() -> None:
        gate = FairGate(max_concurrency=1)
        held = await gate.acquire("a", 10)
        waiter = asyncio.create_task(gate.acquire("b", 5))
        await asyncio.sleep(0)
        gate.release(held)  # grants b's slot synchronously...
        waiter.cancel()  # ...and b is cancelled before it resumes
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert gate.in_flight == 0 and gate.vtc.served()["b"] == 0

    asyncio.run(scenario())


def test_enqueue_grants_in_vtc_order_without_an_event_loop() -> None:
    """The synchronous form (the capacity simulator's): a slot at once when free, else in VTC
    order as slots are released."""
    gate = FairGate(1)
    granted: list[str] = []
    first = gate.enqueue("heavy", 100, lambda t: granted.append(t.tenant))
    assert granted == ["heavy"]
    gate.enqueue("heavy", 100, lambda t: granted.append(t.tenant))
    light = []
    gate.enqueue("light", 10, lambda t: light.append(t))
    gate.release(first, 100, 500)                   # heavy is now far ahead in tokens
    assert granted == ["heavy"] and len(light) == 1
    gate.release(light[0], 10, 10)
    assert granted == ["heavy", "heavy"] and gate.in_flight == 1
