"""The flags every service takes (README, operator contract), as one block: `add_flags` puts
them on a service's parser and `ServiceFlags.from_args` reads them into the frozen value each
service's config holds as `common`, checked once when it is made (a bad value is a ValueError
naming the flag: the service exits 2)."""
from __future__ import annotations

import os
from dataclasses import dataclass, fields

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


@dataclass(frozen=True)
class ServiceFlags:
    listen: str                        # HOST:PORT of the gRPC server
    metrics_port: int                  # Prometheus /metrics; 0 = off
    metrics_host: str = ""             # "" = the --listen host
    keepalive_s: float = 20.0          # ping interval of channels to peers
    service_token_file: str = ""       # the internal services' shared token
    grace: float = 10.0                # seconds a drain gives the calls in flight
    log_level: str = "INFO"
    otlp_endpoint: str | None = None
    trace_file: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_ca: str | None = None
    reflection: bool = False           # serve grpc.reflection (--reflection)
    insecure_internal: bool = False    # allow open internal calls (services.common.internal_auth)

    def __post_init__(self) -> None:
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("--tls-cert and --tls-key go together")
        if self.service_token_file:
            from services.common.service_auth import read_token
            read_token(self.service_token_file)          # readable and not empty, or exit 2
        if not self.keepalive_s >= 1:
            raise ValueError(f"--keepalive-s must be >= 1, got {self.keepalive_s}")
        if self.grace < 0:
            raise ValueError(f"--grace must be >= 0, got {self.grace}")
        if not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"--metrics-port must be a port (0 = off), got {self.metrics_port}")
        if ":" not in self.listen:
            raise ValueError(f"--listen must be HOST:PORT, got {self.listen!r}")
        if self.reflection:
            from services.common.server import reflection_available
            if not reflection_available():
                raise ValueError("--reflection needs the grpcio-reflection package")
        if str(self.log_level).upper() not in LOG_LEVELS:
            raise ValueError(f"--log-level must be one of {', '.join(LOG_LEVELS)}, "
                             f"got {self.log_level!r}")

    @classmethod
    def from_args(cls, args) -> "ServiceFlags":
        """From a namespace parsed with add_flags."""
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls)})


def add_flags(parser, listen: str, metrics_port: int, grace: float) -> None:
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
