"""`lorafleet`: the command-line client (see README, operator contract)."""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import grpc
from google.protobuf.json_format import MessageToDict

from services.client.client import LorafleetClient
from services.common.errors import retry_after_of
from services.common.gen.lorafleet.v1 import common_pb2


def _count(text: str, bits: int = 32) -> int:
    """An argparse type: a whole number in [0, 2**bits) (the fields are unsigned)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if not 0 <= value < 1 << bits:
        raise argparse.ArgumentTypeError(f"{value} is out of range (0 to {(1 << bits) - 1})")
    return value


def _seed(text: str) -> int:
    return _count(text, 64)


def _token_ids(text: str) -> list[int]:
    """An argparse type: comma-separated token ids ("1,2,3")."""
    return [_count(x) for x in text.split(",") if x.strip()]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="lorafleet", description="lorafleet client")
    p.add_argument("--router", default=os.environ.get("LORAFLEET_ROUTER", "127.0.0.1:7001"),
                   help="router address (127.0.0.1:7001)")
    p.add_argument("--token", default=os.environ.get("LORAFLEET_TOKEN"),
                   help="bearer token naming your tenant (env LORAFLEET_TOKEN)")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds (120)")
    p.add_argument("--tls-ca", default=None, help="CA to verify the router's TLS certificate")
    p.add_argument("--tls-cert", default=None, help="client certificate (PEM), for mTLS")
    p.add_argument("--tls-key", default=None, help="client private key (PEM), for mTLS")
    sub = p.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("generate", help="generate a completion")
    g.add_argument("prompt", nargs="?", default="", help="prompt text")
    g.add_argument("--adapter", default="", help="adapter id or alias (empty = base model)")
    g.add_argument("--prompt-ids", type=_token_ids, default=[],
                   help="comma-separated prompt token ids")
    g.add_argument("--max-new-tokens", type=_count, default=0, help="0 = server default")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (0)")
    g.add_argument("--top-k", type=_count, default=0)
    g.add_argument("--top-p", type=float, default=0.0)
    g.add_argument("--seed", type=_seed, default=0)
    g.add_argument("--repetition-penalty", type=float, default=0.0)
    g.add_argument("--stop", action="append", default=[], help="stop sequence, repeatable")
    g.add_argument("--stream", action="store_true", help="print tokens as they arrive")
    g.add_argument("--json", action="store_true", help="print one JSON object")
    r = sub.add_parser("register", help="register an adapter (admin)")
    r.add_argument("--id", required=True)
    r.add_argument("--source", required=True, help="file://REL or s3://BUCKET/PREFIX")
    r.add_argument("--tenant", default="", help="owner tenant (empty = shared)")
    r.add_argument("--alias", action="append", default=[], help="alias, repeatable")
    r.add_argument("--replace", action="store_true",
                   help="register a new version of an existing id (its aliases move to it)")
    r.add_argument("--json", action="store_true")
    al = sub.add_parser("alias", help="point an alias at an adapter id or ID@VERSION (admin)")
    al.add_argument("--alias", required=True)
    al.add_argument("--target", required=True,
                    help="an adapter id (its current version) or ID@VERSION (pinned: a rollback)")
    al.add_argument("--json", action="store_true")
    d = sub.add_parser("delete", help="delete an adapter (admin)")
    d.add_argument("--id", required=True)
    a = sub.add_parser("adapters", help="list the adapters you can use (every page)")
    a.add_argument("--json", action="store_true")
    a.add_argument("--page-size", type=lambda t: _count(t, 31), default=0,
                   help="adapters a call (0 = the server's default, 1000; at most 1000)")
    a.add_argument("--owner", default="",
                   help="only this tenant's adapters (an admin of a --tenants file sees its private ones too)")
    a.add_argument("--prefix", default="", help="only ids that start with this")
    a.add_argument("--limit", type=_count, default=None,
                   help="stop after this many adapters (default: all)")
    v = sub.add_parser("versions", help="the versions the store keeps of an adapter")
    v.add_argument("id", help="adapter id (or alias)")
    v.add_argument("--json", action="store_true")
    s = sub.add_parser("stats", help="the four health signals")
    s.add_argument("--json", action="store_true")
    m = sub.add_parser("model", help="the served base model")
    m.add_argument("--json", action="store_true")
    return p


def adapter_dict(a) -> dict:
    return {"id": a.id, "version": a.version, "owner": a.owner, "shared": a.shared,
            "aliases": list(a.aliases), "rank": a.rank, "target_modules": list(a.target_modules),
            "bytes": a.bytes, "state": a.state, "failure_reason": a.failure_reason,
            "source": a.source, "lora_alpha": a.lora_alpha, "use_rslora": a.use_rslora,
            "pinned_aliases": dict(sorted(a.pinned_aliases.items()))}


def versions_dict(resp) -> dict:
    """`versions --json`: the adapter and its kept versions, newest first."""
    return {"id": resp.adapter_id, "owner": resp.owner, "versions": [
        {"version": v.version, "current": v.current, "pinned_aliases": list(v.pinned_aliases),
         "kept": v.kept, "registered_at": v.registered_at, "source": v.source,
         "sha256": v.sha256, "rank": v.rank, "bytes": v.bytes} for v in resp.versions]}


def _versions_text(d: dict) -> str:
    lines = [f"{d['id']} (owner {d['owner'] or '(shared)'}): {len(d['versions'])} versions kept"]
    for v in d["versions"]:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(v["registered_at"]))
        marks = (["current"] if v["current"] else []) + [f"pinned by {a}"
                                                         for a in v["pinned_aliases"]]
        lines.append(f"  {v['version']}  {when}Z  r={v['rank']:<4d} {v['source']}"
                     f"{'' if v['kept'] else '  (bytes not kept)'}"
                     f"{'  ' + ', '.join(marks) if marks else ''}")
    return "\n".join(lines)


def response_dict(resp) -> dict:
    t = resp.timings
    return {"request_id": resp.request_id, "adapter_id": resp.adapter_id,
            "adapter_version": resp.adapter_version, "token_ids": list(resp.token_ids),
            "text": resp.text, "stop_reason": common_pb2.StopReason.Name(resp.stop_reason),
            "usage": {"prompt_tokens": resp.usage.prompt_tokens,
                      "generated_tokens": resp.usage.generated_tokens},
            "timings": {"queue_s": t.queue_s, "cold_load_s": t.cold_load_s,
                        "time_to_first_token_s": t.time_to_first_token_s,
                        "total_s": t.total_s, "adapter_tier": common_pb2.Tier.Name(t.adapter_tier)}}


def stats_dict(s) -> dict:
    return {
        "cache": {c.tier: {"hits": c.hits, "misses": c.misses, "hit_rate": c.hit_rate}
                  for c in s.cache},
        "cold_load_seconds": {c.tier: {"count": c.count, "p50": c.p50, "p95": c.p95, "p99": c.p99}
                              for c in s.cold_load},
        "tenants": {t.tenant: {"requests": t.requests, "tokens_served": t.tokens_served,
                               "prompt_tokens": t.prompt_tokens, "p50_latency_s": t.p50_latency_s,
                               "p99_latency_s": t.p99_latency_s, "throttled": t.throttled}
                    for t in s.tenants},
        "jain_index": s.jain_index,
        "adapters": {"registered": s.adapters.registered, "store_host": s.adapters.store_host,
                     "worker_host": s.adapters.worker_host,
                     "gpu_resident": s.adapters.gpu_resident,
                     "working_set": s.adapters.working_set},
        "workers": s.workers,
    }


def _generate(c: LorafleetClient, args) -> int:
    kw = dict(adapter=args.adapter, prompt_ids=args.prompt_ids, max_new_tokens=args.max_new_tokens,
              temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
              repetition_penalty=args.repetition_penalty, stop=args.stop)
    if args.stream and not args.json:
        for resp in c.generate_stream(args.prompt, **kw):
            print(resp.text, end="", flush=True)
        print()
        return 0
    resp = c.generate(args.prompt, **kw)
    print(json.dumps(response_dict(resp)) if args.json else resp.text)
    return 0


def _stats_text(d: dict) -> str:
    lines = ["cache hit rate:"]
    lines += [f"  {k:12s} {v['hit_rate']:.3f} ({v['hits']} hits, {v['misses']} misses)"
              for k, v in d["cache"].items()]
    lines.append("cold-load seconds (p50 / p95 / p99):")
    lines += [f"  {k:12s} n={v['count']:<5d} {v['p50']:.4f} / {v['p95']:.4f} / {v['p99']:.4f}"
              for k, v in d["cold_load_seconds"].items()]
    lines.append(f"tenants (Jain's index {d['jain_index']:.3f}):")
    lines += [f"  {k:12s} {v['requests']} req, {v['tokens_served']} tok, p50 "
              f"{v['p50_latency_s']:.3f}s p99 {v['p99_latency_s']:.3f}s, throttled "
              f"{v['throttled']}" for k, v in d["tenants"].items()]
    a = d["adapters"]
    lines.append(f"adapters: {a['registered']} registered, {a['store_host']} store-host, "
                 f"{a['worker_host']} worker-host, {a['gpu_resident']} gpu, working set "
                 f"{a['working_set']}")
    return "\n".join(lines)


def _adapters(c: LorafleetClient, args) -> None:
    """Every page (or the first --limit adapters): one JSON object, or a line each as the
    pages come."""
    items = (adapter_dict(a) for a in c.iter_adapters(args.page_size, args.owner, args.prefix,
                                                      args.limit))
    if args.json:
        print(json.dumps({"adapters": list(items)}))
        return
    for a in items:
        print(f"{a['id']:24s} r={a['rank']:<4d} {a['state']:10s} "
              f"owner={a['owner'] or '(shared)'} {a['failure_reason']}")


def run(args) -> int:
    with LorafleetClient(args.router, args.token, args.timeout, args.tls_ca, args.tls_cert,
                         args.tls_key) as c:
        if args.cmd == "generate":
            return _generate(c, args)
        if args.cmd == "register":
            info = c.register(args.id, args.source, args.tenant, args.alias, args.replace)
            print(json.dumps(adapter_dict(info)) if args.json else
                  f"registered {info.id} version {info.version} ({info.state})")
        elif args.cmd == "alias":
            info = c.set_alias(args.alias, args.target)
            print(json.dumps(adapter_dict(info)) if args.json else
                  f"{args.alias} -> {info.id} version {info.version}"
                  + (" (pinned)" if info.pinned else ""))
        elif args.cmd == "delete":
            c.delete(args.id)
            print(f"deleted {args.id}")
        elif args.cmd == "adapters":
            _adapters(c, args)
        elif args.cmd == "versions":
            d = versions_dict(c.versions(args.id))
            print(json.dumps(d) if args.json else _versions_text(d))
        elif args.cmd == "stats":
            d = stats_dict(c.stats())
            print(json.dumps(d) if args.json else _stats_text(d))
        elif args.cmd == "model":
            info = MessageToDict(c.model_info(), preserving_proto_field_name=True)
            print(json.dumps(info) if args.json
                  else "\n".join(f"{k}: {v}" for k, v in info.items()))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.cmd == "generate" and args.prompt and args.prompt_ids:
        parser.error("generate: give --prompt-ids or PROMPT, not both")
    try:
        return run(args)
    except grpc.RpcError as err:
        delay = retry_after_of(err)
        hint = f" (retry in {delay:.2f}s)" if delay is not None and "retry in" not in (
            err.details() or "") else ""
        print(f"error: {err.code().name}: {err.details()}{hint}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
