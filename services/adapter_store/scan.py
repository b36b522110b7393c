"""The --adapters-dir scan at start: every DIR/NAME that holds adapter files becomes the shared
adapter NAME, REGISTERED, from what is cheap to read.

Per adapter the scan reads the directory entry, adapter_config.json (capped, checked against the
base by peft_config's policy: a refused config is FAILED at once) and the stat of
adapter_model.safetensors (opened without following a symlink: a regular file inside the dir,
under --max-adapter-bytes; a pickle is never opened). The weights themselves (safetensors
header, shapes, NaN/Inf, digest) are read and validated on the adapter's first use
(AdapterStore.resolve / stage) or before it, in the background once the store is SERVING
(background.py), so start-up costs no read of any blob. Records are written a
batch per transaction, and the log shows progress every PROGRESS_EVERY adapters or
PROGRESS_S seconds.

A directory that is the source of any registered adapter (any version it keeps, any owner,
registered by id or with aliases) is never published as DIR/NAME: its bytes belong to that
registration (issue 41: a tenant's private adapter became shared after a restart). Directories
are compared with symlinks resolved, the scanned folder and the folders its two files resolve
into, so a symlink to a claimed directory or file is not published either. The one exception
is the reverse order: a directory the scan published before the first registration from it
stays published (its bytes were every tenant's already; the store logs a warning when a
private adapter is registered from it). A scan record published after a registration from its
directory (by a store without this check) is removed.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import pathlib
import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial

from services.adapter_store import metrics
from services.adapter_store.registry import (FAILED, READY, REGISTERED, AdapterRecord,
                                             Registry)
from services.adapter_store.sources import (CONFIG, PICKLE, WEIGHTS, SourceReader, identity_of,
                                            parse_source)
from services.adapter_store.validate import (BaseShapes, canonical_json, check_targets,
                                             targets_and_layers)
from services.common.errors import LorafleetError
from services.common.names import NAME

log = logging.getLogger(__name__)
BATCH = 1000                 # records a transaction
PROGRESS_EVERY = 1000        # adapters between progress lines
PROGRESS_S = 5.0             # ... or seconds


def scan_dir(registry: Registry, reader: SourceReader, base: BaseShapes, max_rank: int,
             root: pathlib.Path, threads: int) -> None:
    """Record every adapter directory under root (REGISTERED, or FAILED with the reason); an
    id already registered from elsewhere, or READY from an unchanged file, is left as it
    is."""
    names = _adapter_names(root)
    known = registry.scan_view()
    claimed = _claimed_dirs(registry, reader)
    claims = {n: c for n in names if (c := _claim_of(reader, known, claimed, n)) is not None}
    for name, claim in claims.items():
        _unpublish(registry, known, name, claim)
    names = [n for n in names if n not in claims]
    one = partial(_scan_one, reader, base, max_rank, known)
    start = time.monotonic()
    # one thread: in this thread (a pool's hand-offs cost more than the GIL-bound work)
    pool = ThreadPoolExecutor(threads, thread_name_prefix="store-scan") if threads > 1 else None
    with pool or contextlib.nullcontext():
        _record_all(registry, pool.map(one, names) if pool is not None else map(one, names),
                    len(names), start)
    log.info("adapters dir %s: %d adapters recorded in %.1f s (their weights are read and "
             "validated in the background after start, or on first use)", root, len(names),
             time.monotonic() - start)


def _record_all(registry: Registry, records, count: int, start: float) -> None:
    """The scan's records (None: nothing to record) written BATCH a transaction, with the
    progress lines."""
    batch: list[AdapterRecord] = []
    last = start
    for done, record in enumerate(records, 1):
        if record is not None:
            batch.append(record)
        if len(batch) >= BATCH or done == count:
            _write(registry, batch)
            batch = []
        now = time.monotonic()
        if done % PROGRESS_EVERY == 0 or now - last >= PROGRESS_S or done == count:
            last = now
            log.info("adapters dir: %d of %d scanned (%.1f s)", done, count, now - start)


def _claimed_dirs(registry: Registry, reader: SourceReader
                  ) -> dict[pathlib.Path, list[tuple[str, str, float]]]:
    """Real directory -> (id, owner, created) of each adapter that is at or keeps a version
    from it, the scan's own records (shared NAME from file://NAME) aside."""
    claimed: dict[pathlib.Path, list[tuple[str, str, float]]] = {}
    for adapter_id, owner, source, created in registry.source_claims():
        if owner == "" and source == f"file://{adapter_id}" or not source.startswith("file://"):
            continue
        try:
            folder = reader.real_dir(parse_source(source, None))
        except (LorafleetError, OSError, RuntimeError):     # a malformed or looping source
            continue
        if folder is not None:
            claimed.setdefault(folder, []).append((adapter_id, owner, created))
    return claimed


def _claim_of(reader: SourceReader, known: dict[str, tuple], claimed: dict, name: str
              ) -> tuple[str, str] | None:
    """(id, owner) of a registration DIR/name's bytes belong to, None if none: one from the
    folder or from a folder its files resolve into, unless the scan published DIR/name before
    that registration."""
    if not claimed or reader.root is None:
        return None
    folder = reader.root / name
    try:
        places = {folder.resolve(), *((folder / f).resolve().parent for f in (CONFIG, WEIGHTS))}
    except (OSError, RuntimeError):
        return None
    source, owner, *_, published = known.get(name, ("", "", "", "", (), 0.0))
    ours = (source, owner) == (f"file://{name}", "")
    for place in places:
        for adapter_id, claim_owner, created in claimed.get(place, ()):
            if not (ours and published <= created):
                return adapter_id, claim_owner
    return None


def _unpublish(registry: Registry, known: dict[str, tuple], name: str,
               claim: tuple[str, str]) -> None:
    """Skip DIR/name (the source of the adapter `claim` names), removing a shared record of it
    that a scan published after that registration."""
    source, owner = known.get(name, ("", ""))[:2]
    if (source, owner) == (f"file://{name}", ""):
        registry.delete(name)
        log.warning("adapters dir: %r is the source of adapter %r (owner %r): its shared record "
                    "(published by an earlier scan) is removed", name, claim[0], claim[1])
    else:
        log.info("adapters dir: %r is the source of adapter %r (owner %r): not published",
                 name, claim[0], claim[1])


def _adapter_names(root: pathlib.Path) -> list[str]:
    """The subdirectories' names that are valid adapter ids, sorted."""
    names = []
    with os.scandir(root) as entries:
        for entry in entries:
            if not entry.is_dir():
                continue
            if NAME.fullmatch(entry.name):
                names.append(entry.name)
            else:
                log.warning("skipping %s: not a valid adapter id", entry.name[:200])
    return sorted(names)


def _scan_one(reader: SourceReader, base: BaseShapes, max_rank: int,
              known: dict[str, tuple], name: str) -> AdapterRecord | None:
    """DIR/name's record (FAILED with the reason if its config or files are refused); None
    when the name is registered from elsewhere, is READY from this very file (a --db kept
    from before: same config, same file identity), or the directory holds no adapter files."""
    ref = parse_source(f"file://{name}", None)
    source, owner, state, config_json, identity, _ = known.get(name, (ref.uri, "", "", "", (),
                                                                      0.0))
    if (source, owner) != (ref.uri, ""):
        log.warning("adapters dir: %r is already registered from %s (owner %r); left as is",
                    name, source, owner)
        return None
    folder = reader.root / name if reader.root is not None else None
    if folder is None or not any(os.path.lexists(folder / f) for f in (CONFIG, WEIGHTS, PICKLE)):
        log.info("skipping %s: no adapter files", name)
        return None
    try:
        checked = []
        config, info = reader.peek(ref, lambda raw: checked.append(
            check_targets(raw, base, max_rank)))
        canonical = canonical_json(json.loads(config))
        if state == READY and identity == identity_of(info) and canonical == config_json:
            return None                     # validated before, unchanged since
        fields, pairs = checked[0]
        targets, layers = targets_and_layers(pairs)
        if fields.ignored:
            log.info("%s: adapter_config.json fields unknown to this store, left unset, "
                     "ignored: %s", ref.uri, ", ".join(fields.ignored))
        log.debug("adapters dir: registered %r (r=%d, %s, %d bytes)", name, fields.r,
                  ",".join(targets), info.st_size)
        return AdapterRecord(name, "", ref.uri, REGISTERED, rank=fields.r, alpha=fields.alpha,
                             rslora=fields.rslora, targets=targets, layers=layers,
                             bytes=info.st_size, config_json=canonical)
    except LorafleetError as exc:
        metrics.REFUSALS.labels(getattr(exc, "reason", "source")).inc()
        reason = exc.message
    except OSError as exc:          # e.g. a directory it cannot list: this adapter only
        metrics.REFUSALS.labels("source").inc()
        reason = f"cannot be read: {exc.strerror or type(exc).__name__}"
    log.warning("adapters dir: %r FAILED: %s", name, reason)
    return AdapterRecord(name, "", ref.uri, FAILED, reason=reason)


def _write(registry: Registry, batch: list[AdapterRecord]) -> None:
    for adapter_id, why in registry.put_many(batch):  # e.g. the name is another's alias
        log.warning("adapters dir: %r not recorded: %s", adapter_id, why)
