"""The adapter registry in SQLite: adapters (id, version, owner, state, shape summary) and their
aliases. Survives restarts (same --db); a replace swaps version and aliases in one transaction, so
a reader sees either the old adapter with its old aliases or the new one with its new aliases.

One connection, guarded by a lock (the store calls it from its event loop and from start-up).
"""
from __future__ import annotations

import json
import pathlib
import sqlite3
import threading
import time
from dataclasses import dataclass, field, replace as dc_replace

from services.adapter_store.paging import prefix_end
from services.common.safetensors_parse import RawTensor
from services.adapter_store.registry_schema import MIGRATE_ALIASES, SCHEMA
from services.adapter_store.registry_versions import KEEP_VERSIONS, VersionsMixin, detail_of
from services.common.errors import (AlreadyExists, FailedPrecondition, LorafleetError, NotFound,
                                    unknown_adapter)

READY, REGISTERED, FAILED = "READY", "REGISTERED", "FAILED"
__all__ = ["KEEP_VERSIONS", "READY", "REGISTERED", "FAILED", "AdapterRecord", "Registry"]


@dataclass(frozen=True)
class AdapterRecord:
    """One registered adapter. version/sha256 are empty while it is not READY."""

    id: str
    owner: str
    source: str
    state: str
    reason: str = ""
    version: str = ""
    sha256: str = ""
    rank: int = 0
    alpha: float = 0.0
    rslora: bool = False
    targets: tuple[str, ...] = ()
    layers: tuple[int, ...] = ()
    bytes: int = 0
    config_json: str = ""
    tensors: tuple[RawTensor, ...] = ()
    aliases: tuple[str, ...] = ()
    created: float = field(default_factory=time.time)
    # the version was asked for (ID@VERSION, or an alias pinned to it): served even when it
    # is no longer the current one
    pinned: bool = False
    # the blob file's identity (sources.identity_of) as the read that validated it saw it;
    # () when unknown (S3, a file still being written)
    identity: tuple = ()
    # (alias, version) of each alias pinned to a kept version (the others follow the current)
    alias_pins: tuple[tuple[str, str], ...] = ()

    @property
    def shared(self) -> bool:
        return self.owner == ""

    def visible_to(self, tenant: str) -> bool:
        """Shared adapters are everyone's; a private one only its owner's."""
        return self.shared or self.owner == tenant


class Registry(VersionsMixin):
    """SQLite-backed adapters and aliases; every public method is one transaction (kept
    versions: registry_versions.VersionsMixin)."""

    def __init__(self, path: str):
        if path != ":memory:":
            pathlib.Path(path).parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        self._lock = threading.Lock()
        with self._lock:
            if path != ":memory:":
                self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.execute("PRAGMA foreign_keys=ON")
            columns = {r[1] for r in self._db.execute("PRAGMA table_info(aliases)")}
            if columns and "owner" not in columns:
                self._db.executescript("BEGIN;" + MIGRATE_ALIASES + "COMMIT;")
            self._db.executescript(SCHEMA)
            columns = {r[1] for r in self._db.execute("PRAGMA table_info(aliases)")}
            if "version" not in columns:        # aliases pinned to a version: '' = current
                self._db.execute("ALTER TABLE aliases ADD COLUMN version TEXT NOT NULL "
                                 "DEFAULT ''")

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def get(self, adapter_id: str) -> AdapterRecord | None:
        """The adapter with this id, or None."""
        with self._lock:
            row = self._db.execute("SELECT * FROM adapters WHERE id = ?", (adapter_id,)).fetchone()
            return self._record(row) if row else None

    def lookup(self, name: str, tenant: str) -> AdapterRecord | None:
        """The adapter `name` names for `tenant`: the one with that id if the tenant sees it,
        else the one with that alias among the tenant's own, else among the shared ones; None
        if none. (Aliases are scoped by owner: one tenant's never hides or reveals another's,
        and another tenant's adapter id does not hide a tenant's alias.)"""
        name, _, version = name.partition("@")        # ID@VERSION pins a kept version
        with self._lock:
            row = self._db.execute(
                "SELECT a.*, 0 AS o, '' AS pin FROM adapters a WHERE a.id = ? "
                "AND a.owner IN ('', ?) UNION ALL "
                "SELECT a.*, CASE s.owner WHEN '' THEN 2 ELSE 1 END AS o, s.version AS pin "
                "FROM adapters a JOIN aliases s ON s.adapter_id = a.id WHERE s.alias = ? "
                "AND s.owner IN ('', ?) ORDER BY o LIMIT 1",
                (name, tenant, "" if version else name, tenant)).fetchone()
            if row is None:
                return None
            rec, pin = self._record(row[:-2]), version or row[-1]
            return self._at_version(rec, pin) if pin else rec

    def set_alias(self, alias: str, target: str) -> AdapterRecord:
        """Point alias (in its adapter's owner's scope) at TARGET: an id (the alias follows its
        current version) or ID@VERSION (pinned to a kept version: a rollback). NOT_FOUND for an
        unknown adapter or a version not kept; ALREADY_EXISTS when alias is an adapter id."""
        adapter_id, _, version = target.partition("@")
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                rec = self._row(adapter_id)
                if rec is None:
                    raise unknown_adapter(adapter_id)
                if version and self._at_version(rec, version) is None:
                    raise NotFound(f"target: adapter {adapter_id!r} keeps no version "
                                   f"{version!r}")
                if self._db.execute("SELECT 1 FROM adapters WHERE id = ?", (alias,)).fetchone():
                    raise AlreadyExists(f"alias: {alias!r} is already an adapter id")
                self._db.execute("INSERT OR REPLACE INTO aliases VALUES (?, ?, ?, ?)",
                                 (rec.owner, alias, adapter_id, version))
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            out = self._row(adapter_id)
            return self._at_version(out, version) if version else out

    def list_page(self, tenant: str | None, owner: str, prefix: str, after: str, limit: int
                  ) -> list[AdapterRecord]:
        """Up to limit adapters with an id after `after`, in id order: those visible to tenant
        (shared + its own; every one when tenant is None), of `owner` (if set), whose id starts
        with `prefix` (if set). The records carry no tensors or layers (a listing shows
        neither), and their aliases come from one query for the page."""
        where, args = ["id > ?"], [after]
        if tenant is not None:
            where.append("owner IN ('', ?)")
            args.append(tenant)
        if owner:
            where.append("owner = ?")
            args.append(owner)
        if prefix:
            where.append("id >= ? AND id < ?")
            args += [prefix, prefix_end(prefix)]
        with self._lock:
            rows = self._db.execute(
                "SELECT id, version, owner, source, state, reason, rank, alpha, rslora, "
                f"targets, bytes, created FROM adapters WHERE {' AND '.join(where)} "
                "ORDER BY id LIMIT ?", (*args, limit)).fetchall()
            if not rows:
                return []
            aliases: dict[str, list[tuple[str, str]]] = {}
            for adapter_id, alias, pin in self._db.execute(
                    "SELECT adapter_id, alias, version FROM aliases WHERE adapter_id BETWEEN ? "
                    "AND ? ORDER BY alias", (rows[0][0], rows[-1][0])):
                aliases.setdefault(adapter_id, []).append((alias, pin))
        return [AdapterRecord(id=i, owner=o, source=src, state=st, reason=why, version=v,
                              rank=r, alpha=a, rslora=bool(rs), targets=tuple(json.loads(t)),
                              bytes=n, created=c, **_alias_fields(aliases.get(i, ())))
                for i, v, o, src, st, why, r, a, rs, t, n, c in rows]

    def scan_view(self) -> dict[str, tuple[str, str, str, str, tuple, float]]:
        """id -> (source, owner, state, config_json, identity, created) of every adapter: what
        a start-up scan compares a directory with."""
        with self._lock:
            rows = self._db.execute("SELECT id, source, owner, state, config_json, "
                                    "json_extract(detail, '$.identity'), created FROM adapters")
            return {i: (src, o, st, cfg, tuple(json.loads(ident or "[]")), c)
                    for i, src, o, st, cfg, ident, c in rows}

    def ids_in_state(self, state: str) -> list[str]:
        """The ids of the adapters in `state`, in id order."""
        with self._lock:
            return [i for (i,) in self._db.execute(
                "SELECT id FROM adapters WHERE state = ? ORDER BY id", (state,))]

    def counts(self) -> dict[str, int]:
        """Number of adapters per state."""
        with self._lock:
            return dict(self._db.execute("SELECT state, COUNT(*) FROM adapters GROUP BY state"))

    def put(self, rec: AdapterRecord, replace: bool) -> tuple[AdapterRecord, AdapterRecord | None]:
        """Insert rec, or (replace) swap it in with its aliases atomically.

        An existing id is ALREADY_EXISTS unless replace; a replace keeps the owner
        (FAILED_PRECONDITION otherwise: delete the adapter to give the id to another tenant).
        rec.aliases empty on a replace keeps the adapter's current aliases. Aliases live in the
        owner's scope; one held by another adapter of the same owner moves only on a replace.
        Returns (the stored record, the record it replaced or None).
        """
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                out = self._put(rec, replace)
                self._db.execute("COMMIT")
                return out
            except BaseException:
                self._db.execute("ROLLBACK")
                raise

    def put_many(self, records: list[AdapterRecord]) -> list[tuple[str, str]]:
        """put(rec, replace=True) of each record, in one transaction (a start-up scan's batch);
        a record put() would refuse is left out: returns (id, why) for each of those."""
        refused = []
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                for rec in records:
                    try:
                        self._put(rec, replace=True)
                    except LorafleetError as exc:   # raised before anything was written
                        refused.append((rec.id, exc.message))
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
        return refused

    def settle(self, seen: AdapterRecord, rec: AdapterRecord) -> AdapterRecord | None:
        """Replace the REGISTERED record `seen` with rec (validated: READY, or FAILED) unless
        the adapter changed meanwhile (replaced, deleted, another source); its aliases stay.
        Returns the adapter as it now is (None: deleted)."""
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                now = self._row(seen.id)
                if now is not None and (now.state, now.source, now.owner) == (
                        REGISTERED, seen.source, seen.owner):
                    self._write(dc_replace(rec, created=now.created), aliases_given=False)
                    now = self._row(seen.id)
                self._db.execute("COMMIT")
                return now
            except BaseException:
                self._db.execute("ROLLBACK")
                raise

    def _put(self, rec: AdapterRecord, replace: bool
             ) -> tuple[AdapterRecord, AdapterRecord | None]:
        """put() inside its transaction (lock held)."""
        old = self._row(rec.id)
        if old is not None and not replace:
            raise AlreadyExists(f"id: adapter {rec.id!r} already exists (set replace "
                                "to register a new version)")
        if old is not None and old.owner != rec.owner:
            raise FailedPrecondition(
                f"owner: adapter {rec.id!r} has another owner; a new version keeps "
                "its owner (delete the adapter to register the id for another)")
        aliases = rec.aliases if rec.aliases or old is None else old.aliases
        self._check_names(rec, aliases, replace)
        stored = dc_replace(rec, aliases=tuple(aliases),
                            created=old.created if old else rec.created)
        self._write(stored, aliases_given=bool(rec.aliases) or old is None)
        return stored, old

    def delete(self, adapter_id: str) -> AdapterRecord:
        """Remove an adapter and its aliases; NOT_FOUND if there is none."""
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            old = self._row(adapter_id)
            self._db.execute("DELETE FROM adapters WHERE id = ?", (adapter_id,))
            self._db.execute("COMMIT")
        if old is None:
            raise unknown_adapter(adapter_id)
        return old

    # ---- inside a transaction (lock held) ----------------------------------------------------

    def _row(self, adapter_id: str) -> AdapterRecord | None:
        row = self._db.execute("SELECT * FROM adapters WHERE id = ?", (adapter_id,)).fetchone()
        return self._record(row) if row else None

    def _check_names(self, rec: AdapterRecord, aliases: tuple[str, ...], replace: bool) -> None:
        """The id is no alias in the owner's scope or the shared one (it would hide it); each
        alias is no adapter's id and free in the owner's scope (or movable there). Other
        tenants' aliases are neither checked nor named."""
        if self._db.execute("SELECT 1 FROM aliases WHERE alias = ? AND owner IN ('', ?)",
                            (rec.id, rec.owner)).fetchone():
            raise AlreadyExists(f"id: {rec.id!r} is already an alias")
        for alias in aliases:
            if alias == rec.id or self._db.execute(
                    "SELECT 1 FROM adapters WHERE id = ?", (alias,)).fetchone():
                raise AlreadyExists(f"aliases: {alias!r} is already an adapter id")
            row = self._db.execute("SELECT adapter_id FROM aliases WHERE owner = ? AND alias = ?",
                                   (rec.owner, alias)).fetchone()
            if row and row[0] != rec.id and not replace:
                raise AlreadyExists(f"aliases: {alias!r} already names adapter {row[0]!r}")

    def _write(self, rec: AdapterRecord, aliases_given: bool) -> None:
        """The adapter row (updated in place: its kept versions and pinned aliases stay), its
        READY version kept, and (aliases_given) its aliases set to rec.aliases, following the
        current version; otherwise its aliases stay as they were."""
        detail = _detail(rec)
        values = (rec.id, rec.version, rec.sha256, rec.owner, rec.source, rec.state, rec.reason,
                  rec.rank, rec.alpha, int(rec.rslora), json.dumps(list(rec.targets)),
                  rec.bytes, rec.config_json, detail, rec.created)
        self._db.execute(
            "INSERT INTO adapters VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?) ON CONFLICT(id) DO "
            "UPDATE SET version=excluded.version, sha256=excluded.sha256, owner=excluded.owner, "
            "source=excluded.source, state=excluded.state, reason=excluded.reason, "
            "rank=excluded.rank, alpha=excluded.alpha, rslora=excluded.rslora, "
            "targets=excluded.targets, bytes=excluded.bytes, config_json=excluded.config_json, "
            "detail=excluded.detail, created=excluded.created", values)
        if rec.state == "READY":
            self._keep_version(rec, detail)
        if aliases_given:
            # An alias another adapter held moves here (put() checked that it may).
            self._db.execute("DELETE FROM aliases WHERE adapter_id = ? AND version = ''",
                             (rec.id,))
            self._db.executemany(
                "INSERT OR REPLACE INTO aliases (owner, alias, adapter_id) VALUES (?, ?, ?)",
                [(rec.owner, a, rec.id) for a in rec.aliases])

    def _record(self, row: tuple) -> AdapterRecord:
        (id_, version, sha, owner, source, state, reason, rank, alpha, rslora, targets, nbytes,
         config_json, detail, created) = row
        layers, identity, tensors = detail_of(detail)
        aliases = self._db.execute("SELECT alias, version FROM aliases WHERE adapter_id = ? "
                                   "ORDER BY alias", (id_,)).fetchall()
        return AdapterRecord(
            id=id_, owner=owner, source=source, state=state, reason=reason, version=version,
            sha256=sha, rank=rank, alpha=alpha, rslora=bool(rslora),
            targets=tuple(json.loads(targets)), layers=layers, bytes=nbytes,
            config_json=config_json, tensors=tensors, created=created, identity=identity,
            **_alias_fields(aliases))


def _detail(rec: AdapterRecord) -> str:
    return json.dumps({"layers": list(rec.layers), "identity": list(rec.identity),
                       "tensors": [[t.name, t.dtype, list(t.shape), t.offset, t.nbytes]
                                   for t in rec.tensors]})


def _alias_fields(rows) -> dict:
    """aliases and alias_pins of a record from its (alias, version) rows."""
    return {"aliases": tuple(a for a, _ in rows),
            "alias_pins": tuple((a, v) for a, v in rows if v)}
