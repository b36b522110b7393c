"""Test support: start lorafleet services (and moto's S3 server) as real processes on loopback."""
from __future__ import annotations

import os
import pathlib
import signal
import socket
import subprocess
import sys
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

ROOT = pathlib.Path(__file__).resolve().parent.parent
MODEL_DIR = ROOT / "models" / "tiny-llama"
DEMO_ADAPTERS = ROOT / "models" / "adapters"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# a channel that tries again every 50-250 ms while nothing listens yet: with gRPC's default
# backoff (1 s, growing 1.6x a try) a service that binds 6 s after its start was only seen
# SERVING ~2 s after that
WAIT_OPTIONS = [("grpc.initial_reconnect_backoff_ms", 50),
                ("grpc.max_reconnect_backoff_ms", 250)]


def wait_serving(addr: str, timeout: float = 60.0, proc: subprocess.Popen | None = None) -> None:
    """Block until addr answers grpc.health.v1 SERVING (fail early if the process died)."""
    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(addr, options=WAIT_OPTIONS) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        while time.monotonic() < deadline:
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"process for {addr} exited with {proc.returncode}")
            try:
                resp = stub.Check(health_pb2.HealthCheckRequest(), timeout=1.0)
                if resp.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.1)
    raise TimeoutError(f"{addr} not SERVING after {timeout}s")


def health_status(addr: str) -> int:
    with grpc.insecure_channel(addr) as ch:
        return health_pb2_grpc.HealthStub(ch).Check(
            health_pb2.HealthCheckRequest(), timeout=5.0).status


class FreePort:
    """A service argument that Service replaces by a free loopback port at each start (a port
    free_port() picked can be taken by another process before the service binds it; the service
    then starts again on new ports). Read `port` (or `str()`) after Service.wait(). One
    service's argument: given to several, it holds the last one's pick."""

    def __init__(self, prefix: str = ""):
        self.prefix = prefix                # e.g. "127.0.0.1:" for a listen address
        self.port: int | None = None

    def pick(self) -> str:
        self.port = free_port()
        return f"{self.prefix}{self.port}"

    def __str__(self) -> str:
        return str(self.port)


class Service:
    """One service process: `python -m services.NAME ARGS`, stderr to a log file. An argument
    that is a FreePort becomes a port picked at each start."""

    def __init__(self, name: str, args: list[str], log_dir: pathlib.Path,
                 env: dict[str, str] | None = None, port: int | None = None):
        self.name, self._args, self._log_dir = name, args, log_dir
        self._given_port = port                 # else picked here: may be taken again on a clash
        self._own_port = port is None
        self._picks = any(isinstance(a, FreePort) for a in args)
        self._env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self._start(port or free_port())

    def _start(self, port: int) -> None:
        self.port = port
        self.addr = f"127.0.0.1:{self.port}"
        self.log_path = self._log_dir / f"{self.name}-{self.port}.log"
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", f"services.{self.name}", "--listen", self.addr,
             "--metrics-port", "0",
             *(a.pick() if isinstance(a, FreePort) else a for a in self._args)],
            cwd=ROOT, env=self._env, stdout=self._log, stderr=subprocess.STDOUT)

    def wait(self, timeout: float = 120.0) -> "Service":
        """Until the service answers SERVING. A port that free_port() picked can be taken by
        another process before the service binds it (free_port releases it first); then the
        service exits on "Address already in use" and starts again on a new port, twice at most
        (read `addr` after wait())."""
        for attempt in range(3):
            try:
                wait_serving(self.addr, timeout, self.proc)
                if self._own_port and attempt < 2 and not self._holds_port():
                    # SERVING came from another process on this port (it bound it before this
                    # service could, which exits on "Address already in use")
                    self.kill()
                    self._log.close()
                    self._start(free_port())
                    continue
                return self
            except RuntimeError:
                if ((self._own_port or self._picks) and attempt < 2
                        and self.proc.poll() is not None
                        and "Address already in use" in self.log()):
                    self._log.close()
                    self._start(self._given_port or free_port())
                    continue
                print(self.log())
                raise
            except Exception:
                print(self.log())
                raise
        return self

    def _holds_port(self) -> bool:
        """Whether this service (its process or one under it: the worker's front end) listens
        on its port; True where that cannot be told (no /proc, another user's process)."""
        from services.common.port_holders import children, holders
        held = holders(self.port)
        return not held or bool(set(held) & children(self.proc.pid))

    def log(self) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text()

    def terminate(self, timeout: float = 30.0) -> int:
        """SIGTERM, wait for the drain, return the exit code (kills after timeout)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


class MotoS3:
    """moto's S3 server in its own process on a free loopback port."""

    def __init__(self, log_dir: pathlib.Path):
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._log = open(log_dir / f"moto-{self.port}.log", "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5):
                    return
            except OSError:
                time.sleep(0.1)
        raise TimeoutError("moto server did not start")

    def client(self):
        import boto3
        return boto3.client("s3", endpoint_url=self.endpoint, region_name="us-east-1",
                            aws_access_key_id="test", aws_secret_access_key="test")

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)
        self._log.close()


S3_ENV = {"AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test",
          "AWS_DEFAULT_REGION": "us-east-1"}
