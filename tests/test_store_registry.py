"""The adapter registry through the running store: tenant visibility, atomic replace with alias
swap, Delete, FAILED adapters, and persistence across a restart with the same --db.
"""
from __future__ import annotations

import threading

import grpc
import pytest

from tests.support import Service
from tests.test_store_support import (StoreClient, good_adapter, peft_config, sha256,
                                      write_adapter, write_base)

NOT_FOUND = grpc.StatusCode.NOT_FOUND


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("store-registry")
    root = tmp / "adapters"
    good_adapter(root / "v1", seed=1)
    good_adapter(root / "v2", seed=2, r=8, target_modules=["q_proj", "k_proj", "v_proj"])
    good_adapter(root / "shared-a", seed=3)
    write_adapter(root / "broken", peft_config(use_dora=True))
    args = ["--base-config", str(write_base(tmp / "base")), "--adapters-dir", str(root),
            "--db", str(tmp / "state" / "registry.sqlite")]
    store = Service("adapter_store", args, tmp).wait()
    state = {"store": store, "client": StoreClient(store.addr), "args": args, "tmp": tmp}
    yield state
    state["client"].close()
    assert state["store"].terminate() == 0


def test_tenant_visibility(env):
    c = env["client"]
    mine = c.register("acme-chat", "file://v1", owner="acme", aliases=["acme", "acme-task-1"])
    assert mine.owner == "acme" and not mine.shared and list(mine.aliases) == [
        "acme", "acme-task-1"]
    assert c.resolve("acme", tenant="acme").version == mine.version
    assert c.resolve("acme-task-1", tenant="acme").id == "acme-chat"
    assert c.resolve("shared-a", tenant="globex").shared
    unknown = c.error(c.resolve, "no-such-adapter", tenant="globex")
    for name in ("acme", "acme-chat", "acme-task-1"):
        other = c.error(c.resolve, name, tenant="globex")
        assert other[0] == unknown[0] == NOT_FOUND
        assert other[1] == unknown[1].replace("no-such-adapter", name)
    assert c.error(c.resolve, "acme", tenant="")[0] == NOT_FOUND
    ids = lambda adapters: {a.id for a in adapters}  # noqa: E731
    assert {"acme-chat", "shared-a", "v1"} <= ids(c.list("acme"))
    assert "acme-chat" not in ids(c.list("globex")) and "shared-a" in ids(c.list("globex"))
    assert "acme-chat" in ids(c.list(all_tenants=True))


def test_replace_swaps_version_and_aliases_atomically(env):
    c = env["client"]
    v1 = c.resolve("acme", tenant="acme")
    code, _ = c.error(c.register, "acme-chat", "file://v2", owner="acme")
    assert code == grpc.StatusCode.ALREADY_EXISTS
    seen, stop = [], threading.Event()

    def reader():
        local = StoreClient(env["store"].addr)
        while not stop.is_set():
            info = local.resolve("acme", tenant="acme")
            seen.append((info.version, tuple(info.aliases), info.rank))
        local.close()

    thread = threading.Thread(target=reader)
    thread.start()
    try:
        for _ in range(5):
            v2 = c.register("acme-chat", "file://v2", owner="acme", replace=True,
                            aliases=["acme", "acme-task-2"])
            c.register("acme-chat", "file://v1", owner="acme", replace=True,
                       aliases=["acme", "acme-task-1"])
    finally:
        stop.set()
        thread.join()
    assert v2.version != v1.version and v2.rank == 8
    # Every read saw one whole version: its own aliases and rank, never a mix.
    assert set(seen) <= {(v1.version, ("acme", "acme-task-1"), 4),
                         (v2.version, ("acme", "acme-task-2"), 8)}, set(seen)
    v2 = c.register("acme-chat", "file://v2", owner="acme", replace=True,
                    aliases=["acme", "acme-task-2"])
    assert c.error(c.resolve, "acme-task-1", tenant="acme")[0] == NOT_FOUND
    code, details = c.error(c.fetch, "acme-chat", version=v1.version)
    assert code == grpc.StatusCode.FAILED_PRECONDITION and v2.version in details
    header, blob, digest = c.fetch("acme-chat", version=v2.version)
    assert header.adapter.rank == 8 and digest == sha256(blob)
    kept = c.register("acme-chat", "file://v2", owner="acme", replace=True)
    assert list(kept.aliases) == ["acme", "acme-task-2"]  # no aliases given: kept


def test_failed_replace_changes_nothing(env):
    c = env["client"]
    c.register("globex-bot", "file://v1", owner="globex", aliases=["globex"])
    before = c.resolve("acme-chat", tenant="acme")
    code, details = c.error(c.register, "acme-chat", "file://v1", owner="acme", replace=True,
                            aliases=["acme", "globex-bot"])
    assert code == grpc.StatusCode.ALREADY_EXISTS and "globex-bot" in details
    after = c.resolve("acme-chat", tenant="acme")
    assert (after.version, list(after.aliases)) == (before.version, list(before.aliases))
    assert c.resolve("globex", tenant="globex").id == "globex-bot"
    code, _ = c.error(c.register, "acme-chat", "file://broken", owner="acme", replace=True)
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert c.resolve("acme-chat", tenant="acme").version == before.version
    moved = c.register("acme-chat-b", "file://v1", owner="acme", replace=True, aliases=["acme"])
    assert list(moved.aliases) == ["acme"]  # same owner: the alias moves, atomically
    assert c.resolve("acme", tenant="acme").id == "acme-chat-b"
    assert list(c.resolve("acme-chat", tenant="acme").aliases) == ["acme-task-2"]


def test_aliases_are_scoped_by_tenant(env):
    """Each tenant's aliases are its own: the same alias for two tenants and a shared one
    resolve apart, a collision names only the caller's own adapter, and another tenant's
    adapter id does not hide a tenant's alias."""
    c = env["client"]
    c.register("t1-bot", "file://v1", owner="t1", aliases=["bot"])
    c.register("t2-bot", "file://v1", owner="t2", aliases=["bot", "helper"])
    c.register("open-bot", "file://v1", aliases=["bot"])
    assert [c.resolve("bot", tenant=t).id for t in ("t1", "t2", "t3")] == [
        "t1-bot", "t2-bot", "open-bot"]
    code, details = c.error(c.register, "t1-bot-2", "file://v1", owner="t1", aliases=["bot"])
    assert code == grpc.StatusCode.ALREADY_EXISTS and "'t1-bot'" in details
    assert "t2" not in details and "open-bot" not in details
    c.register("helper", "file://v1", owner="t1")       # t1's adapter id, t2's alias
    assert c.resolve("helper", tenant="t2").id == "t2-bot"
    assert c.resolve("helper", tenant="t1").id == "helper"
    assert c.error(c.resolve, "helper", tenant="t3")[0] == NOT_FOUND


def test_register_refuses_an_existing_id_and_a_new_owner(env):
    c = env["client"]
    first = c.register("keep-me", "file://v1", owner="t1")
    code, details = c.error(c.register, "keep-me", "file://v2", owner="t1")
    assert code == grpc.StatusCode.ALREADY_EXISTS and "replace" in details
    code, details = c.error(c.register, "keep-me", "file://v2", owner="t9", replace=True)
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "owner" in details
    after = c.resolve("keep-me", tenant="t1")
    assert (after.version, after.owner) == (first.version, "t1")


def test_a_registry_with_global_aliases_moves_them_to_their_owners(tmp_path):
    """A --db written before aliases were scoped opens with each alias in its adapter's
    owner's scope."""
    import sqlite3
    from services.adapter_store.registry import Registry
    path = tmp_path / "old.sqlite"
    db = sqlite3.connect(path)
    db.executescript("""
        CREATE TABLE adapters (id TEXT PRIMARY KEY, version TEXT NOT NULL, sha256 TEXT NOT NULL,
            owner TEXT NOT NULL, source TEXT NOT NULL, state TEXT NOT NULL, reason TEXT NOT NULL,
            rank INTEGER NOT NULL, alpha REAL NOT NULL, rslora INTEGER NOT NULL,
            targets TEXT NOT NULL, bytes INTEGER NOT NULL, config_json TEXT NOT NULL,
            detail TEXT NOT NULL, created REAL NOT NULL);
        CREATE TABLE aliases (alias TEXT PRIMARY KEY,
            adapter_id TEXT NOT NULL REFERENCES adapters(id) ON DELETE CASCADE);
        CREATE INDEX aliases_by_adapter ON aliases(adapter_id);""")
    detail = '{"layers": [], "tensors": []}'
    for id_, owner in (("a", "acme"), ("s", "")):
        db.execute("INSERT INTO adapters VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
                   (id_, "v", "h", owner, "file://x", "READY", "", 4, 8.0, 0, "[]", 1, "{}",
                    detail, 0.0))
    db.executemany("INSERT INTO aliases VALUES (?, ?)", [("acme-alias", "a"), ("all", "s")])
    db.commit()
    db.close()
    reg = Registry(str(path))
    assert reg.lookup("acme-alias", "acme").id == "a"
    assert reg.lookup("acme-alias", "globex") is None
    assert reg.lookup("all", "globex").id == "s" and reg.get("a").aliases == ("acme-alias",)
    reg.close()


def test_failed_adapter_from_directory(env):
    c = env["client"]
    broken = next(a for a in c.list(all_tenants=True) if a.id == "broken")
    assert broken.state == "FAILED" and "use_dora" in broken.failure_reason
    code, details = c.error(c.resolve, "broken", tenant="anyone")
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "use_dora" in details


def test_delete(env):
    c = env["client"]
    c.register("temp", "file://shared-a", aliases=["temp-alias"])
    c.fetch("temp")
    c.delete("temp")
    assert c.error(c.resolve, "temp")[0] == NOT_FOUND
    assert c.error(c.resolve, "temp-alias")[0] == NOT_FOUND
    assert c.error(c.fetch, "temp")[0] == NOT_FOUND
    assert c.fetch("shared-a")[0].adapter.id == "shared-a"  # same content, still served
    assert c.register("temp-alias", "file://v1").id == "temp-alias"  # the alias is free again
    assert c.error(c.delete, "temp")[0] == NOT_FOUND


def test_restart_with_same_db_loses_nothing(env):
    """Everything comes back as it was; an adapter of the dir validated from a file too fresh
    to trust its identity (sources.SETTLED_S) is REGISTERED again and validates to the same
    version on first use."""
    for a in env["client"].list(all_tenants=True):
        if a.state == "REGISTERED":
            env["client"].resolve(a.id)
    before = sorted((a.id, a.version, a.owner, tuple(a.aliases), a.state, a.failure_reason,
                     a.rank, a.bytes) for a in env["client"].list(all_tenants=True))
    env["client"].close()
    assert env["store"].terminate() == 0
    env["store"] = Service("adapter_store", env["args"], env["tmp"]).wait()
    env["client"] = c = StoreClient(env["store"].addr)
    for a in c.list(all_tenants=True):
        if a.state == "REGISTERED":
            c.resolve(a.id)
    after = sorted((a.id, a.version, a.owner, tuple(a.aliases), a.state, a.failure_reason,
                    a.rank, a.bytes) for a in c.list(all_tenants=True))
    assert after == before
    assert c.resolve("acme", tenant="acme").id == "acme-chat-b"
    header, blob, digest = c.fetch("acme-chat")
    assert header.adapter.rank == 8 and digest == sha256(blob)


def test_kept_versions_are_the_newest_and_those_an_alias_pins(tmp_path):
    """Each READY version is kept for ID@VERSION pins: the newest KEEP_VERSIONS of an id and
    any version an alias is pinned to; a version not kept resolves to nothing."""
    from services.adapter_store.registry import KEEP_VERSIONS, AdapterRecord, Registry
    reg = Registry(str(tmp_path / "r.sqlite"))
    versions = [f"{i:016x}" for i in range(KEEP_VERSIONS + 3)]
    for i, v in enumerate(versions):
        reg.put(AdapterRecord("x", "acme", f"file://v{i}", "READY", version=v, sha256=v,
                              rank=4), replace=i > 0)
        if i == 1:
            reg.set_alias("x-stable", f"x@{v}")
    assert reg.lookup("x", "acme").version == versions[-1]
    assert reg.lookup(f"x@{versions[0]}", "acme") is None                 # pruned
    assert reg.lookup(f"x@{versions[1]}", "acme").source == "file://v1"   # an alias pins it
    kept = [v for v in versions if reg.lookup(f"x@{v}", "acme") is not None]
    assert kept == [versions[1], *versions[-KEEP_VERSIONS:]]
    pinned = reg.lookup("x-stable", "acme")
    assert (pinned.version, pinned.pinned) == (versions[1], True)
    assert reg.lookup(f"x@{versions[-1]}", "globex") is None              # another tenant's
    reg.close()
    again = Registry(str(tmp_path / "r.sqlite"))                          # persisted
    assert again.lookup("x-stable", "acme").version == versions[1]
    again.close()


def test_list_pages_in_id_order_with_filters_and_bound_tokens():
    """Registry.list_page and paging's tokens in-process: id order from the cursor, owner and
    prefix filters, visibility; a token of another listing is INVALID_ARGUMENT."""
    from services.adapter_store import paging
    from services.adapter_store.registry import AdapterRecord, Registry
    from services.common.errors import InvalidArgument
    reg = Registry(":memory:")
    ids = [f"m{i:03d}" for i in range(30)]
    reg.put_many([AdapterRecord(i, "acme" if n % 3 == 0 else "", f"file://{i}", "REGISTERED",
                                rank=4, aliases=(f"{i}-x",) if n == 4 else ())
                  for n, i in enumerate(ids)])
    page = reg.list_page("globex", "", "", "m004", 5)
    assert [r.id for r in page] == ["m005", "m007", "m008", "m010", "m011"]
    assert [r.id for r in reg.list_page(None, "acme", "m01", "", 10)] == [
        "m012", "m015", "m018"]
    assert reg.list_page("acme", "", "m00", "", 10)[4].aliases == ("m004-x",)
    assert reg.list_page("globex", "acme", "", "", 10) == []
    key = paging.query_key("acme", False, "", "")
    token = paging.encode("m004", key)
    assert paging.decode(token, key) == "m004" and paging.decode("", key) == ""
    for bad, other in ((token, paging.query_key("globex", False, "", "")),
                       ("!!", key), (token[:-2], key), ("e30", key)):
        with pytest.raises(InvalidArgument, match="page_token"):
            paging.decode(bad, other)
    assert (paging.page_size(0), paging.page_size(10 ** 6)) == (1000, 1000)
    with pytest.raises(InvalidArgument, match="page_size"):
        paging.page_size(-1)
    reg.close()
