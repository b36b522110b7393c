"""The serving benchmark's services: adapter-store, W workers (one by default) and the router,
each started as `python -m services.NAME` on loopback with its log in the work directory, waited
for through grpc.health.v1 (Check, waiting for the channel to connect); a worker killed (SIGKILL)
and started again on its port; the adapters' S3 source (moto's server on loopback); and
snapshots of a worker's Info and residency and the store's Stats, for deltas over a scenario.
"""
from __future__ import annotations

import concurrent.futures
import pathlib
import shlex
import signal
import socket
import subprocess
import sys
import time

import grpc

from bench.lib.header import ROOT
from services.common.gen.lorafleet.v1 import adapter_store_pb2 as spb, adapter_store_pb2_grpc
from services.common.gen.lorafleet.v1 import router_pb2 as rpb, router_pb2_grpc
from services.common.gen.lorafleet.v1 import worker_pb2 as wpb, worker_pb2_grpc

OPTIONS = [("grpc.max_receive_message_length", 64 << 20),
           ("grpc.initial_reconnect_backoff_ms", 100), ("grpc.max_reconnect_backoff_ms", 1000)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PortClash(RuntimeError):
    """The port picked was taken before the service bound it."""


class ServiceProc:
    """One service process; its stdout and stderr go to LOG_DIR/NAME.log."""

    def __init__(self, name: str, args: list[str], log_dir: pathlib.Path, env: dict,
                 label: str | None = None, port: int | None = None, log_mode: str = "w"):
        """label: the name of its log and in messages (default name); port: the one to
        listen on (default a free one); log_mode "a" appends to the log (a restart)."""
        self.name, self.label, self.port = name, label or name, port or free_port()
        self.addr = f"127.0.0.1:{self.port}"
        self.args, self.log_dir, self.env = list(args), log_dir, env
        self.argv = [sys.executable, "-m", f"services.{name}", "--listen", self.addr,
                     "--metrics-port", "0", *args]
        self.log_path = log_dir / f"{self.label}.log"
        self._log = open(self.log_path, log_mode)
        self.started = time.monotonic()
        self.serving_s: float | None = None      # start to SERVING, once wait() saw it
        self.proc = subprocess.Popen(self.argv, cwd=ROOT, env=env, stdout=self._log,
                                     stderr=subprocess.STDOUT)

    @property
    def command(self) -> str:
        return shlex.join(self.argv)

    def tail(self, n: int = 30) -> str:
        self._log.flush()
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])

    def check_alive(self) -> None:
        """Raise (with the log's tail printed) if the process has exited."""
        if self.proc.poll() is None:
            return
        tail = self.tail()
        # the whole log: a process that exits early can print hundreds of lines after the
        # bind error (nanobind's leak report from triton at interpreter exit)
        self._log.flush()
        if "Address already in use" in self.log_path.read_text(errors="replace"):
            raise PortClash(f"{self.label}: port {self.port} was taken")
        print(f"--- {self.label} exited with {self.proc.returncode}; the end of "
              f"{self.log_path}:\n{tail}\n---", flush=True)
        raise RuntimeError(f"{self.label} exited with {self.proc.returncode} (log {self.log_path})")

    def wait(self, timeout: float, progress=None, every: float = 15.0) -> None:
        """Until grpc.health.v1 Check says SERVING. Each Check waits (up to a second, then the
        process is checked) for the channel to connect (wait_for_ready: the store binds only
        once it has registered its adapters); progress() is printed every `every` seconds.
        (Health Watch would need no repeated Checks, but the services' error interceptor
        answers it INTERNAL: grpc_health's aio Watch is no async generator.)"""
        from grpc_health.v1 import health_pb2, health_pb2_grpc
        deadline, shown = time.monotonic() + timeout, time.monotonic()
        with grpc.insecure_channel(self.addr, options=OPTIONS) as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            while True:
                self.check_alive()
                left = deadline - time.monotonic()
                if left <= 0:
                    print(self.tail(), flush=True)
                    raise TimeoutError(f"{self.label} not SERVING after {timeout:.0f}s")
                try:
                    resp = stub.Check(health_pb2.HealthCheckRequest(), wait_for_ready=True,
                                      timeout=min(left, 1.0))
                    if resp.status == health_pb2.HealthCheckResponse.SERVING:
                        self.serving_s = time.monotonic() - self.started
                        return
                    time.sleep(0.05)          # bound, SERVING is being set: check again
                except grpc.RpcError as err:
                    if err.code() not in (grpc.StatusCode.DEADLINE_EXCEEDED,
                                          grpc.StatusCode.UNAVAILABLE,
                                          grpc.StatusCode.NOT_FOUND):
                        raise
                if progress is not None and time.monotonic() - shown >= every:
                    progress(self)
                    shown = time.monotonic()

    def terminate(self, timeout: float = 30.0) -> None:
        """SIGTERM (the service drains), kill after timeout."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()

    def kill(self) -> None:
        """SIGKILL (no drain: what a lost host looks like to the router), reaped."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self._log.close()

    def restarted(self) -> "ServiceProc":
        """The same command on the same port (the router's --worker addresses are static), its
        output appended to the same log."""
        return ServiceProc(self.name, self.args, self.log_dir, self.env, self.label, self.port,
                           log_mode="a")


def _store_progress(expected: int):
    def show(svc: ServiceProc) -> None:
        svc._log.flush()
        text = svc.log_path.read_text(errors="replace")
        done = text.count("adapters dir: registered") + text.count("FAILED:")
        print(f"adapter-store: {done}/{expected} adapters registered at start", flush=True)
    return show


def _last_line(svc: ServiceProc) -> None:
    line = svc.tail(1).strip()
    print(f"{svc.label}: starting ({line[-140:]})", flush=True)


class Stack:
    """adapter-store + the workers (started together), then the router once the workers serve,
    so the router finds them live at start. worker_args: one flag list per worker."""

    def __init__(self, model: pathlib.Path, log_dir: pathlib.Path, store_args: list[str],
                 worker_args: list[list[str]], router_args: list[str], env: dict,
                 expected_adapters: int, timeout: float):
        self.model, self.log_dir, self.env = model, log_dir, env
        self.store_args, self.worker_args, self.router_args = store_args, worker_args, router_args
        self.workers: list[ServiceProc] = []
        self.expected, self.timeout = expected_adapters, timeout
        self.services: list[ServiceProc] = []

    def start(self) -> "Stack":
        for attempt in range(3):
            try:
                self._start_store_and_worker()
                self._start_router()
                return self
            except PortClash as exc:
                print(f"{exc}; starting again on new ports", flush=True)
                self.stop()
            except BaseException:
                self.stop()
                raise
        raise RuntimeError("services could not bind their ports three times")

    def _start_store_and_worker(self) -> None:
        self.store = ServiceProc("adapter_store", ["--model", str(self.model), "--db",
                                                   ":memory:", *self.store_args],
                                 self.log_dir, self.env)
        one = len(self.worker_args) == 1
        self.workers = [ServiceProc("worker", ["--model", str(self.model), "--store",
                                               self.store.addr, *args], self.log_dir, self.env,
                                    label="worker" if one else f"worker{i}")
                        for i, args in enumerate(self.worker_args)]
        self.worker = self.workers[0]
        self.services = [self.store, *self.workers]
        self.store.wait(self.timeout, _store_progress(self.expected))
        print(f"adapter-store serving on {self.store.addr}", flush=True)
        for w in self.workers:
            w.wait(self.timeout, _last_line)
            print(f"{w.label} serving on {w.addr}", flush=True)

    def _start_router(self) -> None:
        targets = [a for w in self.workers for a in ("--worker", w.addr)]
        self.router = ServiceProc("router", ["--store", self.store.addr, *targets,
                                             *self.router_args], self.log_dir, self.env)
        self.services.append(self.router)
        self.router.wait(120, _last_line)
        with grpc.insecure_channel(self.router.addr, options=OPTIONS) as ch:
            info = router_pb2_grpc.GenerationServiceStub(ch).ModelInfo(
                rpb.ModelInfoRequest(), timeout=30, metadata=(("authorization", "Bearer t0"),))
        if info.num_workers < 1:
            raise RuntimeError(f"the router sees no live worker (log {self.router.log_path})")
        if len(self.workers) > 1:
            self._wait_router_sees(len(self.workers), 60)
            info.num_workers = len(self.workers)
        print(f"router serving on {self.router.addr} ({info.model_name}, "
              f"{info.num_workers} worker{'s' if info.num_workers > 1 else ''})", flush=True)

    def _wait_router_sees(self, n: int, timeout: float) -> float:
        """Until the router's ModelInfo counts n live workers; returns the seconds it took."""
        start = time.monotonic()
        while router_workers(self.router.addr) < n:
            if time.monotonic() - start > timeout:
                raise RuntimeError(f"the router does not see {n} workers after {timeout:.0f}s "
                                   f"(log {self.router.log_path})")
            time.sleep(0.05)
        return time.monotonic() - start

    def kill_worker(self, i: int) -> None:
        self.workers[i].kill()

    def restart_worker(self, i: int) -> float:
        """Start worker i again (same flags and port) and wait for SERVING; returns seconds."""
        start = time.monotonic()
        w = self.workers[i] = self.workers[i].restarted()
        self.services = [self.store, *self.workers, self.router]
        if i == 0:
            self.worker = w
        w.wait(self.timeout, _last_line)
        return time.monotonic() - start

    def check_alive(self) -> None:
        for s in self.services:
            s.check_alive()

    def commands(self) -> dict[str, str]:
        """Each service's command line; with several workers, "worker" is the first one's
        (Stack.worker_commands has them all)."""
        return {"adapter_store": self.store.command, "worker": self.worker.command,
                "router": self.router.command}

    def worker_commands(self) -> list[str]:
        return [w.command for w in self.workers]

    def stop(self) -> None:
        for s in reversed(self.services):
            s.terminate()
        self.services = []


# -------------------------------------------------------------------------------- snapshots
def worker_info(addr: str, since: int | None = None) -> wpb.WorkerInfoResponse:
    """The worker's Info; with `since`, its cold-load records after that seq too."""
    with grpc.insecure_channel(addr, options=OPTIONS) as ch:
        return worker_pb2_grpc.WorkerStub(ch).Info(wpb.WorkerInfoRequest(
            cold_load_records=since is not None, cold_loads_since=since or 0),
                                                   timeout=60)


def router_workers(addr: str) -> int:
    """The live workers the router counts (its ModelInfo)."""
    with grpc.insecure_channel(addr, options=OPTIONS) as ch:
        return router_pb2_grpc.GenerationServiceStub(ch).ModelInfo(
            rpb.ModelInfoRequest(), timeout=10,
            metadata=(("authorization", "Bearer t0"),)).num_workers


def residency(addr: str, timeout: float = 30.0) -> wpb.ResidencyUpdate:
    """The worker's residency snapshot: the first message of a WatchResidency stream."""
    with grpc.insecure_channel(addr, options=OPTIONS) as ch:
        call = worker_pb2_grpc.WorkerStub(ch).WatchResidency(
            wpb.WatchResidencyRequest(watcher="serve-bench"), timeout=timeout)
        try:
            for update in call:
                if update.snapshot:
                    return update
        finally:
            call.cancel()
    raise RuntimeError(f"worker {addr}: the residency stream ended before a snapshot")


def offload(addr: str, adapter_ids: list[str], to_host: bool) -> None:
    """Drop adapters from the worker's pool (and from its host tier unless to_host)."""
    with grpc.insecure_channel(addr, options=OPTIONS) as ch:
        stub = worker_pb2_grpc.WorkerStub(ch)
        for aid in adapter_ids:
            stub.OffloadAdapter(wpb.OffloadAdapterRequest(id=aid, to_host=to_host), timeout=30)


def store_stats(addr: str) -> spb.StoreStatsResponse:
    with grpc.insecure_channel(addr, options=OPTIONS) as ch:
        return adapter_store_pb2_grpc.AdapterStoreStub(ch).Stats(spb.StoreStatsRequest(),
                                                                  timeout=30)


# ------------------------------------------------------------------------------- S3 source
S3_ENV = {"AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test",
          "AWS_DEFAULT_REGION": "us-east-1"}


class S3Source:
    """moto's S3 server on loopback holding the adapters, bucket `bucket`, one prefix each."""

    def __init__(self, log_dir: pathlib.Path, bucket: str = "lorafleet-bench"):
        import importlib.util
        missing = [m for m in ("boto3", "moto") if importlib.util.find_spec(m) is None]
        if missing:
            raise SystemExit(f"--source s3 needs {' and '.join(missing)} (pip install boto3 "
                             "'moto[server]'); use --source local here")
        from tests.support import MotoS3
        self.bucket, self.moto = bucket, MotoS3(log_dir)
        self.endpoint = self.moto.endpoint
        self.client = self.moto.client()
        self.client.create_bucket(Bucket=bucket)

    def upload(self, adapters_dir: pathlib.Path, ids: list[str]) -> None:
        def put(aid: str) -> None:
            for f in ("adapter_config.json", "adapter_model.safetensors"):
                self.client.upload_file(str(adapters_dir / aid / f), self.bucket, f"{aid}/{f}")
        _each(put, ids, "uploaded to S3")

    def register(self, store_addr: str, ids: list[str]) -> None:
        """Register every adapter with the store (it reads and validates each from S3)."""
        with grpc.insecure_channel(store_addr, options=OPTIONS) as ch:
            stub = adapter_store_pb2_grpc.AdapterStoreStub(ch)
            _each(lambda aid: stub.Register(spb.RegisterRequest(
                id=aid, source=f"s3://{self.bucket}/{aid}", replace=True), timeout=600),
                ids, "registered from S3")

    def stop(self) -> None:
        self.moto.stop()


def _each(fn, items: list, what: str) -> None:
    """fn over items on 8 threads, progress every 100."""
    start = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        for k, _ in enumerate(pool.map(fn, items), 1):
            if k % 100 == 0 or k == len(items):
                print(f"adapters: {k}/{len(items)} {what} ({time.monotonic() - start:.0f}s)",
                      flush=True)
