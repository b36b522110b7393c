"""Directories a process makes for itself (a worker's socket directory, a dev stack's shared
memory), named for their owner: PREFIX + pid + '-' + random. The owner removes its own when it
ends; one whose owner died without doing so (SIGKILL) is removed by the next process of the
same kind at its start (`clear_stale`). A directory is never removed while its owner runs, nor
one of another user, nor one whose name carries no pid (made by something else)."""
from __future__ import annotations

import os
import pathlib
import shutil
import tempfile
from typing import Callable


def make_owned_dir(parent: str | os.PathLike, prefix: str) -> pathlib.Path:
    """A new directory under `parent`, private to this user, named for this process."""
    return pathlib.Path(tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}-", dir=parent))


def owner(path: pathlib.Path, prefix: str) -> int | None:
    """The pid in an owned directory's name, or None when the name is not one."""
    pid = path.name[len(prefix):].split("-", 1)[0] if path.name.startswith(prefix) else ""
    return int(pid) if pid.isdigit() and "-" in path.name[len(prefix):] else None


def alive(pid: int) -> bool:
    """Whether a process with this pid runs (as far as this user can tell)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True                     # another user's: alive as far as we know
    return True


def clear_stale(parent: str | os.PathLike, prefix: str,
                in_use: Callable[[pathlib.Path], bool] = lambda path: False) -> list[str]:
    """Remove this user's owned directories under `parent` whose owner is gone and which
    `in_use` does not claim; the names removed."""
    removed = []
    try:
        entries = list(pathlib.Path(parent).glob(prefix + "*"))
    except OSError:
        return removed
    for path in entries:
        pid = owner(path, prefix)
        try:
            mine = path.is_dir() and not path.is_symlink() and path.stat().st_uid == os.getuid()
        except OSError:
            continue
        if pid is None or not mine or pid == os.getpid() or alive(pid) or in_use(path):
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path.name)
    return removed
