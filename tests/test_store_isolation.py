"""Issue 41: a directory that is an adapter's source belongs to that registration. Through the
real store and router (processes on loopback) and the `lorafleet` CLI: a tenant's private
adapter registered from ADAPTERS_DIR/NAME is not published as the shared adapter NAME when the
store restarts with its --db (nor through a symlink to it, nor when an earlier scan published it
after the registration); a directory the scan published first stays public. Also: file:///ABS
sources under an --allow-source-root, refusals that name the allowed directories, and an
admin's `adapters --owner T`.
"""
from __future__ import annotations

import json
import os
import shutil
import sqlite3
import time

import grpc
import pytest

from services.adapter_store.registry import AdapterRecord, Registry
from tests.store_stack import StoreRouter, cli, rpc_error
from tests.test_store_support import StoreClient, good_adapter

NOT_FOUND = grpc.StatusCode.NOT_FOUND


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("store-isolation")
    adapters, extra = tmp / "adapters", tmp / "extra"
    good_adapter(adapters / "team-weights", seed=1)      # published by the scan at start
    good_adapter(extra / "outside", seed=4)
    good_adapter(tmp / "elsewhere" / "nope", seed=5)
    s = StoreRouter(tmp, adapters, store_args=["--allow-source-root", str(extra)])
    s.adapters, s.extra = adapters, extra
    yield s
    s.close()


def shared_ids(stack) -> set[str]:
    c = StoreClient(stack.store.addr)
    try:
        return {a.id for a in c.list(all_tenants=True) if a.shared}
    finally:
        c.close()


def test_a_private_adapter_stays_private_across_a_store_restart(stack, capsys):
    """The issue's steps: copy a LoRA into ADAPTERS_DIR/alice-weights, register it for alice,
    restart the store with the same --db: bob gets NOT_FOUND for alice-weights (the unknown-id
    answer), no shared alice-weights is listed; nor is a symlink to alice's directory or to
    her weights file, nor her file:///ABS source inside the dir. (Before the fix the scan
    published alice-weights, and bob's request went on to wait for a worker.)"""
    good_adapter(stack.adapters / "alice-weights", seed=2)
    good_adapter(stack.adapters / "alice-abs", seed=3)
    rc, out, err = cli(capsys, stack, "tok-ops", "register", "--id", "alice-x", "--source",
                       "file://alice-weights", "--tenant", "alice")
    assert rc == 0 and "registered alice-x" in out, err
    rc, _, err = cli(capsys, stack, "tok-ops", "register", "--id", "alice-y", "--source",
                     f"file://{stack.adapters / 'alice-abs'}", "--tenant", "alice")
    assert rc == 0, err
    os.symlink(stack.adapters / "alice-weights", stack.adapters / "alias-link")
    (stack.adapters / "sneaky").mkdir()
    shutil.copy(stack.adapters / "alice-weights" / "adapter_config.json",
                stack.adapters / "sneaky")
    os.symlink(stack.adapters / "alice-weights" / "adapter_model.safetensors",
               stack.adapters / "sneaky" / "adapter_model.safetensors")
    stack.restart_store()
    hidden = ("alice-weights", "alice-abs", "alias-link", "sneaky")
    assert not set(hidden) & shared_ids(stack) and "team-weights" in shared_ids(stack)
    with stack.client("tok-bob") as bob:
        unknown = rpc_error(bob.generate, adapter="no-such-adapter", prompt_ids=[1, 2],
                            max_new_tokens=1)
        for name in hidden:
            err = rpc_error(bob.generate, adapter=name, prompt_ids=[1, 2], max_new_tokens=1)
            assert err.code() == unknown.code() == NOT_FOUND, (name, err.details())
            assert err.details() == unknown.details().replace("no-such-adapter", name)
        assert not set(hidden) & {a.id for a in bob.adapters()}
    rc, out, _ = cli(capsys, stack, "tok-alice", "adapters", "--json")
    mine = {a["id"]: a for a in json.loads(out)["adapters"]}
    assert mine["alice-x"]["owner"] == "alice" and not set(hidden) & set(mine)


def test_an_admin_lists_a_tenants_adapters(stack, capsys):
    """`adapters --owner alice` as an admin lists alice's private adapters (it printed nothing:
    the listing was the admin's own and the shared ones, filtered by owner); a user naming
    another owner still sees none of them."""
    with stack.client("tok-ops") as ops:
        ops.register("alice-z", "file://team-weights", tenant="alice")
    rc, out, _ = cli(capsys, stack, "tok-ops", "adapters", "--owner", "alice", "--json")
    listed = {a["id"]: a["owner"] for a in json.loads(out)["adapters"]}
    assert rc == 0 and "alice-z" in listed and set(listed.values()) == {"alice"}
    rc, out, _ = cli(capsys, stack, "tok-bob", "adapters", "--owner", "alice", "--json")
    assert rc == 0 and json.loads(out)["adapters"] == []


def test_a_directory_the_scan_published_first_stays_public(stack, capsys):
    """The reverse order: team-weights was shared (scanned at start) before an admin registered
    alice-team from it. Its bytes were every tenant's already, so it stays published across a
    restart (removing it would break the tenants using it and hide nothing); the store logs a
    warning that tells the admin so at registration."""
    with stack.client("tok-ops") as ops:
        assert not ops.register("alice-team", "file://team-weights", tenant="alice").shared
    assert "also the shared adapter 'team-weights'" in stack.store.log()
    stack.restart_store()
    assert "team-weights" in shared_ids(stack)
    with stack.client("tok-bob") as bob:
        assert "team-weights" in {a.id for a in bob.adapters()}
        assert rpc_error(bob.versions, "alice-team").code() == NOT_FOUND


def test_a_scan_record_published_after_a_private_registration_is_removed(tmp_path):
    """A --db in which an earlier scan (without the check) published alice's directory after
    her registration: the store's start removes that shared record, and bob gets NOT_FOUND."""
    adapters = tmp_path / "adapters"
    good_adapter(adapters / "alice-weights", seed=2)
    db = tmp_path / "state" / "registry.sqlite"
    reg = Registry(str(db))
    t = time.time()
    reg.put(AdapterRecord("alice-x", "alice", "file://alice-weights", "REGISTERED",
                          created=t - 60), replace=False)
    reg.put(AdapterRecord("alice-weights", "", "file://alice-weights", "REGISTERED",
                          created=t - 30, aliases=("weights",)), replace=False)
    reg.close()
    from tests.support import Service
    from tests.test_store_support import write_base
    store = Service("adapter_store", ["--base-config", str(write_base(tmp_path / "base")),
                                      "--adapters-dir", str(adapters), "--db", str(db)],
                    tmp_path).wait()
    c = StoreClient(store.addr)
    try:
        for name in ("alice-weights", "weights"):
            assert c.error(c.resolve, name, tenant="bob")[0] == NOT_FOUND
        assert c.resolve("alice-x", tenant="alice").owner == "alice"
        assert "its shared record (published by an earlier scan) is removed" in store.log()
    finally:
        c.close()
        assert store.terminate() == 0
    with sqlite3.connect(db) as raw:
        assert raw.execute("SELECT id FROM adapters ORDER BY id").fetchall() == [("alice-x",)]


def test_file_abs_sources_and_the_roots_they_may_be_under(stack):
    """file:///ABS under --allow-source-root registers; outside every allowed directory it is
    INVALID_ARGUMENT naming the `source` field, the adapters dir, the allowed root and the
    flag that allows more (it used to say only that the path must be relative)."""
    with stack.client("tok-ops") as ops:
        info = ops.register("outside-a", f"file://{stack.extra / 'outside'}", tenant="bob")
        assert info.state == "READY" and info.source == f"file://{stack.extra / 'outside'}"
        nope = stack.tmp / "elsewhere" / "nope"
        for source in (f"file://{nope}", "file://../elsewhere/nope"):
            err = rpc_error(ops.register, "nope", source)
            assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err.details()
            assert err.details().startswith("source:"), err.details()
        err = rpc_error(ops.register, "nope", f"file://{nope}")
        for named in (str(stack.adapters), str(stack.extra), "--allow-source-root DIR"):
            assert named in err.details(), err.details()
    with stack.client("tok-bob") as bob:
        assert "outside-a" in {a.id for a in bob.adapters()}
