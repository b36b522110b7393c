"""The router's live status page on its HTTP port: `GET /status` (one self-contained HTML page:
its script and styles inline, charts drawn as inline SVG, nothing fetched from elsewhere) and
`GET /status.json`, which the page polls every POLL_S seconds.

The JSON is GetStats (the four health signals: adapter cache hit rate per tier, cold-load
latency per source tier, per-tenant fairness with Jain's index, adapter counts) with the same
authentication and the same view of tenants (a --tenants file's user sees its own row; the
token comes in the Authorization header or, for a browser, as `?token=` on the page), plus the
workers (address, live, resident counts, load) and the residency (which adapter is where).

The residency lists a user only the adapters the API would let it use: an adapter id appears
when resolving it as that tenant (services.router.resolve, cached, the store-outage fallback
included) answers that adapter, so another tenant's private adapter never appears, as the API
answers NOT_FOUND for it; an admin sees every one. The Workers table's resident counts are each
worker's own figures (its Info: versions on the GPU, adapters in its host tier), the very ones
the Adapters panel sums, so the two agree.
"""
from __future__ import annotations

import asyncio
import json
import time

from aiohttp import web
from google.protobuf.json_format import MessageToDict

from services.common.gen.lorafleet.v1 import common_pb2, router_pb2 as rpb

POLL_S = 2


class _Context:
    """Enough of a grpc.aio.ServicerContext for GetStats: the caller's token."""

    def __init__(self, request: web.Request):
        auth = request.headers.get("Authorization")
        token = request.query.get("token")
        if not auth and token:
            auth = f"Bearer {token}"
        self._metadata = [("authorization", auth)] if auth else []

    def invocation_metadata(self):
        return self._metadata

    def time_remaining(self):
        return 10.0


def workers_view(workers, infos: dict) -> tuple[list[dict], list[dict]]:
    """(workers, residency) from the router's residency view (services.router.workers); the
    resident counts from each worker's last Info (infos: address -> reply), 0 without one
    (as GetStats counts a worker that did not answer)."""
    rows, residency = [], []
    for addr, w in sorted(workers.workers.items()):
        info = infos.get(addr) if w.connected else None
        rows.append({"address": addr, "worker_id": w.worker_id, "live": w.connected,
                     "gpu_resident": info.gpu_resident if info else 0,
                     "host_resident": info.host_resident if info else 0,
                     "running": w.load.running, "waiting": w.load.waiting,
                     "kv_used": round(w.load.kv_used_fraction, 4),
                     "draining": w.load.draining, "in_flight": w.in_flight})
        for a in sorted(w.adapters.values(), key=lambda a: a.id):
            residency.append({"adapter": a.id, "worker": addr,
                              "tier": common_pb2.Tier.Name(a.tier).lower(),
                              "loading": a.loading, "running": a.running,
                              "waiting": a.waiting})
    return rows, residency


async def visible(residency: list[dict], caller, resolver) -> list[dict]:
    """The rows whose adapter the caller may use: all for an admin; for a user, the ids that
    resolve as its tenant to themselves (anything else, NOT_FOUND or no answer, hides it)."""
    if caller.admin:
        return residency
    ids = sorted({r["adapter"] for r in residency})
    answers = await asyncio.gather(*(resolver.resolve(a, caller.tenant, timeout=5)
                                     for a in ids), return_exceptions=True)
    mine = {a for a, ans in zip(ids, answers) if getattr(ans, "id", None) == a}
    return [r for r in residency if r["adapter"] in mine]


async def snapshot(servicer, request: web.Request) -> dict:
    ctx = _Context(request)
    stats = await servicer.GetStats(rpb.GetStatsRequest(), ctx)     # authenticates
    caller = servicer.app.tenants.authenticate(ctx.invocation_metadata())
    out = MessageToDict(stats, preserving_proto_field_name=True,
                        always_print_fields_with_no_presence=True)
    out["workers_live"] = out.pop("workers", 0)
    out["workers"], residency = workers_view(servicer.app.workers,
                                             servicer.app.stats.worker_infos)
    out["residency"] = await visible(residency, caller, servicer.app.resolver)
    out["time"] = time.time()
    out["poll_s"] = POLL_S
    return out


def json_route(servicer):
    """The /status.json handler over this router's servicer."""
    async def status_json(request: web.Request) -> web.Response:
        body = await snapshot(servicer, request)
        return web.Response(text=json.dumps(body), content_type="application/json",
                            headers={"Cache-Control": "no-store"})
    return status_json


async def page(request: web.Request) -> web.Response:
    return web.Response(text=PAGE.replace("__POLL_MS__", str(POLL_S * 1000)),
                        content_type="text/html", headers={"Cache-Control": "no-store"})


PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>lorafleet status</title>
<style>
body{font:14px/1.4 system-ui,sans-serif;margin:16px;color:#1b1f24;background:#f6f8fa}
h1{font-size:20px;margin:0 0 4px}h2{font-size:15px;margin:18px 0 6px}
.grid{display:grid;grid-template-columns:1fr 1fr;gap:12px}
.card{background:#fff;border:1px solid #d0d7de;border-radius:6px;padding:10px}
table{border-collapse:collapse;width:100%}td,th{padding:3px 6px;border-bottom:1px solid #eaeef2;
text-align:right}td:first-child,th:first-child{text-align:left}.big{font-size:26px;font-weight:600}
.ok{color:#1a7f37}.bad{color:#cf222e}#err{color:#cf222e}svg{display:block}
</style></head><body>
<h1>lorafleet router</h1><div id="meta">loading...</div><div id="err"></div>
<div class="grid">
<div class="card"><h2>Adapter cache hit rate per tier</h2><div id="hit"></div>
<svg id="hitchart" width="580" height="150"></svg></div>
<div class="card"><h2>Cold-load latency (p50 / p95, ms)</h2><div id="cold"></div>
<svg id="coldchart" width="580" height="150"></svg></div>
<div class="card"><h2>Per-tenant fairness</h2>
<div>Jain's index <span id="jain" class="big"></span></div><div id="tenants"></div>
<svg id="tokchart" width="580" height="150"></svg></div>
<div class="card"><h2>Adapters</h2><div id="adapters"></div>
<svg id="adchart" width="580" height="150"></svg></div>
</div>
<h2>Workers</h2><div class="card" id="workers"></div>
<h2>Residency</h2><div class="card" id="residency"></div>
<script>
"use strict";
const POLL_MS = __POLL_MS__, KEEP = 90, history = [];
const COLORS = ["#0969da", "#1a7f37", "#bf8700", "#cf222e", "#8250df", "#57606a"];
const token = new URLSearchParams(location.search).get("token");
function esc(s) { return String(s).replace(/[&<>"]/g, c => ({"&": "&amp;", "<": "&lt;",
  ">": "&gt;", '"': "&quot;"})[c]); }
function table(cols, rows) {
  return "<table><tr>" + cols.map(c => "<th>" + esc(c[0]) + "</th>").join("") + "</tr>" +
    rows.map(r => "<tr>" + cols.map(c => "<td>" + esc(c[1](r)) + "</td>").join("") + "</tr>")
      .join("") + "</table>";
}
function pct(x) { return (100 * (x || 0)).toFixed(1) + "%"; }
function ms(x) { return (1000 * (x || 0)).toFixed(1); }
function svg(el, parts) { document.getElementById(el).innerHTML = parts.join(""); }
function lines(el, series, ymax) {
  const W = 560, H = 120, out = [`<line x1="30" y1="${H}" x2="${W}" y2="${H}" stroke="#999"/>`];
  out.push(`<text x="0" y="10" font-size="10">${ymax.toFixed(2)}</text>`);
  series.forEach((s, i) => {
    const pts = s.values.map((v, j) => `${30 + j * (W - 30) / (KEEP - 1)},` +
      `${H - H * Math.min(v, ymax) / (ymax || 1)}`).join(" ");
    out.push(`<polyline fill="none" stroke="${COLORS[i % 6]}" stroke-width="2" points="${pts}"/>`);
    out.push(`<text x="${40 + i * 110}" y="${H + 22}" font-size="11" ` +
      `fill="${COLORS[i % 6]}">${esc(s.name)}</text>`);
  });
  svg(el, out);
}
function bars(el, items, fmt) {
  const W = 560, H = 120, max = Math.max(1e-9, ...items.map(i => i.value)), out = [];
  const bw = Math.max(4, Math.min(60, (W - 30) / Math.max(1, items.length) - 6));
  items.forEach((it, i) => {
    const h = H * it.value / max, x = 30 + i * (bw + 6);
    out.push(`<rect x="${x}" y="${H - h}" width="${bw}" height="${h}" fill="${COLORS[i % 6]}"/>`);
    out.push(`<text x="${x}" y="${H + 12 + 10 * (i % 2)}" font-size="10">${esc(it.name)}</text>`);
    if (it.value > 0) out.push(`<text x="${x}" y="${Math.max(10, H - h - 2)}" font-size="10">` +
      `${esc(fmt(it.value))}</text>`);
  });
  svg(el, out);
}
function render(s) {
  const cache = s.cache || [], cold = s.cold_load || [], tenants = s.tenants || [];
  history.push(s); while (history.length > KEEP) history.shift();
  document.getElementById("meta").textContent = `workers live ${s.workers_live} of ` +
    `${s.workers.length}; updated ${new Date(s.time * 1000).toLocaleTimeString()}`;
  document.getElementById("hit").innerHTML = table([["tier", r => r.tier],
    ["hits", r => r.hits], ["misses", r => r.misses], ["hit rate", r => pct(r.hit_rate)]], cache);
  lines("hitchart", cache.map(c => ({name: c.tier, values: history.map(h =>
    ((h.cache || []).find(x => x.tier === c.tier) || {}).hit_rate || 0)})), 1);
  document.getElementById("cold").innerHTML = table([["source tier", r => r.tier],
    ["loads", r => r.count], ["p50 ms", r => ms(r.p50)], ["p95 ms", r => ms(r.p95)]], cold);
  bars("coldchart", cold.flatMap(c => [{name: c.tier + " p50", value: 1000 * (c.p50 || 0)},
    {name: "p95", value: 1000 * (c.p95 || 0)}]), v => v.toFixed(1));
  document.getElementById("jain").textContent = (s.jain_index || 0).toFixed(3);
  document.getElementById("tenants").innerHTML = table([["tenant", r => r.tenant],
    ["requests", r => r.requests], ["tokens", r => r.tokens_served || 0],
    ["p50 s", r => (r.p50_latency_s || 0).toFixed(3)],
    ["p99 s", r => (r.p99_latency_s || 0).toFixed(3)], ["throttled", r => r.throttled || 0]],
    tenants);
  bars("tokchart", tenants.map(t => ({name: t.tenant, value: Number(t.tokens_served || 0)})),
    v => String(v));
  const a = s.adapters || {};
  const counts = ["registered", "store_host", "worker_host", "gpu_resident", "working_set"];
  document.getElementById("adapters").innerHTML = table([["count", r => r],
    ["adapters", r => a[r] || 0]], counts);
  lines("adchart", counts.map(k => ({name: k, values: history.map(h =>
    Number((h.adapters || {})[k] || 0))})),
    Math.max(1, ...history.flatMap(h => counts.map(k => Number((h.adapters || {})[k] || 0)))));
  document.getElementById("workers").innerHTML = table([["address", r => r.address],
    ["live", r => r.live ? "yes" : "no"], ["gpu_resident", r => r.gpu_resident],
    ["worker_host", r => r.host_resident], ["running", r => r.running],
    ["waiting", r => r.waiting], ["KV used", r => pct(r.kv_used)]], s.workers);
  document.getElementById("residency").innerHTML = table([["adapter", r => r.adapter],
    ["worker", r => r.worker], ["tier", r => r.tier + (r.loading ? " (loading)" : "")],
    ["running", r => r.running], ["waiting", r => r.waiting]], s.residency);
}
async function poll() {
  try {
    const r = await fetch("status.json", {headers: token ? {Authorization: "Bearer " + token}
      : {}, cache: "no-store"});
    if (!r.ok) throw new Error("status.json: HTTP " + r.status);
    render(await r.json());
    document.getElementById("err").textContent = "";
  } catch (e) { document.getElementById("err").textContent = String(e); }
  setTimeout(poll, POLL_MS);
}
poll();
</script></body></html>
"""
