"""The adapter store's configuration: one frozen dataclass, checked on construction, built once in
main() from flags and environment (`from_args`), then passed down explicitly.
"""
from __future__ import annotations

import argparse
import pathlib
from dataclasses import dataclass
from typing import Mapping

from services.common.config import ServiceFlags, add_flags
from services.common.internal_auth import check_internal_server
from services.common.runtime import parse_bytes
from services.adapter_store.work_pool import MAX_THREADS, default_threads, machine_cpus

GiB = 1 << 30
MiB = 1 << 20
# gRPC messages are capped at 64 MiB (services.common.server.CHANNEL_OPTIONS); a chunk stays well under.
MAX_CHUNK_BYTES = 32 * MiB


@dataclass(frozen=True)
class StoreConfig:
    """Everything the store needs; `base_config` is the served model's config.json."""

    base_config: pathlib.Path
    adapters_dir: pathlib.Path | None = None
    # more directories file:///ABS sources may be under (--allow-source-root, repeatable)
    allow_source_roots: tuple[pathlib.Path, ...] = ()
    # where the bytes of every kept version are kept (None: beside --db, DB.versions; a
    # temporary directory for ':memory:')
    version_dir: pathlib.Path | None = None
    s3_endpoint: str | None = None
    bucket: str | None = None
    s3_region: str = "us-east-1"
    db: str = "state/adapter_store.sqlite"
    max_rank: int = 128
    host_cache_bytes: int = 2 * GiB
    max_adapter_bytes: int = 1 * GiB
    chunk_bytes: int = 4 * MiB
    # threads of the --adapters-dir scan at start
    scan_threads: int = 1
    # threads that read and validate adapters on first use (work_pool.default_threads of the
    # machine's CPUs unless set), and of them one tenant's at most (half of them unless set)
    first_use_threads: int = 8
    first_use_per_tenant: int = 4
    # threads that validate REGISTERED adapters in the background after SERVING (0 = off),
    # and the bytes a second they may read (0 = no cap): background.py
    background_threads: int = 1
    background_bytes_per_s: int = 0
    # The host tier as files here (a tmpfs: /dev/shm), for workers on this host (None: memory).
    shm_dir: pathlib.Path | None = None
    # Per-tenant share of the host tier (None: plain LRU). Shared adapters count as tenant "".
    tenant_share: float | None = 0.5
    # Socket timeouts for S3 when the caller set no deadline (seconds).
    s3_connect_timeout: float = 5.0
    s3_read_timeout: float = 30.0
    # the flags every service takes (services.common.config)
    common: ServiceFlags = ServiceFlags(listen="127.0.0.1:7003", metrics_port=9103)

    def __post_init__(self) -> None:
        _require(self.base_config.is_file(), f"base model config {self.base_config} not found")
        if self.adapters_dir is not None:
            _require(self.adapters_dir.is_dir(), f"--adapters-dir {self.adapters_dir} is not a "
                                                 "directory")
        for root in self.allow_source_roots:
            _require(root.is_dir(), f"--allow-source-root {root} is not a directory")
        keep = self.versions_path()
        _require(keep is None or self.adapters_dir is None
                 or self.adapters_dir.resolve() not in [keep.resolve(), *keep.resolve().parents],
                 f"--version-dir {keep} must not be inside --adapters-dir {self.adapters_dir}")
        _require(1 <= self.max_rank <= 4096, f"--max-rank must be in 1..4096, got {self.max_rank}")
        _require(self.host_cache_bytes > 0, "--host-cache-bytes must be > 0")
        _require(self.max_adapter_bytes > 0, "--max-adapter-bytes must be > 0")
        _require(0 < self.chunk_bytes <= MAX_CHUNK_BYTES,
                 f"--chunk-bytes must be in 1..{MAX_CHUNK_BYTES}, got {self.chunk_bytes}")
        _require(self.tenant_share is None or 0 < self.tenant_share <= 1,
                 "tenant_share must be in (0, 1] or None")
        _require(1 <= self.scan_threads <= 64,
                 f"--scan-threads must be in 1..64, got {self.scan_threads}")
        _require(1 <= self.first_use_threads <= MAX_THREADS, "--first-use-threads must be in "
                 f"1..{MAX_THREADS}, got {self.first_use_threads}")
        _require(1 <= self.first_use_per_tenant <= self.first_use_threads,
                 "--first-use-per-tenant must be in 1..--first-use-threads "
                 f"({self.first_use_threads}), got {self.first_use_per_tenant}")
        _require(0 <= self.background_threads <= 16, "--background-validate-threads must be "
                 f"in 0..16, got {self.background_threads}")
        _require(self.background_bytes_per_s >= 0,
                 "--background-validate-bytes-per-s must be >= 0")
        _require(bool(self.db), "--db must not be empty")
        _require(self.shm_dir is None or self.shm_dir.is_dir(),
                 f"--shm-dir {self.shm_dir} is not a directory")
        _require(self.s3_connect_timeout > 0 and self.s3_read_timeout > 0,
                 "S3 timeouts must be > 0")
        check_internal_server(self.common)

    def versions_path(self) -> pathlib.Path | None:
        """--version-dir, else DB.versions beside --db (None for ':memory:': a temporary
        directory then)."""
        if self.version_dir is not None:
            return self.version_dir
        return None if self.db == ":memory:" else pathlib.Path(self.db).with_suffix(".versions")


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def parser() -> argparse.ArgumentParser:
    """The operator contract's flags (README documents each)."""
    p = argparse.ArgumentParser(prog="python -m services.adapter_store",
                                description="lorafleet adapter store: registry, validation, "
                                            "host-memory tier, Fetch streams")
    add_flags(p, listen="127.0.0.1:7003", metrics_port=9103, grace=10.0)
    p.add_argument("--adapters-dir", default=None,
                   help="record every PEFT adapter DIR/NAME at start as NAME (shared; its "
                        "weights validated in the background after start, or on first use), "
                        "except a directory that is a "
                        "registered adapter's source; file://REL sources resolve under DIR")
    p.add_argument("--allow-source-root", action="append", default=[], metavar="DIR",
                   help="a directory file:///ABS sources may be under, besides --adapters-dir "
                        "(repeatable)")
    p.add_argument("--version-dir", default=None,
                   help="where the store keeps the bytes of every version it keeps, content-"
                        "addressed (default: beside --db, DB.versions; for ':memory:' a "
                        "temporary directory)")
    p.add_argument("--s3-endpoint", default=None,
                   help="S3/MinIO endpoint URL (env LORAFLEET_S3_ENDPOINT; default: AWS)")
    p.add_argument("--bucket", default=None,
                   help="default bucket for s3:///PREFIX sources (env LORAFLEET_S3_BUCKET)")
    p.add_argument("--s3-region", default=None, help="S3 region (env AWS_REGION; us-east-1)")
    p.add_argument("--db", default="state/adapter_store.sqlite",
                   help="SQLite registry file, created if missing; ':memory:' allowed")
    p.add_argument("--model", default="models/tiny-llama",
                   help="served base model dir; its config.json gives the shapes to validate "
                        "(default: the embedded tiny model, as the worker's)")
    p.add_argument("--base-config", default=None, help="base config.json (instead of --model)")
    p.add_argument("--max-rank", type=int, default=128, help="largest LoRA rank accepted (128)")
    p.add_argument("--host-cache-bytes", type=parse_bytes, default=2 * GiB,
                   help="byte budget of the host-memory tier (2 GiB)")
    p.add_argument("--max-adapter-bytes", type=parse_bytes, default=1 * GiB,
                   help="largest adapter_model.safetensors accepted (1 GiB)")
    p.add_argument("--chunk-bytes", type=parse_bytes, default=4 * MiB,
                   help="Fetch data chunk size (4 MiB)")
    p.add_argument("--scan-threads", type=int, default=1,
                   help="threads that scan --adapters-dir at start (configs and file stats): "
                        "1 scans in the caller, as a local disk wants (more threads contend for "
                        "the GIL); more for a network filesystem, whose stats wait (1)")
    p.add_argument("--first-use-threads", type=int, default=0, metavar="N",
                   help="threads that read, validate and hash adapters on first use, in one "
                        "pass each, the bytes landing in the host tier (0 = two a CPU this "
                        "process may use, 4 to 64)")
    p.add_argument("--first-use-per-tenant", type=int, default=0, metavar="N",
                   help="of those threads, the most one tenant's first uses hold at once; "
                        "more wait their turn, other tenants' go ahead (0 = half of them)")
    p.add_argument("--background-validate-threads", type=int, default=1, metavar="N",
                   help="threads that read and validate REGISTERED adapters in the background "
                        "once the store is SERVING, at low priority, as their first use "
                        "would (1; 0 = off: validated on first use only)")
    p.add_argument("--background-validate-bytes-per-s", type=parse_bytes, default=0,
                   metavar="BYTES", help="cap on what that background validation reads a "
                                         "second (0 = no cap)")
    p.add_argument("--shm-dir", default=None,
                   help="keep the host tier as files in this shared-memory directory (a tmpfs, "
                        "e.g. /dev/shm/lorafleet): workers on this host started with "
                        "--store-shm-dir DIR read adapters from it instead of a stream")
    return p


def from_args(args: argparse.Namespace, env: Mapping[str, str]) -> StoreConfig:
    """Build the config from parsed flags; environment fills what flags leave unset."""
    base = (pathlib.Path(args.base_config) if args.base_config
            else pathlib.Path(args.model) / "config.json")
    threads = args.first_use_threads or default_threads(machine_cpus())
    return StoreConfig(
        base_config=base, common=ServiceFlags.from_args(args),
        adapters_dir=pathlib.Path(args.adapters_dir) if args.adapters_dir else None,
        allow_source_roots=tuple(pathlib.Path(d) for d in args.allow_source_root),
        version_dir=pathlib.Path(args.version_dir) if args.version_dir else None,
        s3_endpoint=args.s3_endpoint or env.get("LORAFLEET_S3_ENDPOINT") or None,
        bucket=args.bucket or env.get("LORAFLEET_S3_BUCKET") or None,
        s3_region=args.s3_region or env.get("AWS_REGION") or "us-east-1",
        db=args.db, max_rank=args.max_rank, host_cache_bytes=args.host_cache_bytes,
        max_adapter_bytes=args.max_adapter_bytes, chunk_bytes=args.chunk_bytes,
        scan_threads=args.scan_threads, first_use_threads=threads,
        first_use_per_tenant=args.first_use_per_tenant or max(1, threads // 2),
        background_threads=args.background_validate_threads,
        background_bytes_per_s=args.background_validate_bytes_per_s,
        shm_dir=pathlib.Path(args.shm_dir) if args.shm_dir else None)
