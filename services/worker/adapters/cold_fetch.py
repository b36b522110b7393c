"""A cold load's fetch (services.worker.adapters.manager): the store streams the adapter straight
into a worker host-tier reservation, the host tier checks its header and plans its layout. Runs
on a loader thread; the job's record gets the stages' times."""
from __future__ import annotations

import time

from services.common.gen.lorafleet.v1 import common_pb2
from services.common.telemetry import tracer
from services.worker import metrics
from services.worker.adapters.cold_records import ColdJob
from services.worker.adapters.host_tier import HostTier
from services.worker.adapters.layout import StagedAdapter
from services.worker.adapters.store_client import StoreClient

_tracer = tracer("lorafleet.worker")


def fetch(job: ColdJob, host: HostTier, store: StoreClient, pinned: bool) -> StagedAdapter:
    """The adapter of job, fetched and staged in the host tier (the evictions that made room
    in job.host_victims). pinned: the version was asked for by name."""
    metrics.count_lookup("worker_host", False)
    remaining = None if job.deadline is None else max(0.01, job.deadline - time.monotonic())
    rec, reserved = job.record, []

    def reserve(nbytes: int):
        res, victims = host.reserve(job.key, job.tenant, nbytes)
        job.host_victims += victims
        reserved.append(res)
        return res
    with _tracer.start_as_current_span("lora.store_fetch") as span:
        try:
            fetched, res = store.fetch(job.adapter_id, job.version, remaining, reserve,
                                       pinned=pinned)
        except BaseException:
            for res in reserved:
                host.abort(res)
            raise
        span.set_attributes({"lora.bytes": res.view.numel(), "lora.source_tier":
                             common_pb2.Tier.Name(fetched.tier), "lora.shm": fetched.shm})
    rec.tier, rec.fetch_s, rec.digest_s = fetched.tier, fetched.fetch_s, fetched.digest_s
    rec.source_s, rec.bytes = fetched.source_s, res.view.numel()
    t = time.monotonic()
    with _tracer.start_as_current_span("lora.validate") as span:   # header + layout plan
        span.set_attribute("lora.bytes", res.view.numel())
        staged = host.commit(res, fetched.config)
    rec.layout_s = time.monotonic() - t
    job.host_added = res.cached
    return staged
