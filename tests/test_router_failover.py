"""Cancels and lost workers, through the running services: a client cancel (or its deadline)
reaches the worker and frees the row and its KV at once; a worker SIGKILLed under load loses no
request that had not streamed a token (one retry on the other worker), and requests cut
mid-stream end UNAVAILABLE with what they got a clean prefix (nothing duplicated); a unary
Generate, which sends nothing before its end, is retried on the other worker even after its
worker died mid-generation; a cold load that fails because the store is down says so."""
from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from services.client.client import LorafleetClient
from services.common.gen.lorafleet.v1 import worker_pb2 as wpb, worker_pb2_grpc
from tests.conftest import ResidencyWatch, Stack
from tests.support import Service

pytestmark = pytest.mark.slow


def test_client_cancel_frees_the_row_on_the_worker(long_context, tmp_path):
    base, adapters = long_context
    stack = Stack(base, adapters, tmp_path)
    watch = ResidencyWatch(stack.workers[0].addr)
    try:
        with LorafleetClient(stack.router.addr, timeout=120) as c:
            kw = dict(adapter="long", prompt_ids=[3, 4, 5, 6], max_new_tokens=3000,
                      ignore_eos=True)
            a, b = c.generate_stream(**kw), c.generate_stream(**kw)
            next(a), next(b)
            watch.wait(lambda w: w.load.running == 2 and w.rows("long") == 2)
            a.cancel()
            watch.wait(lambda w: w.load.running == 1 and w.rows("long") == 1, timeout=5)
            assert next(b).token_ids                  # the other row runs on, untouched
            b.cancel()
            idle = lambda w: ((w.load.running, w.load.waiting, w.rows("long")) == (0, 0, 0)
                              and w.load.kv_used_fraction == 0.0)
            watch.wait(idle, timeout=5)
        with LorafleetClient(stack.router.addr, timeout=0.5) as c:     # the deadline too
            with pytest.raises(grpc.RpcError) as err:
                c.generate(**kw)
            assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            watch.wait(idle, timeout=5)
        stats = LorafleetClient(stack.router.addr).stats()
        dev = {t.tenant: t for t in stats.tenants}["dev"]
        assert dev.requests == 3 and dev.tokens_served < 3 * 3000
    finally:
        watch.close()
        assert all(code == 0 for code in stack.terminate())


def _stream(client, i, out, progress):
    """Run request i, recording every token and the final status in out[i]."""
    kw = dict(adapter=f"a{i:02d}", prompt_ids=[2 + i, 9, 4, 17], max_new_tokens=24,
              ignore_eos=True)
    try:
        for resp in client.generate_stream(**kw):
            out[i]["tokens"].extend(resp.token_ids)
            progress.set()
            if resp.stop_reason:
                out[i]["stop"] = resp.stop_reason
    except grpc.RpcError as err:
        out[i]["code"] = err.code()


@pytest.fixture(scope="module")
def pair(lora_fleet, tmp_path_factory):
    """Two workers (two rows at a time each) behind the router: a silent worker stopped and
    resumed leaves it whole for the worker killed under load, which starts its victim again
    (one stack for both, the silent test first); router and store exit cleanly at the end."""
    base, adapters = lora_fleet
    stack = Stack(base, adapters, tmp_path_factory.mktemp("pair"), workers=2,
                  worker_args=["--max-running", "2"])
    yield stack
    codes = stack.terminate()
    assert codes[0] == 0 and codes[-1] == 0                          # router, store


def test_a_silent_worker_is_taken_as_gone(pair):
    """A worker that stops answering without closing its connections (SIGSTOP: hung, or its
    host gone) is dropped once its residency stream is silent for STALL_S, and found again
    when it resumes."""
    import os
    import signal
    from services.router.workers import STALL_S
    stack = pair
    hung = stack.workers[1]
    with LorafleetClient(stack.router.addr, timeout=30) as c:
        assert c.model_info().num_workers == 2
        os.kill(hung.proc.pid, signal.SIGSTOP)
        try:
            end = time.monotonic() + STALL_S + 10
            while c.model_info().num_workers != 1:
                assert time.monotonic() < end, "the silent worker was not dropped"
                time.sleep(0.5)
        finally:
            os.kill(hung.proc.pid, signal.SIGCONT)
        end = time.monotonic() + 15
        while c.model_info().num_workers != 2:
            assert time.monotonic() < end, "the resumed worker was not found again"
            time.sleep(0.5)


def test_worker_killed_under_load(pair, lora_fleet, tmp_path):
    base, adapters = lora_fleet
    n = 24
    # Two rows at a time per worker: most requests wait in a worker's queue (no token yet).
    stack = pair
    out = [{"tokens": [], "code": None, "stop": 0} for _ in range(n)]
    progress = threading.Event()
    victim = stack.workers[0]
    with LorafleetClient(stack.router.addr, timeout=120) as c, ThreadPoolExecutor(n) as pool:
        futures = [pool.submit(_stream, c, i, out, progress) for i in range(n)]
        end = time.monotonic() + 60
        while sum(len(r["tokens"]) >= 2 for r in out) < 4:    # both workers streaming
            assert time.monotonic() < end, out
            progress.wait(0.05)
        victim.kill()                                            # SIGKILL
        started = [len(r["tokens"]) > 0 for r in out]
        for f in futures:
            f.result()
        reference = [list(c.generate(adapter=f"a{i:02d}", prompt_ids=[2 + i, 9, 4, 17],
                                     max_new_tokens=24, ignore_eos=True).token_ids)
                     for i in range(n)]
    cut = [i for i, r in enumerate(out) if r["code"] is not None]
    for i, r in enumerate(out):
        if r["code"] is None:
            assert r["tokens"] == reference[i], i                # complete, not duplicated
        else:
            assert r["code"] == grpc.StatusCode.UNAVAILABLE, (i, r)
            assert started[i] and r["tokens"], i                 # only mid-stream ones end
            assert r["tokens"] == reference[i][:len(r["tokens"])], i
    retried = stack.router.log().count("retrying elsewhere")
    print(f"\nkilled a worker under load: {n} requests, {len(cut)} cut mid-stream "
          f"(UNAVAILABLE), {retried} retried before their first token, "
          f"{n - len(cut)} complete")
    assert retried >= 1 and len(cut) >= 1
    # The worker comes back on its address: the router reconnects (fresh snapshot).
    stack.workers[0] = Service("worker", ["--model", str(base), "--store", stack.store.addr,
                                          "--device", "cpu"], tmp_path,
                               port=victim.port).wait()
    with LorafleetClient(stack.router.addr, timeout=30) as c:
        end = time.monotonic() + 15
        while c.model_info().num_workers < 2:
            assert time.monotonic() < end, "the router did not reconnect"
            time.sleep(0.2)


def test_unary_generate_is_retried_after_its_worker_dies_mid_generation(long_context, tmp_path):
    """Nothing of a unary Generate has reached the client before it ends, so a worker SIGKILLed
    mid-generation costs one retry on the other worker, not an UNAVAILABLE; the answer is the
    whole greedy generation, once."""
    base, adapters = long_context
    stack = Stack(base, adapters, tmp_path, workers=2)
    watches = [ResidencyWatch(w.addr) for w in stack.workers]
    kw = dict(adapter="long", prompt_ids=[3, 4, 5, 6], max_new_tokens=1500, ignore_eos=True)
    try:
        with LorafleetClient(stack.router.addr, timeout=120) as c, ThreadPoolExecutor(1) as pool:
            answer = pool.submit(c.generate, **kw)
            end = time.monotonic() + 30
            while not any(w.load.running for w in watches):
                assert time.monotonic() < end and not answer.done(), "the request never ran"
                time.sleep(0.02)
            victim = next(i for i, w in enumerate(watches) if w.load.running)
            time.sleep(1.0)                     # decoding: tokens have reached the router
            assert not answer.done()
            stack.workers[victim].kill()                                 # SIGKILL
            resp = answer.result()
            reference = c.generate(**kw)                                 # on the survivor
        assert len(resp.token_ids) == 1500 and resp.stop_reason
        assert list(resp.token_ids) == list(reference.token_ids)
        assert "failed mid-generation" in stack.router.log()
    finally:
        for w in watches:
            w.close()
        stack.terminate()


def test_cold_load_with_the_store_down_names_the_store(lora_fleet, tmp_path):
    """The store dies; a name the router resolved before still resolves (its last answer), so
    the request reaches the worker, whose cold load cannot fetch the adapter. The client is told
    UNAVAILABLE naming the adapter and the unreachable store, not "no live worker" (the
    workers are fine)."""
    base, adapters = lora_fleet
    stack = Stack(base, adapters, tmp_path)
    kw = dict(adapter="a03", prompt_ids=[5, 6, 7], max_new_tokens=2)
    try:
        with LorafleetClient(stack.router.addr, timeout=30) as c:
            c.generate(**kw)                                             # resolved, resident
            with grpc.insecure_channel(stack.workers[0].addr) as ch:     # now cold again
                worker_pb2_grpc.WorkerStub(ch).OffloadAdapter(
                    wpb.OffloadAdapterRequest(id="a03", to_host=False), timeout=10)
            stack.store.kill()
            with pytest.raises(grpc.RpcError) as err:
                c.generate(**kw)
            assert c.generate(prompt_ids=[5, 6, 7], max_new_tokens=2).stop_reason  # worker ok
        details = err.value.details()
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE, details
        assert "'a03' could not be loaded" in details and "adapter-store is unreachable" in details
        assert "no live worker" not in details
    finally:
        stack.terminate()
