"""The router's prompt cap (issue 29, item 8): any text up to gRPC's 64 MiB message limit was
forwarded to a worker (8 concurrent 30 MiB prompts took the router from 343 MB to 1.05 GB).
Now a prompt over --max-prompt-bytes (default 1 MiB) is refused INVALID_ARGUMENT naming the
field before anything is forwarded, and a message far over it is refused by gRPC itself,
RESOURCE_EXHAUSTED, without the router holding it."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from services.common.gen.lorafleet.v1 import common_pb2, router_pb2 as rpb, router_pb2_grpc
from tests.conftest import Stack
from tests.support import DEMO_ADAPTERS, MODEL_DIR

pytestmark = pytest.mark.slow
CAP = 1 << 20                     # the router's default --max-prompt-bytes


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    s = Stack(MODEL_DIR, DEMO_ADAPTERS, tmp_path_factory.mktemp("limits"))
    yield s
    s.terminate()


@pytest.fixture(scope="module")
def stub(stack):
    with grpc.insecure_channel(stack.router.addr,
                               options=[("grpc.max_send_message_length", 64 << 20)]) as ch:
        yield router_pb2_grpc.GenerationServiceStub(ch)


def rss_kb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def generate(stub, **fields):
    return stub.Generate(rpb.GenerateRequest(
        stopping=common_pb2.StoppingCriteria(max_new_tokens=2), **fields), timeout=30)


@pytest.mark.parametrize("fields, name", [
    ({"text": "a" * (CAP + 1)}, "text"),
    ({"text": "é" * (CAP // 2 + 1)}, "text"),           # bytes, not characters
    ({"messages": [common_pb2.ChatMessage(role="user", content="b" * (CAP // 2)),
                   common_pb2.ChatMessage(role="user", content="c" * (CAP // 2))]}, "messages"),
    ({"prompt_token_ids": [7] * (CAP // 4 + 1)}, "prompt_token_ids")])
def test_a_prompt_over_the_cap_is_refused_naming_the_field(stack, stub, fields, name):
    with pytest.raises(grpc.RpcError) as err:
        generate(stub, **fields)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value
    assert err.value.details().startswith(f"{name}: "), err.value.details()
    assert "--max-prompt-bytes" in err.value.details()


def test_a_prompt_under_the_cap_is_served(stub):
    assert generate(stub, text="Tell me about the weather. " * 40).token_ids
    assert generate(stub, prompt_token_ids=[5, 6, 7, 8]).token_ids


def test_tokenize_takes_the_same_cap(stub):
    with pytest.raises(grpc.RpcError) as err:
        stub.Tokenize(rpb.TokenizeRequest(text="a" * (CAP + 1)), timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith("text: ")


def test_huge_messages_are_refused_by_grpc_without_growing_the_router(stack, stub):
    pid = stack.router.proc.pid
    before = rss_kb(pid)
    huge = rpb.GenerateRequest(text="x" * (30 << 20))

    def send(_):
        try:
            stub.Generate(huge, timeout=30)
        except grpc.RpcError as err:
            return err.code()
        return None
    with ThreadPoolExecutor(8) as pool:
        codes = list(pool.map(send, range(8)))
    assert codes == [grpc.StatusCode.RESOURCE_EXHAUSTED] * 8, codes
    grown_mb = (rss_kb(pid) - before) / 1024
    assert grown_mb < 150, f"router RSS grew {grown_mb:.0f} MB"
    assert generate(stub, text="Hello!").token_ids          # still serving
    assert "Traceback" not in stack.router.log()
