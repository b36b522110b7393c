"""The worker's front end as a child process of its core (services.worker.api.frontend), and the
core's end of the link to it (services.worker.api.core_link)."""
from __future__ import annotations

import asyncio
import logging
import os
import pathlib
import shutil
import socket
import subprocess
import sys
import tempfile

from services.common.owned_dirs import clear_stale, make_owned_dir
from services.worker.api.core_link import CoreLink
from services.worker.api.link import BlockingEnd
from services.worker.config import WorkerConfig

log = logging.getLogger("lorafleet.worker")
TEMP_PREFIX = "lorafleet-worker-"        # + pid + "-" + random (services.common.owned_dirs)
UNIX_PATH_MAX = 107                      # bytes of a unix socket's path (sun_path, less NUL)
SOCKET_NAME_ROOM = 32                    # "/" + pid + "-" + 8 random + "/core.sock", and more


def socket_parent(tmp: str) -> str:
    """Where the core's socket directory goes: the temporary directory, unless its path is too
    long for a unix socket's (107 bytes on Linux, with the directory's and socket's names:
    a deep TMPDIR failed the bind), then /tmp."""
    if len(os.fsencode(tmp)) + len(TEMP_PREFIX) + SOCKET_NAME_ROOM <= UNIX_PATH_MAX:
        return tmp
    return "/tmp"


class FrontendFailed(RuntimeError):
    """The front end process could not start (its own error is in the log above)."""


class Front:
    """The worker's front end process (services.worker.api.frontend) and the link to it: it binds
    the public port; this process serves it on a private socket and runs the engine."""

    def __init__(self, cfg: WorkerConfig, servicer, loop: asyncio.AbstractEventLoop,
                 root: pathlib.Path, env: dict[str, str]):
        """root: the project (on the child's PYTHONPATH); env: the child's environment."""
        self.cfg, self.servicer, self.loop, self.root = cfg, servicer, loop, root
        self.env = env
        # the core's socket; a SIGKILLed worker's directory is removed by the next one to start
        parent = socket_parent(tempfile.gettempdir())
        clear_stale(parent, TEMP_PREFIX)
        self._dir = make_owned_dir(parent, TEMP_PREFIX)
        self.core_address = f"unix:{self._dir}/core.sock"
        self.proc: subprocess.Popen | None = None
        self.link: CoreLink | None = None
        self.failed = False

    async def start(self, stopped: asyncio.Event) -> int:
        """Start the front end; returns the public port once it is bound. When it exits
        before the worker drains, `stopped` is set (the worker stops too, exit 1)."""
        ours, theirs = socket.socketpair()
        common = self.cfg.common
        argv = [sys.executable, "-m", "services.worker.api.frontend", "--listen", common.listen,
                "--core", self.core_address, "--link-fd", str(theirs.fileno()),
                "--grace", str(common.grace), "--log-level", common.log_level]
        for flag, value in (("--tls-cert", common.tls_cert), ("--tls-key", common.tls_key),
                            ("--tls-ca", common.tls_ca),
                            ("--service-token-file", common.service_token_file)):
            if value:
                argv += [flag, value]
        if common.reflection:
            argv.append("--reflection")
        env = dict(self.env)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(self.root), env.get("PYTHONPATH"))
                                            if p)
        self.proc = subprocess.Popen(argv, pass_fds=(theirs.fileno(),), env=env)
        theirs.close()
        self.link = CoreLink(BlockingEnd(ours), self.servicer, self.loop)
        self.link.start()
        port = await self.link.front_port
        if port is None:
            raise FrontendFailed(f"the front end could not serve {common.listen} (exit "
                                 f"{self.proc.wait()})")

        async def watch():
            await self.link.closed.wait()
            if not self.servicer.draining:
                log.error("the front end exited (%s): stopping", self.proc.poll())
                self.failed = True
                stopped.set()
        self._watch = self.loop.create_task(watch())
        return port

    async def close(self, timeout: float) -> None:
        """After the drain: wait for the front end's bye (its calls done), then end it."""
        if self.link is not None:
            try:
                await asyncio.wait_for(self.link.closed.wait(), timeout)
            except asyncio.TimeoutError:
                log.warning("the front end did not finish its drain in %.0fs", timeout)
            self.link.close()
        if self.proc is not None:
            try:
                code = await asyncio.to_thread(self.proc.wait, 5)
                (log.info if code == 0 else log.error)("the front end exited (%d)", code)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        shutil.rmtree(self._dir, ignore_errors=True)
