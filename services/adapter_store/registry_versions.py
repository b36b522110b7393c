"""The registry's kept versions (a mixin of registry.Registry, on its connection and lock).

Each READY version an adapter reaches is kept for ID@VERSION pins and alias rollbacks: the newest
KEEP_VERSIONS of an id, and any version an alias is pinned to. What keeps a version's bytes is
keep.py; what a version is kept for is here.
"""
from __future__ import annotations

import functools
import json
import time
from dataclasses import dataclass, replace as dc_replace

from services.common.safetensors_parse import RawTensor

KEEP_VERSIONS = 8          # READY versions kept per id for id@version pins and alias rollbacks


@dataclass(frozen=True)
class KeptVersion:
    """One kept version of an adapter, as `lorafleet versions` lists it."""

    version: str
    sha256: str
    source: str
    rank: int
    bytes: int
    created: float
    current: bool
    pinned_aliases: tuple[str, ...]


class VersionsMixin:
    """Needs self._db (sqlite3), self._lock and self._row(id) (Registry's)."""

    def get_version(self, adapter_id: str, version: str):
        """The adapter at a kept version (pinned), or None."""
        with self._lock:
            rec = self._row(adapter_id)
            return self._at_version(rec, version) if rec is not None else None

    def version_in_use(self, version: str) -> bool:
        """Whether any adapter is at this version (content shared by several ids)."""
        with self._lock:
            return self._db.execute("SELECT 1 FROM adapters WHERE version = ? LIMIT 1",
                                    (version,)).fetchone() is not None

    def version_kept(self, version: str) -> bool:
        """Whether any adapter is at this version or keeps it."""
        with self._lock:
            return self._db.execute(
                "SELECT 1 FROM adapters WHERE version = ? UNION ALL SELECT 1 FROM versions "
                "WHERE version = ? LIMIT 1", (version, version)).fetchone() is not None

    def kept_versions(self) -> set[str]:
        """Every version an adapter is at or keeps."""
        with self._lock:
            return {v for (v,) in self._db.execute(
                "SELECT version FROM adapters WHERE version != '' UNION "
                "SELECT version FROM versions")}

    def versions_of(self, adapter_id: str) -> set[str]:
        """The versions this adapter is at or keeps."""
        with self._lock:
            return {v for (v,) in self._db.execute(
                "SELECT version FROM adapters WHERE id = ? AND version != '' UNION "
                "SELECT version FROM versions WHERE id = ?", (adapter_id, adapter_id))}

    def list_versions(self, adapter_id: str) -> list[KeptVersion]:
        """The adapter's kept versions, newest first (its current one first when READY)."""
        with self._lock:
            current = self._db.execute("SELECT version FROM adapters WHERE id = ?",
                                       (adapter_id,)).fetchone()
            pins: dict[str, list[str]] = {}
            for alias, version in self._db.execute(
                    "SELECT alias, version FROM aliases WHERE adapter_id = ? AND version != '' "
                    "ORDER BY alias", (adapter_id,)):
                pins.setdefault(version, []).append(alias)
            rows = self._db.execute(
                "SELECT version, sha256, source, rank, bytes, created FROM versions "
                "WHERE id = ? ORDER BY created DESC, version", (adapter_id,)).fetchall()
        now = current[0] if current else ""
        out = [KeptVersion(v, sha, src, r, n, c, v == now, tuple(pins.get(v, ())))
               for v, sha, src, r, n, c in rows]
        return sorted(out, key=lambda k: not k.current)        # stable: newest first

    def source_claims(self) -> list[tuple[str, str, str, float]]:
        """(id, owner, source, created) for every source an adapter is at or keeps a version
        of: what a start-up scan must not publish (scan.py). created is the adapter's first
        registration, never later than the time it took that source."""
        with self._lock:
            return self._db.execute(
                "SELECT id, owner, source, created FROM adapters UNION "
                "SELECT v.id, v.owner, v.source, a.created FROM versions v "
                "JOIN adapters a ON a.id = v.id").fetchall()

    # ---- inside a transaction (lock held) ----------------------------------------------------

    def _keep_version(self, rec, detail: str) -> None:
        """Keep this version for pins (the newest KEEP_VERSIONS of an id, and any an alias is
        pinned to)."""
        self._db.execute(
            "INSERT OR REPLACE INTO versions VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?)",
            (rec.id, rec.version, rec.sha256, rec.owner, rec.source, rec.rank, rec.alpha,
             int(rec.rslora), json.dumps(list(rec.targets)), rec.bytes, rec.config_json, detail,
             time.time()))
        self._db.execute(
            "DELETE FROM versions WHERE id = ? AND version NOT IN (SELECT version FROM versions "
            "WHERE id = ? ORDER BY created DESC LIMIT ?) AND version NOT IN (SELECT version FROM "
            "aliases WHERE adapter_id = ?)", (rec.id, rec.id, KEEP_VERSIONS, rec.id))

    def _at_version(self, rec, version: str):
        """rec as it was at a kept version (marked pinned); None when it is not kept."""
        if version == rec.version:
            return dc_replace(rec, pinned=True)
        row = self._db.execute("SELECT * FROM versions WHERE id = ? AND version = ?",
                               (rec.id, version)).fetchone()
        if row is None:
            return None
        (_, version, sha, _, source, rank, alpha, rslora, targets, nbytes, config_json, detail,
         _) = row
        layers, _, tensors = detail_of(detail)
        return dc_replace(rec, version=version, sha256=sha, source=source, state="READY",
                          reason="", rank=rank, alpha=alpha, rslora=bool(rslora),
                          targets=tuple(json.loads(targets)), layers=layers,
                          bytes=nbytes, config_json=config_json, tensors=tensors,
                          pinned=True)


@functools.lru_cache(maxsize=512)
def detail_of(detail: str) -> tuple[tuple, tuple, tuple[RawTensor, ...]]:
    """A record's detail column as (layers, file identity, tensors), parsed once per text: a
    READY adapter's record is read on every Resolve and Fetch, and a 7B one's detail holds 256
    tensor entries (~0.5 ms of Python to parse and build)."""
    d = json.loads(detail)
    return (tuple(d["layers"]), tuple(d.get("identity", ())),
            tuple(RawTensor(n, t, tuple(s), o, b) for n, t, s, o, b in d["tensors"]))
