"""The worker as two processes: the front end (the public port) and the core (the engine).

Generate goes over the link between them and every other RPC is passed through; these tests
run real workers and check what a caller sees: the same tokens as a one-process worker, refusals
with their status, a cancelled or expired call freeing its row in the core, a drain that lets
streams in flight finish, and either process dying taking the other down rather than leaving a
port that accepts calls nobody serves."""
from __future__ import annotations

import os
import signal
import socket
import time
import urllib.request

import grpc
import pytest

from services.common.gen.lorafleet.v1 import common_pb2, worker_pb2 as wpb, worker_pb2_grpc
from tests.support import FreePort, MODEL_DIR, Service, health_status

pytestmark = pytest.mark.slow
CLOSED_STORE = "127.0.0.1:1"              # nothing listens there: no adapter is requested


def children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = open(f"/proc/{entry}/stat").read()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(entry))
    return out


def alive(pid: int) -> bool:
    try:
        stat = open(f"/proc/{pid}/stat").read()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def wait_gone(pid: int, timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not alive(pid):
            return True
        time.sleep(0.05)
    return False


def request(n: int, prompt=(1, 5, 9, 14), **sampling) -> wpb.WorkerGenerateRequest:
    return wpb.WorkerGenerateRequest(
        request_id="t", prompt_token_ids=list(prompt),
        sampling=common_pb2.SamplingParams(**sampling),
        stopping=common_pb2.StoppingCriteria(max_new_tokens=n, ignore_eos=True))


def start(tmp, *extra, metrics: FreePort | str = "0") -> Service:
    return Service("worker", ["--model", str(MODEL_DIR), "--store", CLOSED_STORE, "--device",
                              "cpu", "--metrics-port", metrics, "--grace", "20", *extra],
                   tmp).wait()


def counter(port: int, name: str, label: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    for line in text.splitlines():
        if line.startswith(name) and label in line:
            return float(line.split()[-1])
    return 0.0


@pytest.fixture(scope="module")
def workers(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("frontend")
    metrics = FreePort()
    split = start(tmp, metrics=metrics)
    inline = start(tmp, "--frontend", "inline")
    yield split, inline, metrics
    assert split.terminate() == 0 and inline.terminate() == 0


def test_the_split_worker_streams_what_the_one_process_worker_does(workers):
    split, inline, _ = workers
    assert len(children(split.proc.pid)) == 1 and children(inline.proc.pid) == []
    outs = []
    for w in (split, inline):
        with grpc.insecure_channel(w.addr) as ch:
            stub = worker_pb2_grpc.WorkerStub(ch)
            got = list(stub.Generate(request(24, temperature=0.8, seed=7), timeout=30))
            outs.append(([t for r in got for t in r.token_ids], "".join(r.text for r in got),
                         got[-1].stop_reason, got[-1].usage.generated_tokens))
            assert all(r.stop_reason == 0 for r in got[:-1]) and len(got) == 24
            assert got[-1].timings.total_s > 0
            info = stub.Info(wpb.WorkerInfoRequest(), timeout=10)     # passed through
            assert info.model_name and info.vocab_size > 0
    assert outs[0] == outs[1] and outs[0][2] == common_pb2.MAX_TOKENS and outs[0][3] == 24


def test_refusals_keep_their_status(workers):
    split, _, _ = workers
    with grpc.insecure_channel(split.addr) as ch:
        stub = worker_pb2_grpc.WorkerStub(ch)
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(request(4, temperature=-1.0), timeout=10))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "temperature" in err.value.details()
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(request(4, prompt=(10 ** 7,)), timeout=10))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "vocabulary" in err.value.details()
        with pytest.raises(grpc.RpcError) as err:                  # a pass-through refusal
            stub.OffloadAdapter(wpb.OffloadAdapterRequest(id="../x"), timeout=10)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert list(stub.Generate(request(3), timeout=10))[-1].usage.generated_tokens == 3


def test_a_cancelled_or_expired_call_frees_its_row_in_the_core(workers):
    split, _, metrics = workers
    before = counter(metrics, "lorafleet_worker_requests_total", 'stop_reason="CANCELLED"')
    with grpc.insecure_channel(split.addr) as ch:
        stub = worker_pb2_grpc.WorkerStub(ch)
        call = stub.Generate(request(500), timeout=30)
        next(call)
        call.cancel()
        with pytest.raises(grpc.RpcError) as err:
            for _ in stub.Generate(request(500), timeout=0.3):
                time.sleep(0.01)                                   # a slow reader
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if counter(metrics, "lorafleet_worker_requests_total",
                       'stop_reason="CANCELLED"') >= before + 2:
                break
            time.sleep(0.05)
        assert counter(metrics, "lorafleet_worker_requests_total",
                       'stop_reason="CANCELLED"') == before + 2
        assert list(stub.Generate(request(2), timeout=10))[-1].usage.generated_tokens == 2


def test_sigterm_lets_streams_in_flight_finish(tmp_path):
    w = start(tmp_path)
    front = children(w.proc.pid)[0]
    with grpc.insecure_channel(w.addr) as ch:
        stub = worker_pb2_grpc.WorkerStub(ch)
        calls = [stub.Generate(request(400), timeout=60) for _ in range(4)]
        firsts = [next(c) for c in calls]
        w.proc.send_signal(signal.SIGTERM)
        got = [len(f.token_ids) + sum(len(r.token_ids) for r in c) for f, c in
               zip(firsts, calls)]
    assert got == [400] * 4
    assert w.proc.wait(30) == 0 and wait_gone(front)


def test_the_core_killed_ends_its_calls_and_its_front_end(tmp_path):
    w = start(tmp_path)
    front = children(w.proc.pid)[0]
    with grpc.insecure_channel(w.addr) as ch:
        call = worker_pb2_grpc.WorkerStub(ch).Generate(request(500), timeout=60)
        next(call)
        w.proc.kill()
        with pytest.raises(grpc.RpcError) as err:
            list(call)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert wait_gone(front)


def test_the_front_end_killed_stops_the_core(tmp_path):
    w = start(tmp_path)
    assert health_status(w.addr) == 1                              # SERVING
    os.kill(children(w.proc.pid)[0], signal.SIGKILL)
    assert w.proc.wait(30) == 1
    assert "the front end exited" in w.log()


def test_a_port_in_use_fails_the_worker(tmp_path):
    with socket.socket() as taken:                  # bound without SO_REUSEPORT
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        w = Service("worker", ["--model", str(MODEL_DIR), "--store", CLOSED_STORE,
                               "--device", "cpu"], tmp_path, port=taken.getsockname()[1])
        assert w.proc.wait(60) == 1
    assert "could not serve" in w.log() and not children(w.proc.pid)
