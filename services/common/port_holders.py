"""Which processes listen on a TCP port (Linux /proc; elsewhere, and for other users'
processes, nothing is known): for saying what holds a port a dev stack needs, and for making
sure a SERVING answer came from the process that was started, not from another on its port."""
from __future__ import annotations

import os
import pathlib

LISTEN = "0A"                           # the TCP state in /proc/net/tcp
PROC = pathlib.Path("/proc")


def listening_inodes(port: int) -> set[str]:
    """The socket inodes listening on `port` (IPv4 or IPv6, any address)."""
    inodes = set()
    for table in ("tcp", "tcp6"):
        try:
            lines = (PROC / "net" / table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) > 9 and fields[3] == LISTEN and \
                    int(fields[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(fields[9])
    return inodes


def holders(port: int) -> dict[int, str]:
    """{pid: command line} of the processes (of this user) that hold a socket listening on
    `port`."""
    wanted = {f"socket:[{inode}]" for inode in listening_inodes(port)}
    found: dict[int, str] = {}
    if not wanted:
        return found
    for proc in PROC.glob("[0-9]*"):
        try:
            if any(os.readlink(fd) in wanted for fd in (proc / "fd").iterdir()):
                cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
                found[int(proc.name)] = cmd
        except OSError:
            continue                # gone, or not ours
    return found


def describe(port: int) -> str:
    """'pid 123 (python -m services.router ...)' for each holder, or a plain 'another process'."""
    held = holders(port)
    if not held:
        return "another process"
    return ", ".join(f"pid {pid} ({cmd[:120]})" for pid, cmd in sorted(held.items()))


def children(pid: int) -> set[int]:
    """pid and every process under it (its children, theirs, ...)."""
    parents: dict[int, int] = {}
    for proc in PROC.glob("[0-9]*"):
        try:
            stat = (proc / "stat").read_text()
            parents[int(proc.name)] = int(stat.rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
    family, grew = {pid}, True
    while grew:
        more = {child for child, parent in parents.items() if parent in family} - family
        family |= more
        grew = bool(more)
    return family


def held_by(port: int, pid: int) -> bool | None:
    """Whether `pid` or a process under it listens on `port`; None when /proc cannot tell."""
    if not (PROC / "net" / "tcp").exists():
        return None
    return bool(set(holders(port)) & children(pid))
