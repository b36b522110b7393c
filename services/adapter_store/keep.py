"""The store's own copy of every version it keeps (issue 41: a version is not a pointer to a
mutable source).

Content-addressed: the validated bytes of version V (V = a hash of the canonical config and the
blob, validate.content_version) live in DIR/V/ as a PEFT directory (adapter_config.json as the
registry holds it, adapter_model.safetensors), written once, atomically (a temporary directory
renamed into place), and read back through a SourceReader rooted at DIR, so a read is checked
against the registration exactly as a source read is (config and SHA-256; DATA_LOSS otherwise).
Ids and tenants that register the same bytes share one copy.

Bounded by the registry: a version's copy is removed once no adapter keeps that version (the
newest registry.KEEP_VERSIONS of each id plus those an alias pins), when a replace prunes it,
an adapter is deleted, or at start for copies no record names.
"""
from __future__ import annotations

import logging
import os
import pathlib
import re
import shutil
import tempfile

from services.common.owned_dirs import alive as pid_alive
from services.adapter_store.sources import (CONFIG, WEIGHTS, SourceReader, SourceRef,
                                            identity_of)

log = logging.getLogger(__name__)
_VERSION = re.compile(r"[0-9a-f]{16,64}")
_TMP = ".tmp-"
_TEMP = "lorafleet-store-versions-"     # + pid: a ':memory:' store's temporary directory


def wants_copy(record) -> bool:
    """Whether the store keeps its own copy of a record's version: not for an --adapters-dir
    adapter (shared NAME from file://NAME), whose directory is the adapter (changed files are
    recorded as a new version at the next start) and whose copies would double the disk a
    large directory takes, nor its first use's latency."""
    return not (record.owner == "" and record.source == f"file://{record.id}")


class VersionKeep:
    """DIR/VERSION/ copies of kept versions (blocking file I/O: call from threads)."""

    def __init__(self, root: pathlib.Path | None, max_bytes: int):
        """root None: a temporary directory, removed by close() (a ':memory:' registry)."""
        self._temporary = root is None
        if root is None:
            _clear_stale(pathlib.Path(tempfile.gettempdir()))
            root = pathlib.Path(tempfile.mkdtemp(prefix=f"{_TEMP}{os.getpid()}-"))
        root.mkdir(parents=True, exist_ok=True)
        self.root = root.resolve()
        self.reader = SourceReader(self.root, None, max_bytes)

    def close(self) -> None:
        if self._temporary:
            shutil.rmtree(self.root, ignore_errors=True)

    def ref(self, version: str) -> SourceRef | None:
        """The copy of `version` as a source the reader reads, None when there is none."""
        if not _VERSION.fullmatch(version) or not (self.root / version / WEIGHTS).is_file():
            return None
        return SourceRef(f"keep://{version}", "file", path=version)

    def has(self, version: str) -> bool:
        return self.ref(version) is not None

    def put(self, version: str, config_json: str, blob: bytes | memoryview) -> None:
        """Keep a validated version's bytes (no-op when already kept)."""
        if not _VERSION.fullmatch(version) or self.has(version):
            return
        tmp = pathlib.Path(tempfile.mkdtemp(prefix=_TMP, dir=self.root))
        try:
            for name, data in ((CONFIG, config_json.encode()), (WEIGHTS, blob)):
                with open(tmp / name, "wb") as f:   # no fsync: a copy a crash cut short
                    f.write(data)                   # fails its digest check when read, and
            os.rename(tmp, self.root / version)    # staging then reads the source
        except OSError as exc:          # e.g. kept meanwhile by another thread, or disk full
            shutil.rmtree(tmp, ignore_errors=True)
            if not self.has(version):
                log.warning("version %s: its bytes could not be kept in %s: %s", version,
                            self.root, exc)

    def trusted(self, version: str) -> tuple[str, tuple | None]:
        """(source uri, file identity) of a copy this store wrote: a read that sees the same
        identity need not hash it (sources.SourceReader.read's trusted); None without one."""
        try:
            return f"keep://{version}", identity_of(os.stat(self.root / version / WEIGHTS))
        except OSError:
            return f"keep://{version}", None

    def remove(self, version: str) -> None:
        if _VERSION.fullmatch(version):
            shutil.rmtree(self.root / version, ignore_errors=True)

    def collect(self, kept: set[str]) -> int:
        """Remove every copy (and leftover temporary directory) no kept version names; the
        number removed."""
        removed = 0
        for entry in os.scandir(self.root):
            if entry.name not in kept and (_VERSION.fullmatch(entry.name)
                                           or entry.name.startswith(_TMP)):
                shutil.rmtree(entry.path, ignore_errors=True)
                removed += 1
        return removed

    def versions(self) -> set[str]:
        return {e.name for e in os.scandir(self.root) if _VERSION.fullmatch(e.name)}


def _clear_stale(tmp: pathlib.Path) -> None:
    """Temporary directories of ':memory:' stores that are gone (killed: their pid no longer
    runs), so a SIGKILL leaves nothing behind for long."""
    for entry in tmp.glob(f"{_TEMP}*"):
        pid = entry.name[len(_TEMP):].split("-", 1)[0]
        if pid.isdigit() and not pid_alive(int(pid)):
            shutil.rmtree(entry, ignore_errors=True)
