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

    def alloc(self, n: int) -> int | None:
        """Start of a free range of n elements (rounded up to ALIGN), or None."""
        n = self.rounded(n)
        for i, length in enumerate(self._lengths):
            if length >= n:
                start = self._starts[i]
                if length == n:
                    del self._starts[i], self._lengths[i]
                else:
                    self._starts[i] += n
                    self._lengths[i] -= n
                self.used += n
                return start
        return None

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
