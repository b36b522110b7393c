"""One pass over an adapter's safetensors blob as its bytes arrive (issue 43).

The header (8-byte length, JSON) is read and checked first, with the caller's check of the
tensors (names, shapes, completeness: validate.AdapterCheck), so a bad header or shape is refused
before a byte of the body is read. Then each chunk, while it is in the CPU's cache, feeds the
two digests the registry keeps (the version, SHA-256 of canonical config + "\\n" + blob, and
the blob's SHA-256: validate.content_version, unchanged) and the finite check of the tensor
bytes it holds (raw bits: exponent all ones is NaN or Inf). hashlib and numpy let go of the GIL
on buffers this large, so passes on several threads run in parallel.

Where the bytes go is the caller's: a Destination of the blob's size (the host tier's landing,
a file in the shared-memory directory, or process memory: each byte copied once, from the page
cache to where it is served from), or none (the background validation: one CHUNK-sized buffer
reused, nothing kept).
"""
from __future__ import annotations

import bisect
import hashlib
import time
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Callable

import numpy as np

from services.adapter_store.landing import SCRATCH as CHUNK, Destination, Scratch, in_time
from services.common import safetensors_parse as st
from services.common.errors import Refusal

WEIGHTS = "adapter_model.safetensors"
# per dtype: raw-bit view, the bits below the sign, and the smallest NaN/Inf value of them
_FINITE = {"F32": (np.dtype("<u4"), 0x7FFFFFFF, 0x7F800000),
           "F16": (np.dtype("<u2"), 0x7FFF, 0x7C00),
           "BF16": (np.dtype("<u2"), 0x7FFF, 0x7F80)}


@dataclass
class PassTimes:
    """Seconds a pass spent reading, hashing and finite-checking (its stages, for traces)."""
    read_s: float = 0.0
    digest_s: float = 0.0
    finite_s: float = 0.0


class BlobPass:
    """The checks and digests of one blob, fed its bytes in order (header first)."""

    def __init__(self, config_json: str, check: Callable[[list[st.RawTensor]], None],
                 what: str = WEIGHTS, helper: Executor | None = None,
                 parse: Callable[[bytes, int], list[st.RawTensor]] | None = None):
        """config_json: the canonical config the version hashes first; check(tensors): the
        caller's checks of the header's tensors (raises Refusal); helper: where the blob's
        SHA-256 of each piece runs beside the version's and the finite check (None: here,
        after them): a lone pass takes two cores' time, not one's. parse(head, size): the
        header's tensors, checked (instead of parse_header then check: a caller that knows
        the header already)."""
        self._parse = parse
        self._helper = helper
        self._version = hashlib.sha256(config_json.encode("ascii") + b"\n")
        self._sha = hashlib.sha256()
        self._check, self.what = check, what
        self.tensors: list[st.RawTensor] = []
        self.size = 0
        self._at = 0                # bytes fed so far
        self._ti = 0                # the tensor being finite-checked, its values done, and
        self._done = 0              # the first bytes of a value split between two chunks
        self._carry = b""
        self._uniform: tuple | None = None      # _FINITE's entry of every tensor's dtype
        self._starts: list[int] = []
        self.times = PassTimes()

    def header(self, head, size: int) -> None:
        """Check the header (`head`: the blob's first 8 + N bytes) and its tensors against a
        blob of `size` bytes; raises Refusal."""
        if self._parse is not None:
            self.tensors = self._parse(head, size)
        else:
            self.tensors = st.parse_header(head, size, self.what)
            self._check(self.tensors)
        self.size = size
        dtypes = {t.dtype for t in self.tensors}
        if len(dtypes) == 1:        # (the data has no holes: parse_header checks the layout)
            self._uniform = _FINITE[dtypes.pop()]
            self._starts = [t.offset for t in self.tensors]

    def feed(self, chunk) -> None:
        """The blob's next bytes (a buffer)."""
        t0 = time.perf_counter()
        beside = self._helper.submit(self._sha.update, chunk) if self._helper else None
        self._version.update(chunk)
        if beside is None:
            self._sha.update(chunk)
        t1 = time.perf_counter()
        self._finite(memoryview(chunk), self._at)
        t2 = time.perf_counter()
        if beside is not None:
            beside.result()             # the piece's buffer is reused once this returns
        self._at += len(chunk)
        self.times.digest_s += t1 - t0 + time.perf_counter() - t2
        self.times.finite_s += t2 - t1

    def finish(self) -> tuple[str, str]:
        """(version, blob SHA-256) once every byte was fed; Refusal if fewer came."""
        if self._at != self.size:
            raise Refusal("truncated", f"{self.what}: truncated: {self._at} of {self.size} "
                                       "bytes (the file shrank while it was read)")
        return self._version.hexdigest()[:16], self._sha.hexdigest()

    def _finite(self, chunk: memoryview, at: int) -> None:
        """The values in chunk (the blob's bytes at..): all of them in one check where every
        tensor has one dtype (the data is then one array of it), tensor by tensor otherwise
        and wherever a value is bad (so the refusal names its tensor and index)."""
        end = at + len(chunk)
        if self._uniform is not None and self._clean(chunk, at):
            self._skip_to(chunk, end)
            return
        while self._ti < len(self.tensors):
            t = self.tensors[self._ti]
            stop = t.offset + t.nbytes
            lo, hi = max(t.offset, at), min(stop, end)
            if lo < hi:
                self._values(t, chunk[lo - at:hi - at])
            if stop > end:
                return
            self._ti, self._done, self._carry = self._ti + 1, 0, b""

    def _clean(self, chunk: memoryview, at: int) -> bool:
        """Whether chunk's values (from the first tensor's offset on; with the value split
        from the chunk before) are all finite, checked as one array of the common dtype."""
        lo = max(self.tensors[0].offset - at, 0)
        part = chunk[lo:]
        view, low, bad = self._uniform
        size = view.itemsize
        head = b""
        if self._carry:
            head = self._carry + bytes(part[:size - len(self._carry)])
            part = part[size - len(self._carry):]
        whole = len(part) - len(part) % size
        return not any(len(data) >= size and _magnitudes(data, view, low).max() >= bad
                       for data in (head, part[:whole]))

    def _skip_to(self, chunk: memoryview, end: int) -> None:
        """The tensor-by-tensor state as if every value before `end` was checked there."""
        first = self.tensors[0].offset
        if end <= first:
            return
        i = bisect.bisect_right(self._starts, end) - 1
        t = self.tensors[i]
        size = self._uniform[0].itemsize
        if end >= t.offset + t.nbytes:          # the last tensor's end: all checked
            self._ti, self._done, self._carry = len(self.tensors), 0, b""
            return
        into, k = end - t.offset, (end - t.offset) % size
        self._ti, self._done = i, into // size
        # the last k bytes before end (the carry before them where the chunk is shorter)
        self._carry = (self._carry + bytes(chunk[-size:]))[-k:] if k else b""

    def _values(self, t: st.RawTensor, part: memoryview) -> None:
        """Check the whole values in part (plus a value split across chunks)."""
        size = _FINITE[t.dtype][0].itemsize
        if self._carry:
            joined = self._carry + bytes(part[:size - len(self._carry)])
            part = part[size - len(self._carry):]
            if len(joined) < size:
                self._carry = joined
                return
            self._carry = b""
            self._words(t, joined)
        whole = len(part) - len(part) % size
        if whole:
            self._words(t, part[:whole])
        self._carry = bytes(part[whole:])

    def _words(self, t: st.RawTensor, data) -> None:
        view, low, bad = _FINITE[t.dtype]
        magnitude = _magnitudes(data, view, low)
        if magnitude.max() >= bad:
            hits = np.flatnonzero(magnitude >= bad)
            n = t.nbytes // view.itemsize
            seen = self._done + magnitude.size
            where = "" if seen == n else f" in its first {seen} of {n} values"
            raise Refusal("nonfinite", f"tensor {t.name!r}: {hits.size} NaN/Inf values{where} "
                                       f"(first at flat index {self._done + int(hits[0])})")
        self._done += magnitude.size


def _magnitudes(data, view: np.dtype, low: int) -> np.ndarray:
    """data's values as raw bits without the sign (exponent all ones: NaN or Inf)."""
    return np.bitwise_and(np.frombuffer(data, dtype=view), view.type(low))


def feed_bytes(check: BlobPass, blob, chunk: int = CHUNK) -> None:
    """The pass over a blob already in memory (an S3 object, a test's bytes), in pieces of
    `chunk` bytes after the header."""
    view = memoryview(blob)
    head = st.header_length(view, len(view), check.what) + 8
    check.header(view[:head], len(view))
    for start in range(0, len(view), chunk):
        check.feed(view[start:start + chunk])


def read_checked(f, size: int, check: BlobPass, dest: Destination | None = None,
                 deadline: float | None = None) -> int:
    """Read a blob of `size` bytes from file f, checking it as it comes: the header first
    (refused before the body is read), then the body piece by piece into dest (None: through
    this thread's reused buffer, nothing kept). Returns the bytes read; a file that ends early
    is refused (here, or by check.finish)."""
    dest = dest if dest is not None else Scratch()
    head = _exactly(f, min(8, size), check)
    head += _exactly(f, st.header_length(head, size, check.what), check)
    if len(head) < 8 or len(head) - 8 != int.from_bytes(head[:8], "little"):
        raise Refusal("truncated", f"{check.what}: truncated: the file ended inside its "
                                   "header (it shrank while it was read)")
    check.header(head, size)
    dest.put(0, head)
    check.feed(head)
    got = len(head)
    while got < size:
        in_time(deadline)
        t = time.perf_counter()
        piece = dest.fill(f, got, min(CHUNK, size - got))
        check.times.read_s += time.perf_counter() - t
        if not piece:
            break
        check.feed(piece)
        got += len(piece)
    return got


def _exactly(f, n: int, check: BlobPass) -> bytes:
    """n bytes of f (fewer at its end)."""
    t = time.perf_counter()
    parts, got = [], 0
    while got < n:
        part = f.read(n - got)
        if not part:
            break
        parts.append(part)
        got += len(part)
    check.times.read_s += time.perf_counter() - t
    return b"".join(parts)
