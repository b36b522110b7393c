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


def metrics_host(cfg) -> str:
    """Where /metrics listens: --metrics-host, else the --listen host (so a service kept on
    loopback does not expose its metrics on every interface)."""
    host = cfg.metrics_host or cfg.listen.rpartition(":")[0]
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


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")

COMMON_FIELDS = ("metrics_port", "metrics_host", "keepalive_s", "service_token_file", "grace", "log_level", "otlp_endpoint", "trace_file",
                 "tls_cert", "tls_key", "tls_ca", "reflection", "insecure_internal")


def common_values(args) -> dict:
    """The values of the flags add_common_flags defines, as config keyword arguments."""
    return {name: getattr(args, name) for name in COMMON_FIELDS}


def check_common(cfg, internal: bool = True) -> None:
    """Checks every service config runs on the common fields (raises ValueError). `internal`:
    the service answers internal calls (the store, the worker; not the router), so with no
    authentication for them it must stay on loopback (check_internal_auth)."""
    if bool(cfg.tls_cert) != bool(cfg.tls_key):
        raise ValueError("--tls-cert and --tls-key go together")
    if cfg.service_token_file:
        from services.common.service_auth import read_token
        read_token(cfg.service_token_file)          # readable and not empty, or exit 2
    if not cfg.keepalive_s >= 1:
        raise ValueError(f"--keepalive-s must be >= 1, got {cfg.keepalive_s}")
    if cfg.grace < 0:
        raise ValueError(f"--grace must be >= 0, got {cfg.grace}")
    if not 0 <= cfg.metrics_port <= 65535:
        raise ValueError(f"--metrics-port must be a port (0 = off), got {cfg.metrics_port}")
    if ":" not in cfg.listen:
        raise ValueError(f"--listen must be HOST:PORT, got {cfg.listen!r}")
    if cfg.reflection:
        from services.common.server import reflection_available
        if not reflection_available():
            raise ValueError("--reflection needs the grpcio-reflection package")
    if str(cfg.log_level).upper() not in LOG_LEVELS:
        raise ValueError(f"--log-level must be one of {', '.join(LOG_LEVELS)}, "
                         f"got {cfg.log_level!r}")
    if internal:
        from services.common.internal_auth import check_internal_server
        check_internal_server(cfg)


def add_common_flags(parser, listen: str, metrics_port: int, grace: float) -> None:
    """Flags every service takes (see README: operator contract)."""
    parser.add_argument("--listen", default=listen, help=f"host:port to serve gRPC on ({listen})")
    parser.add_argument("--metrics-port", type=int, default=metrics_port,
                        help=f"Prometheus /metrics port, 0 = off ({metrics_port})")
    parser.add_argument("--metrics-host", default="",
                        help="host to serve /metrics on (the --listen host)")
    parser.add_argument("--keepalive-s", type=float, default=20.0,
                        help="seconds between keepalive pings on channels to other services, "
                             ">= 1 (20)")
    parser.add_argument("--service-token-file", default="",
                        help="a file holding the token the internal services share: sent on "
                             "calls to the worker and the store, which refuse calls without it")
    parser.add_argument("--grace", type=float, default=grace,
                        help=f"seconds to drain in-flight calls on SIGTERM ({grace:g})")
    parser.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING, ERROR (INFO)")
    parser.add_argument("--otlp-endpoint", default=os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"),
                        help="OTLP gRPC endpoint for traces (env OTEL_EXPORTER_OTLP_ENDPOINT)")
    parser.add_argument("--trace-file", default=None,
                        help="also write finished spans as JSON lines to this file")
    parser.add_argument("--tls-cert", default=None, help="server certificate (PEM): enables TLS")
    parser.add_argument("--tls-key", default=None, help="server private key (PEM)")
    parser.add_argument("--tls-ca", default=None,
                        help="CA (PEM) for mTLS: clients must present a cert it signed; also "
                             "used to verify the services this one calls")
    parser.add_argument("--reflection", action="store_true",
                        help="serve grpc.reflection (for grpcurl and the like; off)")
    parser.add_argument("--insecure-internal", action="store_true",
                        help="run with unauthenticated internal calls where a production "
                             "configuration is refused without --service-token-file or mTLS: "
                             "a router with --tenants, a store or worker listening beyond "
                             "loopback (off)")


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
    setup_logging(service, cfg.log_level)
    setup_tracing(f"lorafleet-{service}", cfg.otlp_endpoint, cfg.trace_file)
    return serve_ports(service, cfg, lambda: asyncio.run(main_async(cfg)) or 0)


def serve_ports(service: str, cfg, run) -> int:
    """Check that every port of the service is free, start /metrics, then run(); a port that
    is taken (now or when bound) ends the process with one line naming it, exit 1."""
    from services.common.ports import PortError, check_ports
    try:
        check_ports(cfg)
        start_metrics(cfg.metrics_port, metrics_host(cfg))
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
