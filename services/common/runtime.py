"""Process-level set-up shared by the services' main(): logging and the /metrics endpoint."""
from __future__ import annotations

import errno
import logging
import os
import sys


def setup_logging(service: str, level: str = "INFO") -> None:
    """One line per event: time, service, level, logger, message."""
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO), stream=sys.stderr,
        format=f"%(asctime)s {service} %(levelname)s %(name)s: %(message)s", force=True)


def metrics_host(flags) -> str:
    """Where /metrics listens (flags: a service's ServiceFlags): --metrics-host, else the
    --listen host (so a service kept on loopback does not expose its metrics on every
    interface)."""
    host = flags.metrics_host or flags.listen.rpartition(":")[0]
    return host.strip("[]") or "0.0.0.0"


def start_metrics(port: int, host: str) -> int:
    """Serve Prometheus /metrics on host:port (port 0 = off; never SO_REUSEPORT, so the port is
    this process's alone). Returns the port bound; PortError when it cannot be bound."""
    if port <= 0:
        return 0
    from prometheus_client import start_http_server
    from services.common.ports import PortError, taken
    try:
        server, _thread = start_http_server(port, addr=host)
    except OSError as exc:
        address = f"{host}:{port}"
        if exc.errno == errno.EADDRINUSE:
            raise taken("--metrics-port", address, port) from None
        raise PortError(f"could not serve --metrics-port {address}: {exc.strerror}") from None
    return server.server_port


def freeze_startup_objects(log: logging.Logger) -> int:
    """Collect once, then move every object alive after start-up (modules, the model's Python
    objects, tables) out of the collector's generations, so the full collections that serving
    triggers now and then walk only what serving made, not all of that; how many were moved."""
    import gc
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    log.info("start-up objects frozen for the garbage collector: %d", frozen)
    return frozen


_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1000, "kib": 1 << 10, "m": 1 << 20, "mb": 1000**2,
          "mib": 1 << 20, "g": 1 << 30, "gb": 1000**3, "gib": 1 << 30}


def parse_bytes(text: str | int) -> int:
    """'64MiB', '2GiB', '512k', '1000000' -> bytes (argparse type for size flags)."""
    if isinstance(text, int):
        return text
    s = str(text).strip().lower().replace("_", "")
    num = s.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = s[len(num):]
    if unit not in _UNITS or not num:
        raise ValueError(f"not a size: {text!r} (use e.g. 512MiB, 2GiB)")
    return int(float(num) * _UNITS[unit])


def run_service(service: str, parse, main_async) -> int:
    """A service's main(): build the config (a bad one exits 2 with the reason), then logging,
    tracing and /metrics, then serve until SIGTERM."""
    import asyncio
    from services.common.telemetry import setup_tracing
    try:
        cfg = parse()
    except ValueError as exc:
        print(f"{service}: bad configuration: {exc}", file=sys.stderr)
        return 2
    setup_logging(service, cfg.common.log_level)
    setup_tracing(f"lorafleet-{service}", cfg.common.otlp_endpoint, cfg.common.trace_file)
    return serve_ports(service, cfg, lambda: asyncio.run(main_async(cfg)) or 0)


def serve_ports(service: str, cfg, run) -> int:
    """Check that every port of the service is free, start /metrics, then run(); a port that
    is taken (now or when bound) ends the process with one line naming it, exit 1."""
    from services.common.ports import PortError, check_ports
    try:
        check_ports(cfg)
        start_metrics(cfg.common.metrics_port, metrics_host(cfg.common))
        return run()
    except PortError as exc:
        print(f"{service}: {exc}", file=sys.stderr, flush=True)
        return 1


def exit_process(code: int) -> None:
    """End the process with `code` after an orderly main(), as the interpreter would up to its
    teardown: threads are shut down as at exit (executors told to stop, the other non-daemon
    threads joined), the atexit handlers run (tracing's flush, logging's), then os._exit skips
    the teardown of modules, where nanobind reports Triton's module-level objects as leaks
    (~27 lines a worker exit). An exception out of main() never comes here: it ends the
    process as usual, traceback and all."""
    import atexit
    import threading
    threading._shutdown()           # what Py_Finalize does first (CPython)
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(int(code or 0))
