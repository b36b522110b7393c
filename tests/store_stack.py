"""Test support for the store's tests through the router (no tests here): an adapter store and a
router with a --tenants file as real processes on loopback, no worker (listing, registering,
resolving and versions need none), and the `lorafleet` CLI run against them."""
from __future__ import annotations

import json
import pathlib
import time

import grpc

from services.client.cli import main as cli_main
from services.client.client import LorafleetClient
from tests.support import Service, free_port
from tests.test_store_support import write_base

TENANTS = {"tenants": {"ops": {"tokens": ["tok-ops"], "role": "admin"},
                       "alice": {"tokens": ["tok-alice"]},
                       "bob": {"tokens": ["tok-bob"]}}}


class StoreRouter:
    """A store (a kept --db, so it can restart on its port) and a router in front of it."""

    def __init__(self, tmp: pathlib.Path, adapters: pathlib.Path, store_args=()):
        self.tmp = tmp
        (tmp / "tenants.json").write_text(json.dumps(TENANTS))
        self.store_args = ["--base-config", str(write_base(tmp / "base")), "--adapters-dir",
                           str(adapters), "--db", str(tmp / "state" / "registry.sqlite"),
                           *store_args]
        self.store = Service("adapter_store", self.store_args, tmp).wait()
        # no worker listens on this port: the router says NOT_SERVING, but answers
        self.router = Service("router", ["--store", self.store.addr, "--worker",
                                         f"127.0.0.1:{free_port()}", "--tenants",
                                         str(tmp / "tenants.json"), "--insecure-internal"], tmp)
        self._wait_answering()

    def _wait_answering(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                with self.client("tok-ops") as c:
                    c.adapters_page(page_size=1)
                return
            except grpc.RpcError:
                if time.monotonic() > deadline or self.router.proc.poll() is not None:
                    print(self.router.log())
                    raise
                time.sleep(0.2)

    def client(self, token: str | None) -> LorafleetClient:
        return LorafleetClient(self.router.addr, token, timeout=10)

    def restart_store(self) -> None:
        """SIGTERM the store and start it again on its port with the same --db."""
        assert self.store.terminate() == 0
        self.store = Service("adapter_store", self.store_args, self.tmp,
                             port=self.store.port).wait()

    def close(self) -> None:
        assert self.router.terminate() == 0
        assert self.store.terminate() == 0


def cli(capsys, stack: StoreRouter, token: str, *args: str) -> tuple[int, str, str]:
    """Run `lorafleet --router ROUTER --token TOKEN ARGS...` (its main, over real gRPC):
    (exit code, stdout, stderr)."""
    capsys.readouterr()
    rc = cli_main(["--router", stack.router.addr, "--token", token, "--timeout", "10", *args])
    out = capsys.readouterr()
    return rc, out.out, out.err


def rpc_error(call, *args, **kwargs) -> grpc.RpcError:
    try:
        call(*args, **kwargs)
    except grpc.RpcError as err:
        return err
    raise AssertionError(f"{call} succeeded; expected an error")
