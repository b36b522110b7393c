"""First-fit allocator of element ranges in the flat adapter pool (no torch).

Each adapter is one contiguous range, so staging it is one copy. Free ranges coalesce; when a
request does not fit in any hole although enough is free in total, the caller evicts more.
"""
from __future__ import annotations

import bisect

ALIGN = 64  # elements: keeps every blob start 128-byte aligned for bf16


class RangeAllocator:
    def __init__(self, capacity: int):
        self.capacity = capacity - capacity % ALIGN
        self._starts: list[int] = [0]          # free ranges, sorted by start
        self._lengths: list[int] = [self.capacity]
        self.used = 0

    @staticmethod
    def rounded(n: int) -> int:
        return -(-n // ALIGN) * ALIGN

    @property
    def free(self) -> int:
        return self.capacity - self.used

    @property
    def largest_hole(self) -> int:
        return max(self._lengths, default=0)

    def alloc(self, n: int, avoid: tuple[int, int] | None = None) -> int | None:
        """Start of a free range of n elements (rounded up to ALIGN), or None. avoid: a range
        [start, end) the new one must not overlap (another's reserved window)."""
        n = self.rounded(n)
        for i, length in enumerate(self._lengths):
            start = self._starts[i]
            if avoid is not None and start < avoid[1] and start + length > avoid[0]:
                start = start if avoid[0] - start >= n else max(start, avoid[1])
            if self._starts[i] + length - start >= n:
                self._take(i, start, n)
                return start
        return None

    def _take(self, i: int, start: int, n: int) -> None:
        """Allocate [start, start + n) out of free range i."""
        hole_start, hole_end = self._starts[i], self._starts[i] + self._lengths[i]
        del self._starts[i], self._lengths[i]
        for j, (s, e) in enumerate(((start + n, hole_end), (hole_start, start))):
            if e > s:                          # the tail, then the head: sorted order kept
                self._starts.insert(i, s)
                self._lengths.insert(i, e - s)
        self.used += n

    def release(self, start: int, n: int) -> None:
        n = self.rounded(n)
        i = bisect.bisect_left(self._starts, start)
        self._starts.insert(i, start)
        self._lengths.insert(i, n)
        self.used -= n
        # merge with the next, then with the previous
        if i + 1 < len(self._starts) and start + n == self._starts[i + 1]:
            self._lengths[i] += self._lengths.pop(i + 1)
            self._starts.pop(i + 1)
        if i > 0 and self._starts[i - 1] + self._lengths[i - 1] == start:
            self._lengths[i - 1] += self._lengths.pop(i)
            self._starts.pop(i)
