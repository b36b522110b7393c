"""The router's parts without processes: the tenants file and authentication, the gate's
footholds, the resolver's shared lookups and invalidation, the residency view with this router's
own requests in flight, the placement load floor, the config checks."""
from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from services.common.errors import Unauthenticated
from services.common.gen.lorafleet.v1 import common_pb2, router_pb2, worker_pb2 as wpb
from services.router.auth import Tenants
from services.router.config import parse_args
from services.router.fair_queue import FairGate
from services.router.placement import WorkerView, choose_worker, rendezvous_order
from services.router.resolve import Resolver
from services.router.workers import WorkerState


def bearer(token: str) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {token}")]


def test_tenants_file_tokens_roles_and_quotas() -> None:
    t = Tenants.from_dict({"tenants": {"ops": {"tokens": ["a", "b"], "role": "admin"},
                                       "acme": {"tokens": ["c"], "weight": 2,
                                                "quota": {"requests_per_s": 5}}},
                           "default_quota": {"max_in_flight": 3}})
    assert not t.dev_mode
    assert t.authenticate(bearer("b")).tenant == "ops" and t.authenticate(bearer("b")).admin
    acme = t.authenticate(bearer("c"))
    assert (acme.tenant, acme.admin) == ("acme", False)
    assert t.weights == {"ops": 1.0, "acme": 2.0}
    assert t.quotas.for_tenant("acme").requests_per_s == 5
    assert t.quotas.for_tenant("acme").max_in_flight == 3       # the default, key by key
    for metadata in ([], bearer("nope"), [("authorization", "Basic c")]):
        with pytest.raises(Unauthenticated):
            t.authenticate(metadata)


@pytest.mark.parametrize("data, words", [
    ({"tenants": {"x": {"tokens": ["t"], "role": "root"}}}, "role"),
    ({"tenants": {"x": {"tokens": ["t"]}, "y": {"tokens": ["t"]}}}, "repeated token"),
    ({"tenants": {"x": {"token": ["t"]}}}, "unknown keys"),
    ({"tenant": {}}, "unknown keys"),
    ({"tenants": {"a b": {}}}, "bad tenant name"),
])
def test_tenants_file_mistakes_are_refused(data, words) -> None:
    with pytest.raises(ValueError, match=words):
        Tenants.from_dict(data)


def test_dev_mode_token_is_the_tenant() -> None:
    t = Tenants.load(None)
    assert t.dev_mode and t.authenticate([]).tenant == "dev"
    assert t.authenticate(bearer("acme")).tenant == "acme" and t.authenticate([]).admin
    with pytest.raises(Unauthenticated):
        t.authenticate(bearer("../etc"))
    for unreadable in ("Basic YWNtZQ==", "Bearer", "Bearer  "):    # not served as `dev`
        with pytest.raises(Unauthenticated, match="Bearer <token>"):
            t.authenticate([("authorization", unreadable)])


def test_gate_foothold_lets_an_idle_tenant_past_a_full_gate() -> None:
    async def run():
        gate = FairGate(1, foothold=1)
        heavy = [asyncio.ensure_future(gate.acquire("heavy", 10)) for _ in range(3)]
        await asyncio.sleep(0)
        assert gate.in_flight == 1 and gate.waiting == 2
        assert gate.would_wait("heavy") and not gate.would_wait("light")
        light = await asyncio.wait_for(gate.acquire("light", 10), 1)   # nothing in flight
        assert gate.in_flight == 2 and gate.would_wait("other")
        other = asyncio.ensure_future(gate.acquire("other", 10))
        again = asyncio.ensure_future(gate.acquire("light", 10))
        await asyncio.sleep(0)
        assert not other.done() and not again.done()                  # foothold taken
        gate.release(light)              # the foothold frees: "other" is the idle one served least
        await asyncio.sleep(0)
        assert other.done() and not again.done()
        for f in heavy:                  # the rest in VTC order: light's foothold was charged,
            gate.release(await f)        # so it is level with heavy and waits its turn
        gate.release(other.result())
        gate.release(await again)
        assert gate.in_flight == 0
    asyncio.run(run())


def test_fifo_gate_has_no_foothold() -> None:
    async def run():
        gate = FairGate(1, fair=False, foothold=4)
        first = await gate.acquire("heavy")
        light = asyncio.ensure_future(gate.acquire("light"))
        await asyncio.sleep(0)
        assert not light.done()
        gate.release(first)
        gate.release(await light)
    asyncio.run(run())


class FakeStore:
    def __init__(self):
        self.calls = 0
        self.version = "v1"

    async def Resolve(self, request, timeout=None, metadata=None):
        self.calls += 1
        version = self.version                       # what the store holds when asked
        await asyncio.sleep(0.01)
        return type("R", (), {"adapter": router_pb2.AdapterInfo(id="real", version=version,
                                                                aliases=[request.name])})()


def test_resolver_shares_concurrent_lookups_and_invalidates() -> None:
    async def run():
        resolver = Resolver(grpc.aio.insecure_channel("127.0.0.1:9"), ttl=60)   # never dialled
        store = resolver.stub = FakeStore()
        got = await asyncio.gather(*(resolver.resolve("alias", "acme") for _ in range(50)))
        assert store.calls == 1 and {a.version for a in got} == {"v1"}
        store.version = "v2"
        assert (await resolver.resolve("alias", "acme")).version == "v1"      # cached
        resolver.invalidate("real")                  # by adapter id: the alias entry goes too
        assert (await resolver.resolve("alias", "acme")).version == "v2"
        store.version = "v3"
        slow = asyncio.ensure_future(resolver.resolve("other", "acme"))
        await asyncio.sleep(0.003)                   # its Resolve is on the wire
        store.version = "v4"
        resolver.invalidate()                        # the alias moved meanwhile
        assert (await slow).version == "v3"          # answered from before the move ...
        assert (await resolver.resolve("other", "acme")).version == "v4"   # ... not cached
        assert store.calls == 4
    asyncio.run(run())


def test_worker_view_counts_this_routers_requests_in_flight() -> None:
    w = WorkerState("w0", stub=None, chan=None)
    w.apply(wpb.ResidencyUpdate(snapshot=True, seq=1, load=wpb.WorkerLoad(running=1), adapters=[
        wpb.AdapterResidency(id="a", tier=common_pb2.GPU, running=1)]))
    for _ in range(3):
        w.begin("b")
    v = w.view()
    assert v.load == 3 and "b" in v.loading and v.adapter_rows["b"] == 3
    assert v.resident == {"a"} and v.adapter_rows["a"] == 1
    for _ in range(3):
        w.end("b")
    assert w.view().load == 1 and "b" not in w.view().loading
    w.apply(wpb.ResidencyUpdate(seq=1, adapters=[wpb.AdapterResidency(id="a")]))   # stale
    assert "a" in w.view().resident
    w.apply(wpb.ResidencyUpdate(seq=2, adapters=[wpb.AdapterResidency(id="a")]))   # removed
    assert "a" not in w.view().resident


def test_load_floor_keeps_a_lightly_loaded_holder() -> None:
    workers = {"w0": WorkerView(resident={"x"}, running=3), "w1": WorkerView()}
    assert choose_worker("x", workers) == "w1"                   # 3 > 1.25 * 1.5 + 1
    assert choose_worker("x", workers, load_floor=8) == "w0"     # a batch's worth is free
    workers["w0"].running = 9
    assert choose_worker("x", workers, load_floor=8) == "w1"
    cold_owner = rendezvous_order("y", workers)[0]
    assert choose_worker("y", workers, load_floor=16) == cold_owner


def test_config_flags() -> None:
    cfg = parse_args(["--worker", "a:1", "--worker", "b:2", "--fair-queue", "off",
                      "--max-in-flight-per-worker", "2", "--spill-rows", "4",
                      "--foothold-per-worker", "0"])
    assert cfg.workers == ("a:1", "b:2") and not cfg.fair
    assert (cfg.max_in_flight_per_worker, cfg.spill_rows, cfg.foothold_per_worker) == (2, 4, 0)
    with pytest.raises(ValueError):
        parse_args(["--tls-cert", "c.pem"])
    with pytest.raises(ValueError):
        parse_args(["--spill-rows", "0"])


@pytest.mark.parametrize("fields,named", [
    (dict(adapter_id="bad id!!"), "adapter_id:"),
    (dict(adapter_id="../etc"), "adapter_id:"),
    (dict(sampling=dict(temperature=float("nan"))), "sampling.temperature"),
    (dict(sampling=dict(temperature=float("inf"))), "sampling.temperature"),
    (dict(sampling=dict(top_p=float("nan"))), "sampling.top_p"),
    (dict(sampling=dict(repetition_penalty=float("nan"))), "sampling.repetition_penalty"),
    (dict(sampling=dict(repetition_penalty=float("inf"))), "sampling.repetition_penalty"),
])
def test_generate_validation_names_the_public_field(fields, named) -> None:
    """A malformed adapter id is refused by the router under the request's own field name (not
    the store's), and NaN or infinite sampling values fail their range checks."""
    from services.common.errors import InvalidArgument
    from services.router.generate import validate
    sampling = common_pb2.SamplingParams(**fields.pop("sampling", {}))
    req = router_pb2.GenerateRequest(text="hi", sampling=sampling, **fields)
    with pytest.raises(InvalidArgument, match=named):
        validate(req)
    validate(router_pb2.GenerateRequest(text="hi", adapter_id="pirate-v2.1"))   # fine


def test_resolver_keeps_its_last_answer_while_the_store_is_down(tmp_path) -> None:
    """With the store unreachable, a name resolved before resolves to the same adapter (it may
    be resident on a worker, which needs no store); a name never resolved is UNAVAILABLE."""
    from services.common.errors import LorafleetError
    from tests.support import DEMO_ADAPTERS, MODEL_DIR, Service
    store = Service("adapter_store", ["--adapters-dir", str(DEMO_ADAPTERS), "--model",
                                      str(MODEL_DIR), "--db", ":memory:"], tmp_path).wait()

    async def run():
        resolver = Resolver(grpc.aio.insecure_channel(store.addr), ttl=0.05)
        before = await resolver.resolve("pirate", "acme")
        store.terminate()
        await asyncio.sleep(0.1)                     # past the ttl
        assert await resolver.resolve("pirate", "acme") == before
        try:
            await resolver.resolve("poet", "acme", timeout=5)
            raise AssertionError("resolved with no store")
        except LorafleetError as err:
            assert err.code == grpc.StatusCode.UNAVAILABLE
    try:
        asyncio.run(run())
    finally:
        store.terminate()


class _Deadline:
    """The one part of a ServicerContext that attempts.retryable and generate._ended read."""

    def __init__(self, remaining):
        self.remaining = remaining

    def time_remaining(self):
        return self.remaining


def test_a_failed_attempt_is_retried_only_when_the_client_got_nothing() -> None:
    """Before the first message a lost or failing worker is retried; after it only a unary
    call whose worker connection was lost (UNAVAILABLE), never a stream that has sent tokens,
    a client error or a deadline; and nothing once the request's deadline has passed."""
    from services.router.attempts import AttemptFailed, retryable
    S = grpc.StatusCode

    def failed(code, started):
        err = grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), "x")
        return AttemptFailed(err, "w1", started, cold=False)
    live = _Deadline(None)
    assert retryable(failed(S.UNAVAILABLE, False), False, live)
    assert retryable(failed(S.INTERNAL, False), False, live)
    assert retryable(failed(S.UNAVAILABLE, True), True, live)             # unary, lost
    assert retryable(failed(S.UNAVAILABLE, True), True, _Deadline(5.0))
    assert not retryable(failed(S.UNAVAILABLE, True), False, live)        # stream sent tokens
    assert not retryable(failed(S.INTERNAL, True), True, live)
    for code in (S.INVALID_ARGUMENT, S.NOT_FOUND, S.RESOURCE_EXHAUSTED, S.DEADLINE_EXCEEDED):
        assert not retryable(failed(code, False), True, live), code
        assert not retryable(failed(code, True), True, live), code
    assert not retryable(failed(S.UNAVAILABLE, True), True, _Deadline(0.0))
    assert not retryable(failed(S.UNAVAILABLE, False), False, _Deadline(-1.0))


def test_a_cancelled_request_past_its_deadline_counts_as_deadline_exceeded():
    """gRPC cancels the handler both when the client goes away and when the deadline passes;
    the router's request counts tell the two apart by the time left."""
    from services.router.generate import _ended
    assert _ended(_Deadline(-0.01)) == "DEADLINE_EXCEEDED"
    assert _ended(_Deadline(0.0)) == "DEADLINE_EXCEEDED"
    assert _ended(_Deadline(3.0)) == "CANCELLED"
    assert _ended(_Deadline(None)) == "CANCELLED"                 # no deadline
    assert _ended(None, 0.5, time.monotonic() - 1.0) == "DEADLINE_EXCEEDED"    # at admission
    assert _ended(None, 5.0, time.monotonic()) == "CANCELLED"
    assert _ended(None, None, 0.0) == "CANCELLED"
