"""The capacity simulator's markdown and plots (capacity-validate.md, capacity_sim.{md,png})."""
from __future__ import annotations

import json
from pathlib import Path

COMPARED = ("gpu_hit_rate", "worker_host_hit_rate", "out_tok_s", "req_s", "ttft_p50_ms",
            "ttft_p90_ms", "ttft_p99_ms", "itl_p50_ms", "e2e_p50_ms", "e2e_p99_ms")


def _pct(x: float) -> str:
    return f"{x * 100:+.1f}%"


def validate_md(doc: dict) -> str:
    """capacity-validate.md: predicted against measured, and how the model was calibrated."""
    h, cal = doc["header"], doc["header"]["calibration"]
    lines = [f"# Capacity simulator against the H200 serving benchmark ({h['date']})", "",
             f"Simulator commit {h['commit']}, {h['machine']}, Python {h['python']}, "
             f"{h['seconds']} s. Measured: `serve-h200.json` ({h['serve']['card']}, "
             f"{h['serve']['date']}, commit {h['serve']['commit']}); flags: "
             f"`{' '.join(h['serve']['argv'])}`.", "",
             "| adapters | GPU hit measured | predicted | rel. err | out tok/s measured | "
             "predicted | rel. err |", "|---|---|---|---|---|---|---|"]
    for r in doc["rows"] + doc.get("also", []):
        lines.append(f"| {r['adapters']} | {r['measured_gpu_hit']:.4f} | "
                     f"{r['predicted_gpu_hit']:.4f} | {_pct(r['gpu_hit_rel_err'])} | "
                     f"{r['measured_tok_s']:.0f} | {r['predicted_tok_s']:.0f} | "
                     f"{_pct(r['tok_s_rel_err'])} |")
    lines += ["", "Everything else, measured / predicted:", "",
              "| adapters | " + " | ".join(COMPARED[1:]) + " |",
              "|---|" + "---|" * (len(COMPARED) - 1)]
    for r in doc["rows"] + doc.get("also", []):
        cells = [f"{r['measured'][k]} / {r['predicted'][k]}" for k in COMPARED[1:]]
        lines.append(f"| {r['adapters']} | " + " | ".join(cells) + " |")
    sm = h["step_model"]
    lines += ["", "## The model and its calibration", "",
              f"Step time (ms) = {sm['a0']:.3f} + {sm['a1']:.4f} x rows + [adapters] "
              f"({sm['c0']:.3f} + {sm['c1']:.4f} x distinct) + {sm['k_pre']:.4f} x prefill "
              f"tokens + [prefill in the step] ({sm['e0']:.2f} + [LoRA rows] "
              f"{sm['e_lora']:.2f}).", "",
              f"- The decode terms: least squares over {h['fit']['points']} e2e-bench points "
              f"(`e2e-h200.json`, `ab/e2e-small-*`; batch 1-64, 0-32 adapters; largest "
              f"residual {h['fit']['max_abs_residual_ms']} ms); prefill per token: those runs' "
              "total time less their decode steps.",
              f"- The two serving terms, by bisection on {cal['target']} of the measured rows "
              f"slora-base ({cal['from']['slora-base']} ms) and slora-5 "
              f"({cal['from']['slora-5']} ms) only: a step with prefill costs "
              f"{cal['e0_ms']} ms more (mixed steps run eagerly), {cal['e_lora_ms']} ms more "
              "again with LoRA rows. Nothing is fitted to the 100-2,000-adapter rows.",
              "- Cold loads: lognormal through the p50/p99 of the worker's records per tier "
              f"(s): `{json.dumps(h['load_times_s'])}`, pooled over the serving run's rows.",
              "- The request sequence: serve_bench's own generator from the header's scenarios "
              "and seed, every slora scenario from base to 2,000 in order (warm-up, then the "
              "measured requests) on one simulated worker, as the run kept one worker across "
              "them; hit rates from the policies' counters around the measured phase, as "
              "serve_bench reads the worker's.", ""]
    return "\n".join(lines) + "\n" + _notes(doc)


def _notes(doc: dict) -> str:
    loads = "; ".join(f"{r['adapters']} adapters: {r['loads']['predicted']} against the "
                      f"worker's records {r['loads']['measured']}" for r in doc["rows"])
    lookups = "; ".join(f"{r['adapters']} adapters: {r['lookups']['measured']} counted, "
                        f"{r['lookups']['predicted']} simulated ({r['lookups']['prefetches']} "
                        "prefetch hints)" for r in doc["rows"])
    return f"""## How close, and why

- GPU hit rate: the policy code is the worker's, the adapters' bytes and the pool's budget are
  the run's, and the request sequence is the run's own, so the misses come out nearly exactly:
  cold loads by tier, simulated against the worker's records, {loads}. What remains is the
  counters' denominator: GPU lookups for {doc['rows'][0]['lookups']['requests']} requests
  (the worker's: its misses, one per cold load, over its miss rate), {lookups}. The likeliest
  source of the extra hits: a request queued at the router's gate (256 in flight) sends a
  prefetch hint, whose acquire counts the miss, and the request itself then counts a hit; the
  measured run, with its longer latency tails (below), would have queued there more often than
  the simulated one. That run did not count hints, so this is not confirmed.
- Throughput: out tok/s is tokens / (last end - first send) of an open-loop run at the
  benchmark's rate, so it is set by the arrivals plus the last requests' end-to-end time; the
  prediction is as good as the predicted end-to-end time under load. That is why the serving
  terms are calibrated on the base and 5-adapter rows' median end-to-end time: their out tok/s
  hardly moves with the step time (arrival-bound) and cannot calibrate anything.
- Not predicted well: the TTFT and end-to-end tails (p99), and ITL p50. The measured TTFT p99
  of a second or more with 100+ adapters is queueing the simulator does not have (its worker
  admits a ready request at the next step; the measured worker's tail comes from somewhere
  else: the VTC admission order, the frontend process, host-side stalls). ITL p50: the model
  puts the serving cost on mixed steps only, so its step times are bimodal and its median lands
  on a mixed step; the measured ITL is smoother. Use the simulator for hit rates, load rates and
  throughput; treat its latency tails as a lower bound.
"""


def table_line(r: dict) -> str:
    return (f"{r['adapters']:>7} adapters zipf {r['zipf']} {r['gpu_pool_gib']:g} GiB "
            f"{r['workers']:>3} workers {r['eviction']:>4}: GPU hit "
            f"{r['gpu_hit_rate']:.3f}, {r['out_tok_s']:.0f} tok/s, TTFT p50/p99 "
            f"{r['ttft_p50_ms']}/{r['ttft_p99_ms']} ms, {r['cold_loads_per_s']} loads/s "
            f"({r['sim_s']} s)")


def table_md(doc: dict) -> str:
    h = doc["header"]
    lines = [f"# Capacity simulator: adapters x workers, LRU against cost-aware eviction "
             f"({h['date']})", "",
             f"Commit {h['commit']}, {h['machine']}, Python {h['python']}, {h['seconds']} s.",
             f"Workload: `{json.dumps(h['workload'])}` with the fleet's rate "
             f"{h['rate_per_worker']} req/s per worker; fleet (per worker): "
             f"`{json.dumps(h['fleet'])}`. Figures over the requests after the first 25%.", "",
             "| adapters | zipf | GPU pool GiB | workers | eviction | req/s | GPU hit | joined | "
             "host | store | source | cold loads/s | out tok/s | TTFT p50 / p90 / p99 ms |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in doc["runs"]:
        s = r["hit_share"]
        lines.append(f"| {r['adapters']} | {r['zipf']} | {r['gpu_pool_gib']:g} | {r['workers']} | "
                     f"{r['eviction']} | {r['rate']:.0f} "
                     f"| {s['gpu']:.3f} | {s['joined']:.3f} | {s['worker_host']:.3f} | "
                     f"{s['store_host']:.3f} | {s['source']:.3f} | {r['cold_loads_per_s']} | "
                     f"{r['out_tok_s']:.0f} | {r['ttft_p50_ms']} / {r['ttft_p90_ms']} / "
                     f"{r['ttft_p99_ms']} |")
    lines += ["", "Shares of requests by where their adapter was: on the GPU, joined a load "
              "under way, loaded from the worker's host tier, the store's host tier, the "
              "source. Cold loads/s: loads started, over the fleet. The step model and load "
              "times are those of capacity-validate.md.", ""]
    return "\n".join(lines)


def plot(path: Path, doc: dict) -> bool:
    """GPU hit rate and TTFT p99 against workers, per adapter count and eviction."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    keys = sorted({(r["adapters"], r["zipf"], r["gpu_pool_gib"], r["eviction"])
                   for r in doc["runs"]})
    for ax, (field, label) in zip(axes, (("gpu_hit_rate", "GPU hit rate (requests)"),
                                         ("cold_loads_per_s", "cold loads/s (fleet)"),
                                         ("ttft_p99_ms", "TTFT p99 (ms)"))):
        for a, z, g, ev in keys:
            pts = sorted((r["workers"], r[field]) for r in doc["runs"]
                         if (r["adapters"], r["zipf"], r["gpu_pool_gib"], r["eviction"])
                         == (a, z, g, ev))
            ax.plot(*zip(*pts), marker="o", linestyle="-" if ev == "lru" else "--",
                    label=f"{a:,} adapters, zipf {z}, {g:g} GiB, {ev}")
        ax.set_xscale("log", base=2)
        ax.set(xlabel="workers", ylabel=label)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    h = doc["header"]
    fig.suptitle(f"capacity_sim {h['date']}, commit {h['commit']}: "
                 f"{h['rate_per_worker']} req/s per worker")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
