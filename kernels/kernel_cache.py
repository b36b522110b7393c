"""Where Triton keeps the kernels it compiles, set from the worker's --kernel-cache.

A compiled specialization is written to the cache under a key of its source, its arguments'
specialization and the compiler's version; a later process that needs the same one loads it
(milliseconds) instead of compiling it (seconds). Entries are written under temporary names
and renamed into place, so processes may share a directory.
"""
from __future__ import annotations

import pathlib


def use(directory: str) -> int:
    """Make this process's Triton read and write its compiled kernels in directory (created if
    missing). Returns how many cached kernels are already there."""
    path = pathlib.Path(directory).resolve()
    path.mkdir(parents=True, exist_ok=True)
    from triton import knobs
    knobs.cache.dir = str(path)
    return count(path)


def count(directory) -> int:
    """How many compiled kernels a cache directory holds (one directory each); 0 if absent."""
    path = pathlib.Path(directory)
    return sum(1 for entry in path.iterdir() if entry.is_dir()) if path.is_dir() else 0
