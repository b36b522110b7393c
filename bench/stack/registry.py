"""The registry at scale: the adapter store's start with N adapters, its memory, and listing them
all through the router, a page at a time.

Fleet: one real PEFT adapter of the tiny model (models/adapters/pirate) hard-linked into N
directories a00000.. of a fresh --adapters-dir. Measured, on loopback processes:

- store start: process start to grpc.health SERVING (the scan: configs and file stats, no blob
  read), and its RSS then (VmRSS);
- the first use of one adapter (Resolve: read, validate and hash it), and its RSS after;
- the background validation (--background-validate-threads, on by default: it starts after
  SERVING, while the rest runs): seconds to read, validate and hash every adapter, from its
  log's last line;
- with a worker and the router: every page of ListAdapters through the router (page size 0 =
  the default, and 250), wall time and pages;
- with --old-tree DIR (a checkout of an older commit, its stubs generated): that store's start
  on the same directory (it validated and hashed every adapter at start);
- with --s3 (moto installed): a store whose --db holds --s3-count adapters registered from S3
  (moto's server on loopback; one registered through the API, the rest copies of its row):
  start to SERVING, RSS, and every page through the router.

    python -m bench.stack.registry --adapters 10000 --out bench/results
    python -m bench.stack.registry --adapters 10000 --old-tree /tmp/old --s3 --s3-count 100000

Writes OUT/registry-cpu.json ({"header", "rows"}) and OUT/registry-cpu.md.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import sqlite3
import sys
import tempfile
import time

from bench.lib.header import RESULTS, ROOT, base_header

SEED = ROOT / "models" / "adapters" / "pirate"
MODEL = ROOT / "models" / "tiny-llama"
FILES = ("adapter_config.json", "adapter_model.safetensors")


def adapter_id(i: int) -> str:
    return f"a{i:05d}"


def make_fleet(root: pathlib.Path, n: int, seed: pathlib.Path = SEED,
               nan: tuple[int, ...] = ()) -> pathlib.Path:
    """root/adapters/a00000.. : n adapters, each a hard link of seed's two files (one copy
    under root, so the links stay on one filesystem); those in `nan` get their own weights
    with one NaN (valid config and header: only the full validation finds it)."""
    import numpy as np
    from safetensors.numpy import load_file, save_file
    src, adapters = root / "seed", root / "adapters"
    src.mkdir(parents=True, exist_ok=True)
    for f in FILES:
        shutil.copyfile(seed / f, src / f)
    for i in range(n):
        d = adapters / adapter_id(i)
        d.mkdir(parents=True)
        for f in FILES:
            os.link(src / f, d / f)
    for i in nan:
        d = adapters / adapter_id(i)
        tensors = load_file(str(src / FILES[1]))
        name = sorted(tensors)[0]
        tensors[name] = tensors[name].copy()
        tensors[name].flat[0] = np.nan
        os.unlink(d / FILES[1])
        save_file(tensors, str(d / FILES[1]))
    return adapters


def rss_mib(pid: int) -> float:
    for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def start_store(service_cls, args: list[str], log_dir: pathlib.Path, cwd=None, env=None):
    """(service, seconds from process start to SERVING)."""
    started = time.monotonic()
    svc = service_cls("adapter_store", args, log_dir, env=env, cwd=cwd)
    svc.wait(timeout=1800)
    return svc, time.monotonic() - started


def list_all(addr: str, token: str, page_size: int) -> dict:
    """Every page of ListAdapters through the router: count, pages, seconds, ordered, unique."""
    from services.client.client import LorafleetClient
    with LorafleetClient(addr, token, 120.0) as c:
        started, ids, pages, token_ = time.monotonic(), [], 0, ""
        while True:
            page = c.adapters_page(page_size, token_)
            ids += [a.id for a in page.adapters]
            pages += 1
            token_ = page.next_page_token
            if not token_:
                break
        seconds = time.monotonic() - started
    return {"page_size": page_size, "adapters": len(ids), "pages": pages, "seconds": seconds,
            "ordered_unique": ids == sorted(set(ids))}


def resolve_once(addr: str, name: str) -> float:
    """Seconds of one store Resolve (a REGISTERED adapter's first use: read, validate, hash)."""
    import grpc
    from services.common.gen.lorafleet.v1 import adapter_store_pb2 as spb, adapter_store_pb2_grpc
    with grpc.insecure_channel(addr) as ch:
        started = time.monotonic()
        info = adapter_store_pb2_grpc.AdapterStoreStub(ch).Resolve(
            spb.ResolveRequest(name=name), timeout=60).adapter
        assert info.state == "READY", info
        return time.monotonic() - started


def background_done(store, timeout: float) -> dict:
    """The store's background validation once finished: its seconds and outcomes (its log's
    last line), or {"timed_out": timeout}."""
    import re
    pattern = re.compile(r"background validation finished: (\d+) of (\d+) in ([\d.]+) s: "
                         r"(\d+) READY, (\d+) FAILED")
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        found = pattern.search(store.log())
        if found:
            done, total, seconds, ready, failed = found.groups()
            return {"adapters": int(total), "seconds": float(seconds), "ready": int(ready),
                    "failed": int(failed)}
        time.sleep(0.5)
    return {"timed_out": timeout}


def bench_dir(a, work: pathlib.Path) -> list[dict]:
    """The new store on an N-adapter dir, then the stack listing through the router."""
    from tests.support import Service
    adapters = make_fleet(work / "fleet", a.adapters)
    store_args = ["--adapters-dir", str(adapters), "--model", str(MODEL), "--db", ":memory:"]
    store, start_s = start_store(ServiceIn, store_args, work)
    row = {"case": f"dir-{a.adapters}", "adapters": a.adapters, "store_start_s": start_s,
           "store_rss_mib": rss_mib(store.proc.pid)}
    row["first_use_s"] = resolve_once(store.addr, adapter_id(a.adapters // 2))
    row["store_rss_after_first_use_mib"] = rss_mib(store.proc.pid)
    worker = Service("worker", ["--model", str(MODEL), "--store", store.addr, "--device", "cpu"],
                     work).wait()
    router = Service("router", ["--store", store.addr, "--worker", worker.addr], work).wait()
    try:
        row["list"] = [list_all(router.addr, "bench", size) for size in (0, 250)]
        row["background"] = background_done(store, a.background_timeout)
    finally:
        for svc in (router, worker, store):
            svc.terminate()
    rows = [row]
    if a.old_tree:
        old, old_s = start_store(ServiceIn, store_args, work, cwd=a.old_tree)
        rows.append({"case": f"dir-{a.adapters}-old", "tree": str(a.old_tree),
                     "adapters": a.adapters, "store_start_s": old_s,
                     "store_rss_mib": rss_mib(old.proc.pid)})
        old.terminate()
    return rows


class ServiceIn:
    """tests.support.Service, started from another source tree when cwd is given."""

    def __new__(cls, name, args, log_dir, env=None, cwd=None):
        from tests import support
        if cwd is None:
            return support.Service(name, args, log_dir, env=env)
        saved = support.ROOT
        support.ROOT = pathlib.Path(cwd)        # Service runs `python -m` from ROOT
        try:
            return support.Service(name, args, log_dir, env=env)
        finally:
            support.ROOT = saved


def bench_s3(a, work: pathlib.Path) -> list[dict]:
    """A store whose --db holds s3_count adapters registered from S3 (moto's server)."""
    from tests.support import S3_ENV, MotoS3, Service
    from tests.test_store_support import StoreClient
    moto = MotoS3(work)
    try:
        s3 = moto.client()
        s3.create_bucket(Bucket="fleet")
        for f in FILES:
            s3.upload_file(str(SEED / f), "fleet", f"seed/{f}")
        db = work / "s3-registry.sqlite"
        store_args = ["--model", str(MODEL), "--db", str(db), "--s3-endpoint", moto.endpoint]
        store = Service("adapter_store", store_args, work, env=S3_ENV).wait()
        client = StoreClient(store.addr)
        client.register("s00000", "s3://fleet/seed")
        client.close()
        store.terminate()
        _copy_rows(db, "s00000", a.s3_count)
        store, start_s = start_store(ServiceIn, store_args, work, env=S3_ENV)
        row = {"case": f"s3-{a.s3_count}", "adapters": a.s3_count, "store_start_s": start_s,
               "store_rss_mib": rss_mib(store.proc.pid)}
        worker = Service("worker", ["--model", str(MODEL), "--store", store.addr,
                                    "--device", "cpu"], work, env=S3_ENV).wait()
        router = Service("router", ["--store", store.addr, "--worker", worker.addr],
                         work).wait()
        try:
            row["list"] = [list_all(router.addr, "bench", 0)]
        finally:
            for svc in (router, worker, store):
                svc.terminate()
        return [row]
    finally:
        moto.stop()


def _copy_rows(db: pathlib.Path, seed_id: str, n: int) -> None:
    """n - 1 copies of seed_id's adapter row (ids s00001..), as n registrations would leave."""
    con = sqlite3.connect(db)
    cols = [r[1] for r in con.execute("PRAGMA table_info(adapters)")]
    select = ", ".join("printf('s%05d', n.i)" if c == "id" else c for c in cols)
    with con:
        con.execute(f"WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE "
                    f"i < {n - 1}) INSERT INTO adapters SELECT {select} FROM adapters, n "
                    "WHERE id = ?", (seed_id,))
    con.close()


def header() -> dict:
    h = base_header("cpu")
    return {**h, "cpu": h["card"], "load_avg_1m": os.getloadavg()[0],
            "python": h["versions"]["python"], "grpcio": h["versions"].get("grpcio", "?"),
            "sqlite": sqlite3.sqlite_version, "model": "tiny-llama",
            "adapter": f"{SEED.name} ({(SEED / FILES[1]).stat().st_size} bytes)"}


def markdown(doc: dict) -> str:
    h = doc["header"]
    lines = [f"# Registry at scale, {h['date']}", "",
             f"{h['cpu']}, {h['cpus']} cpus (load {h['load_avg_1m']:.2f}), python "
             f"{h['python']}, grpcio {h['grpcio']}, commit {h['commit']}; adapters: "
             f"{h['adapter']} hard-linked, tiny model.", "",
             f"`{h.get('command', 'python -m bench.stack.registry')}`", "",
             "| case | adapters | store start to SERVING (s) | RSS (MiB) | first use (s) | "
             "list all via router: page size, pages, s | background validation of all (s) |",
             "|---|---|---|---|---|---|---|"]
    for r in doc["rows"]:
        listing = "; ".join(f"{x['page_size'] or 'default'}: {x['pages']} pages, "
                            f"{x['seconds']:.2f} s" for x in r.get("list", []))
        first = f"{r['first_use_s']:.3f}" if "first_use_s" in r else "-"
        bg = r.get("background", {})
        bg = (f"{bg['seconds']:.1f} ({bg['ready']:,} READY, {bg['failed']} FAILED)"
              if "seconds" in bg else "-")
        lines.append(f"| {r['case']} | {r['adapters']:,} | {r['store_start_s']:.2f} | "
                     f"{r['store_rss_mib']:.0f} | {first} | {listing or '-'} | {bg} |")
    lines += ["", "Start is measured from the process's start to grpc.health SERVING; RSS is "
              "VmRSS at SERVING. `-old` rows: the store of an older commit"
              f" ({h.get('old_tree', '-')}; it read, validated and hashed every adapter at "
              "start) on the same directory. First use: one Resolve of a scanned adapter "
              "(read, validated, hashed). Background validation: the store's own, from 0.5 s "
              "after SERVING (one niced thread), while the first use and the listings ran; "
              "seconds from its start to its last adapter.", ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--adapters", type=int, default=10000)
    p.add_argument("--old-tree", type=pathlib.Path, default=None,
                   help="a source tree of an older commit (stubs generated) to compare")
    p.add_argument("--old-tree-label", default="",
                   help="what --old-tree is, for the header (e.g. its commit)")
    p.add_argument("--background-timeout", type=float, default=1800.0,
                   help="how long to wait for the store's background validation of the "
                        "directory to finish (s)")
    p.add_argument("--s3", action="store_true", help="also the S3 case (needs moto)")
    p.add_argument("--s3-count", type=int, default=100000)
    p.add_argument("--out", type=pathlib.Path, default=RESULTS)
    a = p.parse_args(argv)
    head = header()                     # the commit and the load before the runs
    head["command"] = " ".join(["python -m bench.stack.registry", *(argv or sys.argv[1:])])
    if a.old_tree:
        head["old_tree"] = a.old_tree_label or str(a.old_tree)
    work = pathlib.Path(tempfile.mkdtemp(prefix="registry-bench-"))
    try:
        rows = bench_dir(a, work)
        if a.s3:
            try:
                import moto  # noqa: F401
            except ImportError:
                print("moto is not installed: the S3 case is skipped", file=sys.stderr)
            else:
                rows += bench_s3(a, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    doc = {"header": head, "rows": rows}
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "registry-cpu.json").write_text(json.dumps(doc, indent=1) + "\n")
    (a.out / "registry-cpu.md").write_text(markdown(doc))
    print(markdown(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
