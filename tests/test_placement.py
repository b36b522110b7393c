"""Placement: affinity, least loaded among holders, rendezvous stability, load bound, draining,
exclude, spilling a hot adapter (no torch)."""
from __future__ import annotations

import json
from dataclasses import replace

import pytest

from services.router.placement import (NoWorker, WorkerView, choose_worker, load_bound,
                                       needs_two, rendezvous_order, rendezvous_score)

pytestmark = pytest.mark.policy     # torch-free: `make test-policy`


def _idle(n: int) -> dict[str, WorkerView]:
    return {f"w{i}": WorkerView() for i in range(n)}


def test_affinity_prefers_holder_least_loaded_first() -> None:
    workers = {
        "w0": WorkerView(resident={"a"}, running=3),
        "w1": WorkerView(resident={"a"}, running=1),
        "w2": WorkerView(loading={"a"}, running=1),
        "w3": WorkerView(running=0),
    }
    assert choose_worker("a", workers) == "w1"  # resident beats loading at equal load
    workers["w1"].running = 2
    assert choose_worker("a", workers) == "w2"  # loading counts as holding


def test_holder_over_bound_falls_back_to_rendezvous() -> None:
    workers = _idle(4)
    workers["w0"] = WorkerView(resident={"a"}, running=20)
    bound = load_bound(workers, 0.25)
    assert bound == pytest.approx(1.25 * 5 + 1)
    first_non_holder = next(w for w in rendezvous_order("a", workers) if w != "w0")
    assert choose_worker("a", workers) == first_non_holder


def test_rendezvous_owner_used_for_cold_adapter_and_load_bound_skips_it() -> None:
    workers = _idle(5)
    owner, second = rendezvous_order("cold", workers)[:2]
    assert choose_worker("cold", workers) == owner
    for w in workers:
        workers[w].running = 4
    workers[owner].running = 12  # average 4.8: bound 7.0
    assert choose_worker("cold", workers) == second


def test_base_model_goes_to_least_loaded() -> None:
    workers = {"w0": WorkerView(running=2), "w1": WorkerView(running=1, waiting=3),
               "w2": WorkerView(running=2, kv_used=0.1)}
    assert choose_worker(None, workers) == "w0"
    assert choose_worker("", workers, exclude={"w0"}) == "w2"


def test_draining_and_excluded_workers_skipped() -> None:
    workers = {"w0": WorkerView(resident={"a"}, draining=True),
               "w1": WorkerView(resident={"a"}, running=2), "w2": WorkerView()}
    assert choose_worker("a", workers) == "w1"
    assert choose_worker("a", workers, exclude={"w1"}) == "w2"
    with pytest.raises(NoWorker):
        choose_worker("a", workers, exclude={"w1", "w2"})
    with pytest.raises(NoWorker):
        choose_worker(None, {})


def test_rendezvous_stable_adding_a_worker_moves_about_one_in_w() -> None:
    adapters = [f"adapter-{i}" for i in range(4000)]
    before = {a: rendezvous_order(a, _idle(8))[0] for a in adapters}
    after = {a: rendezvous_order(a, _idle(9))[0] for a in adapters}
    moved = [a for a in adapters if before[a] != after[a]]
    assert all(after[a] == "w8" for a in moved)  # only onto the new worker
    assert 0.8 / 9 < len(moved) / len(adapters) < 1.2 / 9
    counts = [sum(1 for w in after.values() if w == f"w{i}") for i in range(9)]
    assert max(counts) < 1.25 * len(adapters) / 9  # and spread evenly


def test_rendezvous_score_is_stable_across_processes() -> None:
    # blake2b, not hash(): a fixed value, whatever PYTHONHASHSEED is
    assert rendezvous_score("a", "w0") == rendezvous_score("a", "w0")
    assert rendezvous_score("a", "w0") == int.from_bytes(
        __import__("hashlib").blake2b(b"w0\x00a", digest_size=8).digest(), "big")


def test_hot_adapter_spills_to_second_worker() -> None:
    workers = {w: WorkerView(running=5) for w in _idle(4)}
    owner, second = rendezvous_order("hot", workers)[:2]
    workers[owner] = WorkerView(resident={"hot"}, running=6, adapter_rows={"hot": 3})
    assert not needs_two("hot", workers, spill_rows=4)
    assert choose_worker("hot", workers, spill_rows=4) == owner
    workers[owner] = WorkerView(resident={"hot"}, running=6, adapter_rows={"hot": 6})
    assert needs_two("hot", workers, spill_rows=4)
    assert choose_worker("hot", workers) == owner  # no spilling asked: affinity wins
    assert choose_worker("hot", workers, spill_rows=4) == second  # its next choice, less loaded
    workers[second] = WorkerView(loading={"hot"}, running=7, adapter_rows={"hot": 1})
    assert choose_worker("hot", workers, spill_rows=4) == owner  # two holders: least loaded


def test_capacity_sim_affinity_and_caps_measured() -> None:
    """The simulator (same policy, placement and gate code) at a small size: affinity raises the
    GPU hit rate over an adapter-blind balancer; caps keep the steady tenants' hit rate up while
    the bursty tenant bursts."""
    from bench.capacity import sim
    from bench.capacity.fleet import FleetConfig
    from bench.capacity.model import LoadTimes, StepModel
    step = StepModel(a0=5.0, a1=0.02, c0=0.3, c1=0.01, k_pre=0.02)
    loads = LoadTimes({"source": (0.03, 0.07), "worker_host": (0.006, 0.02),
                       "store_host": (0.02, 0.05)}, 16 << 20)
    wl = sim.WorkloadConfig(adapters=4000, requests=6000, rate=120, burst_factor=20,
                            prompt=32, output=16)
    fleet = FleetConfig(workers=4, gpu_pool_bytes=48 * 43 << 20, host_pool_bytes=1 << 30)
    blind = sim.synthetic(wl, replace(fleet, placement="least_loaded"), step, loads)
    no_caps = sim.synthetic(wl, replace(fleet, tenant_share=0.0), step, loads)
    caps = sim.synthetic(wl, fleet, step, loads)
    assert caps["gpu_hit_rate"] > blind["gpu_hit_rate"] + 0.1
    assert caps["steady_gpu_hit_in_bursts"] > no_caps["steady_gpu_hit_in_bursts"]


def test_capacity_sim_cli_writes_results(tmp_path) -> None:
    from bench.capacity import sim
    sim.main(["table", "--adapters-list", "2000", "--workers-list", "1,2", "--requests", "1500",
              "--requests-per-worker", "0", "--rate-per-worker", "30", "--out", str(tmp_path)])
    data = json.loads((tmp_path / "capacity_sim.json").read_text())
    assert len(data["runs"]) == 4 and data["header"]["python"] and data["header"]["commit"]
    assert {r["eviction"] for r in data["runs"]} == {"lru", "cost"}
    assert "| 2000 | 1.0 | 4 | 2 | cost |" in (tmp_path / "capacity_sim.md").read_text()
