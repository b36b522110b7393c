"""Keepalive pings that the servers accept: services whose channels ping every second stay
connected through an idle spell, with no GOAWAY (too_many_pings) and no error in any log.
(Before, servers kept gRPC's default of one ping every five minutes on an idle connection, and
answered the clients' 20-second pings with GOAWAY after three: about five minutes after start
an idle worker -> store channel was dropped and the worker logged errors.)"""
from __future__ import annotations

import time

import pytest

from services.client.client import LorafleetClient
from tests.conftest import Stack
from tests.support import DEMO_ADAPTERS, MODEL_DIR

pytestmark = pytest.mark.slow


def test_one_second_keepalives_through_an_idle_spell_drop_nothing(tmp_path):
    fast = ["--keepalive-s", "1"]
    stack = Stack(MODEL_DIR, DEMO_ADAPTERS, tmp_path, worker_args=fast, router_args=fast,
                  store_args=fast)
    try:
        with LorafleetClient(stack.router.addr) as c:
            assert c.generate("Hello!", adapter="pirate", max_new_tokens=4).token_ids
            time.sleep(8)            # idle: each channel pings ~8 times; GOAWAY came after 3
            # a cold load over the idle worker -> store channel, and the router's channels
            assert c.generate("Hello!", adapter="poet", max_new_tokens=4).token_ids
            assert c.generate("Hello!", max_new_tokens=4).token_ids
    finally:
        codes = stack.terminate()
    logs = {s.name: s.log_path.read_text() for s in stack.services}
    for name, text in logs.items():
        for bad in ("too_many_pings", "GOAWAY", "ENHANCE_YOUR_CALM", " ERROR "):
            assert bad not in text, (name, bad, text[-3000:])
    assert codes == [0, 0, 0]


def test_keepalive_below_one_second_is_refused():
    from services.common.config import ServiceFlags
    with pytest.raises(ValueError, match="--keepalive-s"):
        ServiceFlags(listen="h:1", metrics_port=0, keepalive_s=0.2, grace=1.0)
