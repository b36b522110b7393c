"""Issue 41: a version is the bytes that were registered, not a pointer to a mutable source. The
store keeps its own content-addressed copy of every version it keeps (--version-dir, beside the
--db by default), so overwriting a source in place and registering it again never takes the old
version away, across restarts too; the copies are bounded by the versions the registry keeps and
removed when a version is dropped. `lorafleet versions ID` lists them through the router, and
`adapters --json` shows which alias pins which version. Real store and router processes.
"""
from __future__ import annotations

import json
import shutil

import grpc
import pytest

from services.adapter_store.registry import KEEP_VERSIONS
from services.common.gen.lorafleet.v1 import adapter_store_pb2 as pb, router_pb2
from tests.store_stack import StoreRouter, cli, rpc_error
from tests.test_store_support import StoreClient, good_adapter, sha256

WEIGHTS = "adapter_model.safetensors"


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("store-versions")
    (tmp / "adapters").mkdir()
    s = StoreRouter(tmp, tmp / "adapters")
    s.keep = tmp / "state" / "registry.versions"         # the default: beside the --db
    yield s
    s.close()


def fetch_pinned(addr: str, adapter_id: str, version: str) -> tuple[str, bytes]:
    """(version, blob) of a Fetch that pins a kept version, its digest checked."""
    with grpc.insecure_channel(addr) as ch:
        from services.common.gen.lorafleet.v1 import adapter_store_pb2_grpc
        chunks = list(adapter_store_pb2_grpc.AdapterStoreStub(ch).Fetch(
            pb.FetchRequest(id=adapter_id, version=version, pinned=True), timeout=10))
    blob = b"".join(c.data for c in chunks[1:-1])
    assert chunks[-1].sha256 == sha256(blob)
    return chunks[0].header.adapter.version, blob


def test_a_source_overwritten_in_place_keeps_the_old_version(stack, capsys):
    """register x from DIR/d, pin an alias to it, overwrite d's files in place, `register
    --replace`: after a restart (host tier empty) the pinned old version still serves its own
    bytes (it was DATA_LOSS), the alias still resolves to it, and the new one serves too."""
    folder = good_adapter(stack.tmp / "adapters" / "d", seed=1)
    old_blob = (folder / WEIGHTS).read_bytes()
    with stack.client("tok-ops") as ops:
        v1 = ops.register("x", "file://d", tenant="alice").version
        assert ops.set_alias("x-stable", f"x@{v1}").pinned
        good_adapter(folder, seed=2)                              # the same files, rewritten
        v2 = ops.register("x", "file://d", tenant="alice", replace=True).version
    assert v2 != v1 and (stack.keep / v1 / WEIGHTS).read_bytes() == old_blob
    stack.restart_store()
    assert fetch_pinned(stack.store.addr, "x", v1) == (v1, old_blob)
    assert fetch_pinned(stack.store.addr, "x", v2)[1] == (folder / WEIGHTS).read_bytes()
    c = StoreClient(stack.store.addr)
    try:
        pinned = c.resolve("x-stable", tenant="alice")
        assert (pinned.version, pinned.pinned) == (v1, True)
    finally:
        c.close()
    rc, out, err = cli(capsys, stack, "tok-alice", "versions", "x", "--json")
    listed = json.loads(out)
    assert rc == 0 and listed["id"] == "x" and listed["owner"] == "alice", err
    assert [(v["version"], v["current"], v["pinned_aliases"], v["kept"])
            for v in listed["versions"]] == [(v2, True, [], True), (v1, False, ["x-stable"], True)]
    rc, out, _ = cli(capsys, stack, "tok-alice", "versions", "x")
    assert rc == 0 and f"{v1}" in out and "pinned by x-stable" in out and "current" in out
    rc, out, _ = cli(capsys, stack, "tok-alice", "adapters", "--json")
    x = next(a for a in json.loads(out)["adapters"] if a["id"] == "x")
    assert x["version"] == v2 and x["pinned_aliases"] == {"x-stable": v1}


def test_versions_show_only_what_the_caller_may_see(stack):
    """Another tenant's adapter is NOT_FOUND with the unknown-id answer; a malformed id is
    INVALID_ARGUMENT naming adapter_id; an admin sees any tenant's."""
    good_adapter(stack.tmp / "adapters" / "e", seed=3)
    with stack.client("tok-ops") as ops:
        ops.register("alice-only", "file://e", tenant="alice")
        assert ops.versions("alice-only").owner == "alice"
    with stack.client("tok-bob") as bob:
        unknown = rpc_error(bob.versions, "no-such")
        other = rpc_error(bob.versions, "alice-only")
        assert other.code() == unknown.code() == grpc.StatusCode.NOT_FOUND
        assert other.details() == unknown.details().replace("no-such", "alice-only")
        bad = rpc_error(bob.versions, "../x")
        assert bad.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert bad.details().startswith("adapter_id:")
    with stack.client("tok-alice") as alice:
        got = alice.versions("alice-only")
        assert isinstance(got, router_pb2.ListAdapterVersionsResponse)
        assert [v.current for v in got.versions] == [True]


def test_kept_copies_are_bounded_and_collected(stack):
    """KEEP_VERSIONS + 3 versions of one id: the store holds a copy of exactly the versions the
    registry keeps (the newest ones and the one an alias pins), shares a copy between ids with
    the same bytes, removes a version's copy when it is dropped (pruned, the adapter deleted),
    and at start removes copies no record names."""
    folder = stack.tmp / "adapters" / "many"
    versions = []
    with stack.client("tok-ops") as ops:
        for i in range(KEEP_VERSIONS + 3):
            good_adapter(folder, seed=100 + i)
            versions.append(ops.register("many", "file://many", replace=i > 0).version)
            if i == 0:
                ops.set_alias("many-first", f"many@{versions[0]}")
        shutil.copytree(folder, stack.tmp / "adapters" / "twin")
        assert ops.register("twin", "file://twin").version == versions[-1]
        listed = [v.version for v in ops.versions("many").versions]
        assert sorted(listed) == sorted([versions[0], *versions[-KEEP_VERSIONS:]])
        on_disk = {p.name for p in stack.keep.iterdir()}
        assert set(listed) <= on_disk and not set(versions[1:3]) & on_disk
        ops.delete("many")
        on_disk = {p.name for p in stack.keep.iterdir()}
        assert versions[-1] in on_disk                           # twin keeps it
        assert not set(versions[:-1]) & on_disk
    stray = stack.keep / ("0" * 16)
    shutil.copytree(stack.keep / versions[-1], stray)
    stack.restart_store()
    assert not stray.exists() and (stack.keep / versions[-1]).is_dir()


def test_the_source_first_then_the_copy_and_a_damaged_copy_is_data_loss(stack):
    """Staging reads the source first; the store's copy serves when the source no longer holds
    the version (deleted); a copy that no longer matches, with the source changed too, is
    DATA_LOSS and the copy is dropped."""
    folder = good_adapter(stack.tmp / "adapters" / "f", seed=7)
    blob = (folder / WEIGHTS).read_bytes()
    with stack.client("tok-ops") as ops:        # an id of its own: "f" from file://f would be
        v = ops.register("f-kept", "file://f").version     # the scan's record (no copy)
    stack.restart_store()                                          # nothing in the host tier
    damaged = bytearray(blob)
    damaged[-1] ^= 1
    (stack.keep / v / WEIGHTS).write_bytes(bytes(damaged))
    assert fetch_pinned(stack.store.addr, "f-kept", v) == (v, blob)     # the source's
    (stack.keep / v / WEIGHTS).write_bytes(blob)
    (folder / WEIGHTS).unlink()                                     # the source is gone
    stack.restart_store()
    assert fetch_pinned(stack.store.addr, "f-kept", v) == (v, blob)     # the copy's
    stack.restart_store()
    (stack.keep / v / WEIGHTS).write_bytes(bytes(damaged))
    (folder / WEIGHTS).write_bytes(bytes(damaged))
    err = rpc_error(fetch_pinned, stack.store.addr, "f-kept", v)
    assert err.code() == grpc.StatusCode.DATA_LOSS and "re-register" in err.details()
    assert not (stack.keep / v).exists()                            # the damaged copy dropped


def test_a_memory_registry_keeps_its_copies_in_a_temporary_directory_it_removes(tmp_path):
    """With --db :memory: the copies live in a temporary directory (under TMPDIR) that the store
    removes at exit; one a SIGKILLed store left behind is removed by the next store's start."""
    from tests.support import Service
    from tests.test_store_support import write_base
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    good_adapter(tmp_path / "adapters" / "g", seed=9)
    args = ["--base-config", str(write_base(tmp_path / "base")), "--adapters-dir",
            str(tmp_path / "adapters"), "--db", ":memory:"]
    killed = Service("adapter_store", args, tmp_path, env={"TMPDIR": str(tmp)}).wait()
    c = StoreClient(killed.addr)
    version = c.register("g2", "file://g").version
    c.close()
    left = list(tmp.glob("lorafleet-store-versions-*"))
    assert len(left) == 1 and (left[0] / version / WEIGHTS).is_file()
    killed.kill()
    store = Service("adapter_store", args, tmp_path, env={"TMPDIR": str(tmp)}).wait()
    assert not left[0].exists() and len(list(tmp.glob("lorafleet-store-versions-*"))) == 1
    assert store.terminate() == 0
    assert list(tmp.glob("lorafleet-store-versions-*")) == []


def test_a_scanned_adapter_is_served_from_its_directory_without_a_copy(stack):
    """An --adapters-dir adapter's first use validates and serves it but keeps no copy: the
    directory is the adapter, and copying every scanned adapter would double the disk."""
    good_adapter(stack.tmp / "adapters" / "scanned", seed=7)
    stack.restart_store()                                  # the scan records it at start
    before = {p.name for p in stack.keep.iterdir()}
    c = StoreClient(stack.store.addr)
    try:
        record = c.resolve("scanned")                      # its first use: validated now
        header, blob, digest = c.fetch("scanned")
        assert record.version and header.adapter.version == record.version
        assert blob == (stack.tmp / "adapters" / "scanned" / WEIGHTS).read_bytes()
        assert digest == sha256(blob)
    finally:
        c.close()
    assert {p.name for p in stack.keep.iterdir()} == before
