"""Where adapters come from: `file://REL` under the adapters dir, `file:///ABS` under the adapters
dir or an --allow-source-root, or `s3://BUCKET/PREFIX`. A local source is refused (naming the
directories it may be under) when its path, symlinks resolved, leaves them.

Only `adapter_config.json` and `adapter_model.safetensors` are ever read. A source that holds only
`adapter_model.bin` (a pickle) is refused without opening it. Sizes are checked (stat / HEAD)
against --max-adapter-bytes before a byte is read. `SourceReader.read` blocks: callers run it in a
thread (asyncio.to_thread) so the event loop never waits on a disk or a socket.
"""
from __future__ import annotations

import contextlib
import os
import pathlib
import re
import stat
import time
from dataclasses import dataclass
from typing import Callable

from services.adapter_store import s3
from services.adapter_store.landing import CHUNK, Destination, in_time, read_into
from services.adapter_store.s3 import MissingFile
from services.adapter_store.peft_config import MAX_CONFIG_BYTES
from services.common.errors import Refusal

CONFIG, WEIGHTS, PICKLE = "adapter_config.json", "adapter_model.safetensors", "adapter_model.bin"
__all__ = ["CHUNK", "Destination", "read_into", "SourceReader", "SourceRef", "RawAdapter",
           "parse_source", "identity_of"]
_BUCKET = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")
_SEGMENT = re.compile(r"[A-Za-z0-9._=+@-]{1,255}")


@dataclass(frozen=True)
class SourceRef:
    """A parsed source URI: kind "file" (path relative to the root) or "s3" (bucket, prefix)."""

    uri: str
    kind: str
    path: str = ""
    bucket: str = ""


@dataclass(frozen=True)
class RawAdapter:
    """The two files' bytes as read from a source; `sha256` is the blob's digest when it was
    hashed as it was read (else "")."""

    config: bytes
    blob: bytes | memoryview
    sha256: str = ""
    landed: "Destination | None" = None      # where the blob was read into, if anywhere
    # a local blob's file as it was for the whole read: (dev, inode, size, mtime_ns, ctime_ns);
    # None when it changed while being read, or for S3
    identity: tuple | None = None
    trusted: bool = False                    # read unhashed: its identity was the one given


SETTLED_S = 2.0      # a file's identity is kept once its mtime and ctime are this old


def identity_of(info: os.stat_result) -> tuple:
    """What changes whenever a file's bytes do (any write moves ctime, which no call sets),
    as long as the write lands in a later timestamp tick (SourceReader._identity)."""
    return (info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns, info.st_ctime_ns)


def parse_source(uri: str, default_bucket: str | None) -> SourceRef:
    """Check a source URI's shape; raises Refusal naming the `source` field. A file:// ref's
    path is relative (to the adapters dir) or, for file:///ABS, absolute."""
    if uri.startswith("file:///"):
        return SourceRef(uri, "file", path="/" + _relative(uri[len("file:///"):], uri))
    if uri.startswith("file://"):
        return SourceRef(uri, "file", path=_relative(uri[len("file://"):], uri))
    if uri.startswith("s3://"):
        bucket, _, prefix = uri[len("s3://"):].partition("/")
        bucket = bucket or (default_bucket or "")
        if not _BUCKET.fullmatch(bucket) or ".." in bucket:
            raise Refusal("source", f"source: {uri!r} needs a valid bucket name (s3://BUCKET/"
                                    "PREFIX, or s3:///PREFIX with --bucket)")
        prefix = _relative(prefix.strip("/"), uri) if prefix.strip("/") else ""
        return SourceRef(f"s3://{bucket}/{prefix}", "s3", path=prefix, bucket=bucket)
    raise Refusal("source", f"source: {uri[:200]!r} is not file://REL (under --adapters-dir), "
                            "file:///ABS (under --adapters-dir or an --allow-source-root) or "
                            "s3://BUCKET/PREFIX")


def _relative(rel: str, uri: str) -> str:
    """A relative path of plain segments: no '..', no absolute path, no odd characters."""
    parts = rel.split("/")
    if not rel or rel.startswith("/") or not all(_SEGMENT.fullmatch(p) for p in parts) \
            or any(p in (".", "..") for p in parts):
        raise Refusal("source", f"source: {uri[:200]!r}: the path must be made of plain "
                                "names, without '..' (file://REL or file:///ABS)")
    return rel


class SourceReader:
    """Reads adapters from the local root and from S3 with size caps and bounded timeouts."""

    def __init__(self, root: pathlib.Path | None, s3_client: s3.S3Clients | None,
                 max_bytes: int, settled_s: float = SETTLED_S,
                 allowed: tuple[pathlib.Path, ...] = ()):
        """settled_s: how old a file's mtime and ctime must be for its identity to be kept
        (see identity_of); allowed: more directories file:///ABS sources may be under
        (--allow-source-root)."""
        self._root = root.resolve() if root is not None else None
        self._roots = tuple(dict.fromkeys(
            ([self._root] if self._root is not None else []) + [a.resolve() for a in allowed]))
        self._s3 = s3_client
        self._max = max_bytes
        self._settled_ns = int(settled_s * 1e9)

    @property
    def root(self) -> pathlib.Path | None:
        """The adapters dir (symlinks resolved), None without one."""
        return self._root

    def _identity(self, info: os.stat_result, same: bool) -> tuple | None:
        """The file's identity if it held for the whole read and is settled: a write in the
        same timestamp tick as the read that saw the identity would not change it (a filesystem
        with coarse timestamps), so a file touched in the last settled_s gets none (is hashed
        again next time)."""
        if not same:
            return None
        now = time.time_ns()
        if now - max(info.st_mtime_ns, info.st_ctime_ns) < self._settled_ns:
            return None
        return identity_of(info)

    def read(self, ref: SourceRef, timeout: float | None = None,
             check_config: Callable[[bytes], object] | None = None,
             landing: Callable[[int], Destination] | None = None,
             trusted: tuple | None = None) -> RawAdapter:
        """Both files of the adapter at `ref` (blocking); timeout bounds S3 I/O and local
        reads, in seconds.

        check_config(config bytes) runs before the weights are read, so a refused config
        never costs a download. With `landing` (a size -> Destination), a local blob is read
        straight into the destination and hashed as it is read (RawAdapter.sha256 set), or,
        when its file's identity is still `trusted` (the one a verified read saw) before and
        after the read, not hashed at all (RawAdapter.trusted).
        """
        check = check_config or (lambda _: None)
        if ref.kind == "file":
            deadline = None if timeout is None else time.monotonic() + timeout
            return self._read_file(ref, check, landing, trusted, deadline)
        return RawAdapter(*self._read_s3(ref, timeout, check))

    # ---- file:// ----------------------------------------------------------------------------

    def real_dir(self, ref: SourceRef) -> pathlib.Path | None:
        """A file:// ref's directory with symlinks resolved (None for s3:// or without an
        adapters dir for a relative one); not checked."""
        if ref.kind != "file":
            return None
        if ref.path.startswith("/"):
            return pathlib.Path(ref.path).resolve()
        return (self._root / ref.path).resolve() if self._root is not None else None

    def _folder(self, ref: SourceRef) -> pathlib.Path:
        """A file:// adapter's directory, checked: inside the adapters dir (file://REL) or one
        of the allowed roots (file:///ABS), present, and not a pickled adapter (whatever then
        reads it)."""
        if ref.path.startswith("/") and not self._roots:
            raise Refusal("source", f"source: {ref.uri!r}: file:///ABS sources need "
                                    "--adapters-dir or --allow-source-root")
        if not ref.path.startswith("/") and self._root is None:
            raise Refusal("source", f"source: {ref.uri!r}: file://REL sources need "
                                    "--adapters-dir (or give file:///ABS under an "
                                    "--allow-source-root)")
        folder = self._contained(self.real_dir(ref), ref)
        if not folder.is_dir():
            raise MissingFile(f"source {ref.uri}: no such adapter directory")
        if not (folder / WEIGHTS).exists() and (folder / PICKLE).exists():
            raise _pickle_refusal(ref)
        return folder

    def _read_file(self, ref: SourceRef, check: Callable,
                   landing: Callable[[int], Destination] | None = None,
                   trusted: tuple | None = None, deadline: float | None = None) -> RawAdapter:
        folder = self._folder(ref)
        config = self._file(folder / CONFIG, ref, MAX_CONFIG_BYTES, deadline)[0]
        check(config)
        if landing is None:
            return RawAdapter(config, *self._file(folder / WEIGHTS, ref, self._max, deadline))
        return RawAdapter(config, *self._file_into(folder / WEIGHTS, ref, self._max, landing,
                                                   trusted, deadline))

    def peek(self, ref: SourceRef, check: Callable[[bytes], object]
             ) -> tuple[bytes, os.stat_result]:
        """(adapter_config.json bytes, adapter_model.safetensors stat) of a file:// adapter:
        what a start-up scan reads (blocking). check(config) runs first, as in read(); the
        weights file is then opened and checked as read() checks it (a regular file inside the
        root, under the size cap, never a pickle) but not read."""
        with self._weights(ref, check) as (config, _, info):
            return config, info

    def open_weights(self, ref: SourceRef, check: Callable[[bytes], object]):
        """A context of (config bytes, weights file, its stat) of a file:// adapter, checked
        as read() checks them (check(config) before the weights are opened), for a caller
        that reads the weights itself (first_pass.read_checked; blocking)."""
        return self._weights(ref, check)

    @contextlib.contextmanager
    def _weights(self, ref: SourceRef, check: Callable[[bytes], object]):
        folder = self._folder(ref)
        config = self._file(folder / CONFIG, ref, MAX_CONFIG_BYTES)[0]
        check(config)
        with self._open(folder / WEIGHTS, ref, self._max) as (f, info):
            yield config, f, info

    def identity_after(self, f, info: os.stat_result) -> tuple | None:
        """The identity of a file read whole through `f`, opened with stat `info`: None when
        it changed meanwhile or is not settled (see _identity)."""
        return self._identity(info, identity_of(os.fstat(f.fileno())) == identity_of(info))

    def _contained(self, path: pathlib.Path, ref: SourceRef) -> pathlib.Path:
        """path with symlinks resolved; refused, naming the directories sources may be under,
        if that leaves them."""
        real = path.resolve()
        if not any(real == r or r in real.parents for r in self._roots):
            raise Refusal("source", f"source: {ref.uri[:200]!r} resolves outside --adapters-dir "
                                    f"and every --allow-source-root (to {str(real)[:200]}; "
                                    f"sources may be under: {self.roots_text()})")
        return real

    def roots_text(self) -> str:
        """The directories local sources may be under, for messages."""
        named = [str(r) for r in self._roots]
        return (", ".join(named) or "none") + "; allow more with --allow-source-root DIR"

    def _file(self, path: pathlib.Path, ref: SourceRef, cap: int,
              deadline: float | None = None) -> tuple[bytes, str, None, tuple | None]:
        """(bytes, "", None, identity) of a file: at most cap + 1 bytes, by the deadline."""
        with self._open(path, ref, cap) as (f, info):
            parts, size = [], 0
            while size <= cap:
                in_time(deadline, path.name)
                piece = f.read(min(CHUNK, cap + 1 - size))
                if not piece:
                    break
                parts.append(piece)
                size += len(piece)
            data = b"".join(parts)
            same = identity_of(os.fstat(f.fileno())) == identity_of(info)
        _check_size(path.name, len(data), cap)
        return data, "", None, self._identity(info, same)

    def _file_into(self, path: pathlib.Path, ref: SourceRef, cap: int,
                   landing: Callable[[int], Destination], trusted: tuple | None,
                   deadline: float | None = None
                   ) -> tuple[memoryview, str, Destination, tuple | None, bool]:
        """(bytes, digest or "", destination, identity, trusted) of a file read into place."""
        with self._open(path, ref, cap) as (f, info):
            before = identity_of(info)
            dest = landing(info.st_size)
            try:
                digest = read_into(f, info.st_size, dest,
                                   hashed=trusted is None or before != trusted,
                                   deadline=deadline)
                same = identity_of(os.fstat(f.fileno())) == before
                if not digest and not same:     # it changed while read unhashed: hash it
                    dest.drop()
                    dest = landing(info.st_size)
                    f.seek(0)
                    digest = read_into(f, info.st_size, dest, deadline=deadline)
            except BaseException:
                dest.drop()
                raise
        return dest.view, digest, dest, self._identity(info, same), not digest

    @contextlib.contextmanager
    def _open(self, path: pathlib.Path, ref: SourceRef, cap: int):
        """(file, stat) of a regular file inside the root, its size checked against cap.

        Opened non-blocking and without following a symlink, then checked with fstat before a
        byte is read: a FIFO, device, socket or directory in its place is refused naming the
        file (opening a FIFO blocks until a writer comes; reading a device may never end)."""
        if not path.exists() and not path.is_symlink():
            raise MissingFile(f"{path.name}: missing from source {ref.uri}")
        real = self._contained(path, ref)
        try:
            fd = os.open(real, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC
                         | getattr(os, "O_NOFOLLOW", 0))
        except FileNotFoundError:
            raise MissingFile(f"{path.name}: missing from source {ref.uri}") from None
        except OSError as exc:
            raise Refusal("source", f"{path.name}: cannot be opened in {ref.uri} "
                                    f"({exc.strerror or type(exc).__name__})") from None
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                raise Refusal("source", f"{path.name}: not a regular file in {ref.uri} "
                                        f"({_kind(info.st_mode)})")
            _check_size(path.name, info.st_size, cap)
        except BaseException:
            os.close(fd)
            raise
        with os.fdopen(fd, "rb") as f:
            yield f, info

    # ---- s3:// ------------------------------------------------------------------------------

    def _read_s3(self, ref: SourceRef, timeout: float | None, check: Callable
                 ) -> tuple[bytes, bytes]:
        if self._s3 is None:  # pragma: no cover - S3Clients always exists in the service
            raise Refusal("source", "source: s3:// is not configured")
        client = self._s3.client(timeout)
        key = f"{ref.path}/" if ref.path else ""
        config_size = s3.head_size(client, ref.bucket, key + CONFIG)
        if config_size is None:
            raise MissingFile(f"{CONFIG}: missing from source {ref.uri}")
        _check_size(CONFIG, config_size, MAX_CONFIG_BYTES)
        size = s3.head_size(client, ref.bucket, key + WEIGHTS)
        if size is None:
            if s3.head_size(client, ref.bucket, key + PICKLE) is not None:
                raise _pickle_refusal(ref)
            raise MissingFile(f"{WEIGHTS}: missing from source {ref.uri}")
        _check_size(WEIGHTS, size, self._max)
        config = s3.get(client, ref.bucket, key + CONFIG, MAX_CONFIG_BYTES)
        _check_size(CONFIG, len(config), MAX_CONFIG_BYTES)
        check(config)
        blob = s3.get(client, ref.bucket, key + WEIGHTS, self._max)
        _check_size(WEIGHTS, len(blob), self._max)
        return config, blob


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a plain file"


def _check_size(name: str, size: int, cap: int) -> None:
    if size > cap:
        raise Refusal("size", f"{name}: {size} bytes exceeds the {cap}-byte cap"
                              f"{' (--max-adapter-bytes)' if name == WEIGHTS else ''}")


def _pickle_refusal(ref: SourceRef) -> Refusal:
    return Refusal("pickle", f"{WEIGHTS}: source {ref.uri} holds only {PICKLE}, a pickle; "
                             "lorafleet loads safetensors only and never opens pickles "
                             "(convert it with safetensors first)")
