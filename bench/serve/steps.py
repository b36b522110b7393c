"""The worker's step profile over a scenario: which engine steps the served load made and what
each class of them cost (issue 42: where adapters cost throughput in large mixed batches).

A worker counts its timed steps by class (services/worker/engine/step_profile.py; its Info's
step_profile): kind (decode-graph, mixed-graph, eager), rows (the step's sequences: 1-32, 33-64,
65-128, 129-256, >256), prompt_tokens (tokens of its prompt chunks: 0, 1-512, 513-2048, >2048)
and adapters (distinct: 0, 1-8, 9-32, 33-128, >128). A step's time is the interval from the
previous step's tokens reaching the host to its own, steps after an idle wait left out: with
overlap, the step as served. A scenario's profile is the difference of the workers' Info before
and after it, summed over workers.

A profile, as results keep it (a row's "steps"; the saturation header's "steps" per workload):

    {"steps": N, "seconds": S,          # steps timed and their seconds, every class
     "classes": [                       # largest share first
        {"kind", "rows", "prompt_tokens", "adapters",   # the class's labels, as above
         "steps", "seconds",            # its steps and their seconds
         "mean_ms",                     # seconds / steps, in ms
         "share",                       # its seconds over the profile's seconds (0-1)
         "base_mean_ms", "vs_base"}]}   # against the base model's profile (`against`): its
                                        # mean ms over its steps of the same kind, rows and
                                        # prompt tokens (base steps have no adapters), and
                                        # mean_ms over it (None where base has no such
                                        # step); only in a profile compared to base's

Plain Python on WorkerInfoResponse messages and dicts.
"""
from __future__ import annotations

LABELS = ("kind", "rows", "prompt_tokens", "adapters")
PARTS = ("closed", "goodput")        # the saturation rows a workload's profile sums (steady)


def counts(info) -> dict[tuple, tuple[int, float]]:
    """A WorkerInfoResponse's step profile: labels -> (steps, seconds)."""
    return {(c.kind, c.rows, c.prompt_tokens, c.adapters): (c.steps, c.seconds)
            for c in info.step_profile}


def delta(before: list, after: list, lost: dict | None = None) -> dict:
    """The steps every worker timed between two Info snapshots (lists, one per worker), summed:
    labels -> (steps, seconds). A worker whose id changed or whose counts went down (it was
    restarted) counts from zero; lost: a killed incarnation's Info at the kill by worker index,
    counted up to the kill."""
    total: dict[tuple, tuple[int, float]] = {}
    pairs = list(zip(before, after)) + [(before[i], info) for i, info in (lost or {}).items()]
    for b, a in pairs:
        was, now = counts(b), counts(a)
        if b.worker_id != a.worker_id or any(n < was.get(k, (0, 0.0))[0]
                                             for k, (n, _) in now.items()):
            was = {}
        for key, (n, s) in now.items():
            n0, s0 = was.get(key, (0, 0.0))
            if n > n0:
                t = total.get(key, (0, 0.0))
                total[key] = (t[0] + n - n0, t[1] + s - s0)
    return total


def summary(by_class: dict) -> dict:
    """A profile (see the module doc) from labels -> (steps, seconds)."""
    seconds = sum(s for _, s in by_class.values())
    classes = [{**dict(zip(LABELS, key)), "steps": n, "seconds": round(s, 6),
                "mean_ms": round(1e3 * s / n, 4), "share": round(s / seconds, 4) if seconds
                else None} for key, (n, s) in by_class.items() if n]
    classes.sort(key=lambda c: (-c["seconds"], *(c[k] for k in LABELS)))
    return {"steps": sum(c["steps"] for c in classes), "seconds": round(seconds, 6),
            "classes": classes}


def _by_class(profile: dict | None) -> dict:
    return {tuple(c[k] for k in LABELS): (c["steps"], c["seconds"])
            for c in (profile or {}).get("classes", ())}


def merge(profiles) -> dict:
    """One profile of several (their steps and seconds added class by class)."""
    total: dict[tuple, tuple[int, float]] = {}
    for p in profiles:
        for key, (n, s) in _by_class(p).items():
            t = total.get(key, (0, 0.0))
            total[key] = (t[0] + n, t[1] + s)
    return summary(total)


def against(profile: dict, base: dict) -> dict:
    """The profile with each class's base_mean_ms and vs_base (see the module doc): base's
    steps of the class's kind, rows and prompt tokens, whatever their adapters label."""
    same: dict[tuple, tuple[int, float]] = {}
    for key, (n, s) in _by_class(base).items():
        t = same.get(key[:3], (0, 0.0))
        same[key[:3]] = (t[0] + n, t[1] + s)
    out = []
    for c in profile["classes"]:
        n, s = same.get(tuple(c[k] for k in LABELS[:3]), (0, 0.0))
        b = round(1e3 * s / n, 4) if n else None
        out.append({**c, "base_mean_ms": b, "vs_base": round(c["mean_ms"] / b, 4) if b
                    else None})
    return {**profile, "classes": out}


def by_workload(rows: list[dict]) -> dict[str, dict]:
    """Per workload of a saturation run, the profile of its steady closed-loop rows and goodput
    search (every probe), in the rows' order; each adapter workload's against base's."""
    parts: dict[str, list] = {}
    for r in rows:
        if r.get("state") == "steady" and r.get("mode") in PARTS and r.get("steps"):
            parts.setdefault(r["workload"], []).append(r["steps"])
    out = {w: merge(ps) for w, ps in parts.items()}
    base = out.get("base")
    return {w: against(p, base) if base is not None and w != "base" else p
            for w, p in out.items()}


def _f(x, fmt: str) -> str:
    return "-" if x is None else fmt.format(x)


def table(profile: dict, top: int = 8, compare: bool = False) -> list[str]:
    """Markdown rows of a profile's `top` largest classes (the rest on one line); compare: with
    the base model's mean ms and the ratio (a profile from `against`)."""
    head = "| kind | rows | prompt tokens | adapters | steps | mean ms |"
    head += " base mean ms | vs base |" if compare else ""
    lines = [head + " share of time |", "|" + "---|" * (9 if compare else 7)]
    for c in profile["classes"][:top]:
        cmp = (f" {_f(c.get('base_mean_ms'), '{:.2f}')} | {_f(c.get('vs_base'), '{:.2f}x')} |"
               if compare else "")
        lines.append(f"| {c['kind']} | {c['rows']} | {c['prompt_tokens']} | {c['adapters']} | "
                     f"{c['steps']} | {c['mean_ms']:.2f} |{cmp} {_f(c['share'], '{:.0%}')} |")
    rest = profile["classes"][top:]
    if rest:
        share = sum(c["share"] or 0 for c in rest)
        lines.append(f"| {len(rest)} more classes | | | | {sum(c['steps'] for c in rest)} | |"
                     + (" | |" if compare else "") + f" {share:.0%} |")
    return lines
