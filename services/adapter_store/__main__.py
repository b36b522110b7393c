"""`python -m services.adapter_store`: the adapter store process (flags: config.parser)."""
from __future__ import annotations

import asyncio
import logging
import os
import sys

from services.adapter_store import config as store_config
from services.adapter_store.background import BackgroundValidator
from services.adapter_store.server import build_store, create_server
from services.common.runtime import metrics_host, serve_ports, setup_logging
from services.common.server import serve
from services.common.telemetry import setup_tracing

log = logging.getLogger("services.adapter_store")


async def _run(config: store_config.StoreConfig) -> None:
    store, registry = build_store(config)
    server, port, health = create_server(config, store)
    flags = config.common
    log.info("adapter store listening on %s (port %d)", flags.listen, port)
    if flags.metrics_port:
        log.info("metrics on %s:%d/metrics", metrics_host(flags), flags.metrics_port)
    background = BackgroundValidator(store, registry, config.background_threads,
                                     config.background_bytes_per_s)

    async def started() -> None:        # just before SERVING; it begins a while after
        background.start()

    await serve(server, health, flags.grace, on_drain=background.stop, name="adapter-store",
                started=started)
    await background.stop()
    store.close()
    registry.close()


def main(argv: list[str] | None = None) -> int:
    args = store_config.parser().parse_args(argv)
    setup_logging("adapter-store", args.log_level)
    try:
        config = store_config.from_args(args, os.environ)
    except ValueError as exc:
        log.error("bad configuration: %s", exc)
        return 2
    setup_tracing("adapter-store", config.common.otlp_endpoint, config.common.trace_file)
    return serve_ports("adapter-store", config, lambda: asyncio.run(_run(config)) or 0)


if __name__ == "__main__":
    sys.exit(main())
