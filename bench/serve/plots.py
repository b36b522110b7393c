"""The serving benchmark's plots (matplotlib, Agg): throughput and TTFT against adapter count,
and TTFT / ITL CDFs per scenario."""
from __future__ import annotations

import pathlib

import matplotlib.pyplot as plt


def _series(rows: list[dict]) -> dict[str, list[dict]]:
    """One row per scenario, grouped by path and load (scenarios at the same rate or
    concurrency line up), sorted by adapter count; scenarios with a cold stream, and a second
    scenario of a series at the same adapter count, are left out (they are no scaling point)."""
    first: dict[str, dict] = {}
    for r in rows:
        if not r.get("cold_stream_rate"):
            first.setdefault(r["scenario"], r)
    groups: dict[str, dict[int, dict]] = {}
    for r in first.values():
        load = f"rate {r['rate']:g}" if r["rate"] is not None else f"concurrency {r['concurrency']}"
        groups.setdefault(f"{r['path']}, {load}", {}).setdefault(r["adapters"], r)
    return {k: sorted(v.values(), key=lambda r: r["adapters"]) for k, v in groups.items()}


def plot_scaling(path: pathlib.Path, header: dict, rows: list[dict]) -> pathlib.Path | None:
    series = _series(rows)
    if not series:
        return None
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.5))
    for label, rs in series.items():
        xs = [max(r["adapters"], 0) for r in rs]
        (line,) = ax1.plot(xs, [r["out_tok_s"] for r in rs], "-o", label=label)
        color = line.get_color()
        ax2.plot(xs, [r["ttft_p50_ms"] for r in rs], "-o", color=color, label=f"{label}, p50")
        ax2.plot(xs, [r["ttft_p99_ms"] for r in rs], "--^", color=color, label=f"{label}, p99")
    for ax, what in ((ax1, "output tokens/s"), (ax2, "TTFT ms")):
        ax.set_xscale("symlog", linthresh=1)
        ax.set_xlabel("distinct adapters (0 = base model)")
        ax.set_ylabel(what)
        ax.legend(fontsize=7)
    ax2.set_yscale("log")
    fig.suptitle(f"Serving through router + worker + store, {header['card']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_cdfs(path: pathlib.Path, header: dict, cdfs: dict) -> pathlib.Path | None:
    """cdfs: scenario -> {"ttft": [s], "itl": [s]}."""
    if not cdfs:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    for ax, key in zip(axes, ("ttft", "itl")):
        for name, d in cdfs.items():
            xs = sorted(1e3 * x for x in d[key])
            xs = xs[::max(1, len(xs) // 4000)]        # enough points for a smooth curve
            if xs:
                ax.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=name)
        ax.set_xscale("log")
        ax.set_xlabel(f"{key.upper()} ms")
        ax.set_ylabel("fraction of requests" if key == "ttft" else "fraction of gaps")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"TTFT and inter-token latency, {header['card']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
