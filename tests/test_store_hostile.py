"""Hostile adapter directories (issue 29, items 2-4): whatever sits in an adapter's place, the
store starts, lists the adapter FAILED naming the file, refuses it through Register with
INVALID_ARGUMENT, and keeps serving everyone else.

- adapter_config.json being a directory: IsADirectoryError ended the store at start (exit 1)
  and Register answered INTERNAL;
- a FIFO as a file: open() blocked until a writer came, so the store hung before binding, and
  eight such Registers held every thread of the default executor, failing the next good one;
- a target_modules regex that backtracks (`model\\.lay(.|.)*!`): 8.4 s a Register, 11.4 s at
  start (worse patterns: hours)."""
from __future__ import annotations

import asyncio
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from services.adapter_store.work_pool import ValidationPool
from services.common.errors import ResourceExhausted
from tests.support import Service
from tests.test_store_support import (StoreClient, good_adapter, lora_tensors, peft_config,
                                      write_adapter, write_base)

pytestmark = pytest.mark.slow
INVALID = grpc.StatusCode.INVALID_ARGUMENT
BACKTRACKING = r"model\.lay(.|.)*!"


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("store-hostile")
    root = tmp / "adapters"
    good_adapter(root / "good", seed=1)
    write_adapter(root / "dirconfig", None, lora_tensors())
    (root / "dirconfig" / "adapter_config.json").mkdir()
    write_adapter(root / "dirweights", peft_config())
    (root / "dirweights" / "adapter_model.safetensors").mkdir()
    write_adapter(root / "fifo", peft_config())
    os.mkfifo(root / "fifo" / "adapter_model.safetensors")
    (root / "fifoconfig").mkdir()
    os.mkfifo(root / "fifoconfig" / "adapter_config.json")
    write_adapter(root / "regex", peft_config(target_modules=BACKTRACKING), lora_tensors())
    started = time.monotonic()
    store = Service("adapter_store", ["--base-config", str(write_base(tmp / "base")),
                                      "--adapters-dir", str(root), "--db", ":memory:",
                                      "--background-validate-threads", "0"],  # first use
                    tmp).wait(timeout=30)
    client = StoreClient(store.addr)
    yield {"store": store, "client": client, "start_s": time.monotonic() - started,
           "root": root}
    client.close()
    assert store.terminate() == 0


def test_store_starts_and_lists_each_bad_adapter_failed_naming_the_file(env):
    assert env["start_s"] < 20
    listed = {a.id: a for a in env["client"].list(all_tenants=True)}
    assert listed["good"].state == "REGISTERED"          # its weights are read on first use
    assert env["client"].resolve("good").state == "READY"
    for name, words in {"dirconfig": ("adapter_config.json", "directory"),
                        "dirweights": ("adapter_model.safetensors", "directory"),
                        "fifo": ("adapter_model.safetensors", "FIFO"),
                        "fifoconfig": ("adapter_config.json", "FIFO"),
                        "regex": ("target_modules", "too long")}.items():
        assert listed[name].state == "FAILED", name
        for word in words:
            assert word in listed[name].failure_reason, (name, listed[name].failure_reason)
    assert "Traceback" not in env["store"].log()


@pytest.mark.parametrize("source, words", [
    ("file://dirconfig", ("adapter_config.json", "directory")),
    ("file://dirweights", ("adapter_model.safetensors", "directory")),
    ("file://fifoconfig", ("adapter_config.json", "FIFO")),
    ("file://regex", ("target_modules", "too long"))])
def test_register_refuses_naming_the_file(env, source, words):
    c = env["client"]
    started = time.monotonic()
    code, message = c.error(c.register, "hostile", source, timeout=5)
    assert code == INVALID and time.monotonic() - started < 3, (code, message)
    assert all(w in message for w in words), message


def test_fifo_registers_leave_the_store_serving(env):
    """Many concurrent Registers of a FIFO-backed adapter are each refused at once (naming the
    FIFO, or RESOURCE_EXHAUSTED when the tenant's share of the validation threads is busy at
    that moment: a loaded machine), none hangs, and a good Register right after succeeds."""
    c = env["client"]
    with ThreadPoolExecutor(12) as pool:
        results = list(pool.map(lambda i: c.error(c.register, f"fifo-{i}", "file://fifo",
                                                  timeout=5), range(12)))
    assert all(code == INVALID and "FIFO" in message
               or code == grpc.StatusCode.RESOURCE_EXHAUSTED for code, message in results), \
        results
    assert any(code == INVALID for code, _ in results)
    assert c.register("good-again", "file://good", timeout=5).state == "READY"


def test_ordinary_target_modules_regex_keeps_peft_semantics(env):
    """re.fullmatch of the module path, as PEFT: the pattern picks q and v of every layer."""
    write_adapter(env["root"] / "regex-ok", peft_config(target_modules=r".*\.(q_proj|v_proj)"),
                  lora_tensors())
    info = env["client"].register("regex-ok", "file://regex-ok", timeout=5)
    assert list(info.target_modules) == ["q_proj", "v_proj"]


def test_one_owner_cannot_take_every_validation_thread():
    """ValidationPool: one owner's jobs stuck in their threads hold its share only; another
    owner's job runs at once, and the slots come back when the threads end."""
    release = threading.Event()

    async def scenario():
        pool = ValidationPool(threads=4)
        stuck = [asyncio.ensure_future(pool.run("slow", release.wait, 30)) for _ in range(2)]
        await asyncio.sleep(0.1)
        with pytest.raises(ResourceExhausted) as err:
            await pool.run("slow", release.wait, 30)
        assert err.value.retry_after
        assert await asyncio.wait_for(pool.run("other", lambda: "done"), 2) == "done"
        release.set()
        await asyncio.gather(*stuck)
        await asyncio.sleep(0.05)
        assert pool.busy("slow") == 0
        assert await pool.run("slow", lambda: 1) == 1
        pool.close()
    asyncio.run(scenario())
