"""Wiring: build the store from a StoreConfig and serve it (`create_server`, usable in-process)."""
from __future__ import annotations

import logging

import grpc

from services.adapter_store import metrics
from services.adapter_store.config import StoreConfig
from services.adapter_store.host_cache import HostCache
from services.adapter_store.keep import VersionKeep
from services.adapter_store.registry import Registry
from services.adapter_store.scan import scan_dir
from services.adapter_store.s3 import S3Clients
from services.adapter_store.servicer import AdapterStoreServicer
from services.adapter_store.sources import SourceReader
from services.adapter_store.store import AdapterStore
from services.adapter_store.validate import load_base_shapes
from services.adapter_store.work_pool import ValidationPool
from services.common import server as common_server
from services.common.service_auth import describe, read_token
from services.common.gen.lorafleet.v1 import adapter_store_pb2, adapter_store_pb2_grpc

log = logging.getLogger(__name__)
SERVICE_NAME = adapter_store_pb2.DESCRIPTOR.services_by_name["AdapterStore"].full_name


def build_store(config: StoreConfig) -> tuple[AdapterStore, Registry]:
    """Open the registry, and record the --adapters-dir adapters (blocking, at start-up; their
    weights are read on first use: scan.py)."""
    base = load_base_shapes(config.base_config)
    log.info("validating against %s: %s", config.base_config, base)
    registry = Registry(config.db)
    s3 = S3Clients(config.s3_endpoint, config.s3_region, config.s3_connect_timeout,
                   config.s3_read_timeout)
    reader = SourceReader(config.adapters_dir, s3, config.max_adapter_bytes,
                          allowed=config.allow_source_roots)
    cache = HostCache(config.host_cache_bytes, config.tenant_share, config.shm_dir)
    keep = VersionKeep(config.versions_path(), config.max_adapter_bytes)
    first_use = ValidationPool(config.first_use_threads, config.first_use_per_tenant,
                               name="store-first-use")
    log.info("first uses: %d threads, %d a tenant at most", first_use.threads,
             first_use.per_owner)
    store = AdapterStore(base, registry, reader, cache, config.max_rank, config.bucket,
                         first_use=first_use, keep=keep)
    if config.adapters_dir is not None:
        scan_dir(registry, reader, base, config.max_rank, config.adapters_dir,
                 config.scan_threads)
    removed = keep.collect(registry.kept_versions())
    log.info("versions kept in %s%s", keep.root,
             f" ({removed} no longer kept removed)" if removed else "")
    counts = registry.counts()
    metrics.set_adapter_counts(counts)
    log.info("registry %s: %s", config.db, counts or "empty")
    return store, registry


def create_server(config: StoreConfig, store: AdapterStore | None = None
                  ) -> tuple[grpc.aio.Server, int, object]:
    """The gRPC server (not started) on --listen: (server, port, health servicer)."""
    store = store or build_store(config)[0]
    servicer = AdapterStoreServicer(store, config.chunk_bytes)

    def register(server: grpc.aio.Server) -> list[str]:
        adapter_store_pb2_grpc.add_AdapterStoreServicer_to_server(servicer, server)
        return [SERVICE_NAME]

    flags = config.common
    credentials = common_server.server_credentials(flags.tls_cert, flags.tls_key, flags.tls_ca)
    token = read_token(flags.service_token_file)
    describe("adapter store", token, flags.tls_ca)
    return common_server.create_server(flags.listen, register, credentials,
                                       reflection=flags.reflection, service_token=token)
