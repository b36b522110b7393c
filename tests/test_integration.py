"""Issue 2's walking skeleton, end to end: the three services as processes on loopback with the
embedded demo model and adapters; concurrent requests for three adapters and the base, each
checked against transformers + PEFT; health; the CLI; graceful drain on SIGTERM."""
from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2

from services.client.client import LorafleetClient
from tests.conftest import Stack
from tests.support import DEMO_ADAPTERS, MODEL_DIR, ROOT, health_status

pytestmark = pytest.mark.slow
PROMPT = "Tell me about the weather."
GRACE = 5.0


def demo_adapters() -> list[str]:
    return sorted(p.name for p in DEMO_ADAPTERS.iterdir() if (p / "adapter_config.json").exists())


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    if not (MODEL_DIR / ".complete").exists():
        subprocess.run([sys.executable, "tools/make_tiny_model.py", "--out", "models"],
                       cwd=ROOT, check=True)
    log_dir = tmp_path_factory.mktemp("stack")
    grace = ["--grace", str(GRACE)]
    s = Stack(MODEL_DIR, DEMO_ADAPTERS, log_dir, worker_args=grace, router_args=grace,
              store_args=grace)
    yield s
    s.terminate()


def reference_completion(adapter: str, n: int) -> list[int]:
    """Greedy token ids from transformers (+ PEFT) for the demo prompt, the engine's tokenizer."""
    from peft import PeftModel
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM
    ids = Tokenizer.from_file(str(MODEL_DIR / "tokenizer.json")).encode(PROMPT).ids
    model = AutoModelForCausalLM.from_pretrained(MODEL_DIR, dtype=torch.float32).eval()
    if adapter:
        model = PeftModel.from_pretrained(model, DEMO_ADAPTERS / adapter).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False,
                             pad_token_id=model.config.eos_token_id if not adapter else
                             model.base_model.config.eos_token_id)
    return out[0, len(ids):].tolist()


def test_all_three_services_report_serving(stack):
    for svc in stack.services:
        assert health_status(svc.addr) == health_pb2.HealthCheckResponse.SERVING, svc.name


def test_concurrent_demo_tenants_and_base(stack):
    names = ["", *demo_adapters()] * 3
    assert len(demo_adapters()) >= 3
    with LorafleetClient(stack.router.addr) as c, ThreadPoolExecutor(len(names)) as pool:
        results = list(pool.map(lambda a: c.generate(PROMPT, adapter=a, max_new_tokens=20),
                                names))
    by_adapter: dict[str, set] = {}
    for name, resp in zip(names, results):
        assert resp.text.strip(), name
        assert resp.adapter_id == name
        expected = reference_completion(name, 20)
        assert list(resp.token_ids) == expected[:len(resp.token_ids)], name
        by_adapter.setdefault(name, set()).add(resp.text)
    # greedy: the same adapter always says the same; different adapters say different things
    assert all(len(v) == 1 for v in by_adapter.values())
    texts = [next(iter(v)) for v in by_adapter.values()]
    assert len(set(texts)) == len(texts)


def test_cli_generate_and_listing(stack):
    cli = [sys.executable, "-m", "services.client.cli", "--router", stack.router.addr]
    outs = {}
    for name in ["", *demo_adapters()]:
        res = subprocess.run([*cli, "generate", "--adapter", name, "--max-new-tokens", "12",
                              "--temperature", "0", "--json", PROMPT],
                             capture_output=True, text=True, timeout=60, check=True)
        d = json.loads(res.stdout)
        assert d["text"] and d["token_ids"] and d["stop_reason"] in ("MAX_TOKENS", "EOS_TOKEN")
        assert {"queue_s", "cold_load_s", "time_to_first_token_s", "total_s"} <= set(d["timings"])
        outs[name] = d["text"]
    assert len(set(outs.values())) == len(outs)
    res = subprocess.run([*cli, "adapters", "--json"], capture_output=True, text=True,
                         timeout=30, check=True)
    listed = {a["id"]: a for a in json.loads(res.stdout)["adapters"]}
    for name in demo_adapters():
        assert listed[name]["state"] == "READY" and listed[name]["rank"] > 0
        assert {"id", "owner", "rank", "state"} <= set(listed[name])


def test_malformed_names_are_refused_under_the_public_fields(stack):
    """The router names the public request's fields (`adapter_id`, `tenant`, `aliases`), not the
    store's, and serves the next request."""
    adapter = demo_adapters()[0]
    with LorafleetClient(stack.router.addr) as c:
        for call, field in ((lambda: c.generate(PROMPT, adapter="bad id!!", max_new_tokens=2),
                             "adapter_id:"),
                            (lambda: c.register("okx", f"file://{adapter}", tenant="bad tenant"),
                             "tenant:"),
                            (lambda: c.register("okx", f"file://{adapter}", aliases=["a/b"]),
                             "aliases:")):
            with pytest.raises(grpc.RpcError) as err:
                call()
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert err.value.details().startswith(field), err.value.details()
        assert c.generate(PROMPT, adapter=adapter, max_new_tokens=2).token_ids


def test_sigterm_drains_in_flight_requests_then_exits(stack):
    """Each service, on SIGTERM: in-flight work finishes, the process exits 0 within its grace."""
    with LorafleetClient(stack.router.addr) as c:
        results = []
        t = threading.Thread(target=lambda: results.append(
            list(c.generate_stream(PROMPT, adapter=demo_adapters()[0], max_new_tokens=48))))
        t.start()
        time.sleep(0.3)                      # the stream is running
        start = time.monotonic()
        for svc in stack.services:           # router first, then the worker, then the store
            code = svc.terminate(timeout=GRACE + 10)
            assert code == 0, (svc.name, svc.log()[-2000:])
        assert time.monotonic() - start < 3 * (GRACE + 2)
        t.join(10)
    assert results, "the in-flight stream was cut instead of drained"
    assert results[0][-1].stop_reason != 0
    with pytest.raises(grpc.RpcError):
        with LorafleetClient(stack.router.addr, timeout=2) as c:
            c.generate(PROMPT, max_new_tokens=2)


def test_a_service_whose_picked_port_was_taken_starts_on_another(tmp_path, monkeypatch):
    """tests.support.Service: free_port() lets go of the port it found, so another process can
    take it before the service binds it (a suite run failed so once). The service then exits on
    "Address already in use", and wait() starts it again on a new port."""
    import socket
    from tests import support
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    picks = iter([port])
    real = support.free_port
    monkeypatch.setattr(support, "free_port", lambda: next(picks, None) or real())
    svc = support.Service("adapter_store", ["--adapters-dir", str(DEMO_ADAPTERS), "--model",
                                            str(MODEL_DIR), "--db", ":memory:"], tmp_path)
    try:
        assert svc.port == port
        svc.wait(timeout=60)
        assert svc.port != port
        assert health_status(svc.addr) == health_pb2.HealthCheckResponse.SERVING
    finally:
        svc.terminate()
        taken.close()


def test_a_service_whose_picked_metrics_port_was_taken_starts_on_other_ports(
        tmp_path, monkeypatch):
    """The same race on a port passed as an argument (a FreePort): the store exits on its
    --metrics-port "Address already in use" (a suite run failed so once) and wait() starts it
    again with the argument picked anew."""
    import socket
    import urllib.request
    from tests import support
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    picks = iter([0, port])                 # the listen port as usual, then the taken one
    real = support.free_port
    monkeypatch.setattr(support, "free_port", lambda: next(picks, None) or real())
    metrics = support.FreePort()
    svc = support.Service("adapter_store", ["--adapters-dir", str(DEMO_ADAPTERS), "--model",
                                            str(MODEL_DIR), "--db", ":memory:",
                                            "--metrics-port", metrics], tmp_path)
    try:
        assert metrics.port == port
        svc.wait(timeout=60)
        assert metrics.port != port
        text = urllib.request.urlopen(f"http://127.0.0.1:{metrics}/metrics", timeout=10).read()
        assert b"# TYPE" in text
        assert health_status(svc.addr) == health_pb2.HealthCheckResponse.SERVING
    finally:
        svc.terminate()
        taken.close()


def test_a_serving_answer_from_another_service_on_the_picked_port_is_not_taken_as_ours(
        tmp_path, monkeypatch):
    """The same race where the port's taker is itself a service that answers SERVING (a suite
    run once sent a test's calls to another test's server: UNIMPLEMENTED): wait() sees that
    its own process does not hold the port and starts it again on a new one."""
    from services.common.port_holders import children, holders
    from tests import support
    args = ["--adapters-dir", str(DEMO_ADAPTERS), "--model", str(MODEL_DIR), "--db", ":memory:"]
    other = support.Service("adapter_store", args, tmp_path).wait(timeout=60)
    picks = iter([other.port])
    real = support.free_port
    monkeypatch.setattr(support, "free_port", lambda: next(picks, None) or real())
    svc = support.Service("adapter_store", args, tmp_path)
    try:
        assert svc.port == other.port
        svc.wait(timeout=60)
        assert svc.port != other.port
        assert set(holders(svc.port)) & children(svc.proc.pid)
        assert health_status(svc.addr) == health_pb2.HealthCheckResponse.SERVING
    finally:
        svc.terminate()
        other.terminate()
