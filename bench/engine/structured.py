"""Structured output's cost in the engine: the decode step with 0%, 50% and 100% of a batch's
rows constrained by a JSON schema, the host time of the token masks a step, and the compile
time of a set of schemas.

The engine in process (as bench.engine.e2e runs it): on a GPU a Llama-2-7B-shaped model
with random bf16 weights, decode steps replayed from CUDA graphs with the overlap on, batch 64,
every row sampling at temperature 1 (constrained or not, so only the mask differs), prompts of
128 tokens and 128 new tokens; the decode step is the median wall time of the engine steps
while all 64 rows decode. A row's schema (64 or more records of an integer, an enum and two
bounded strings) lets a sampled model go on for the whole run, so the batch stays full. The tokenizer is a byte-level
BPE trained here on a synthetic corpus (--vocab tokens, 32000 by default: Llama 2's size; the
mask's cost grows with the vocabulary), or a real one with --tokenizer tokenizer.json.

Per fraction: the median decode step, its ratio to the unconstrained one, the host time per
step computing masks (llguidance's executor, --mask-threads) and advancing matchers, and on the
GPU the graphs' device time per step (when the mask takes less host time than the device step,
it is computed while the device runs: the step should not grow). Compile: each schema of a set
(objects, arrays, enums, nested, bounded strings; and two large ones), uncached, with its first
mask.

    python -m bench.engine.structured                       # on the H100/H200: bench/results
    python -m bench.engine.structured --cpu --out /tmp/s    # a tiny shape on the CPU (tests)

Writes OUT/structured-<card>.{json,md} (date, card, versions, commit; `cpu` under --cpu).
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import pathlib
import random
import statistics
import sys
import time

import torch

from bench.lib.header import RESULTS, base_header, card_slug
from bench.lib.synthetic import llama7b_spec, random_weights
from services.common.gen.lorafleet.v1 import common_pb2
from services.worker.api.grammar import GrammarCompiler
from services.worker.config import GrammarOptions
from services.worker.engine.sequence import Sampling, Sequence, Stopping
from services.worker.model.spec import ModelSpec
from services.worker.config import EngineOptions
from services.worker.startup.factory import assemble

# a row's schema: records with integers, enums and bounded strings, at least 64 of them, so a
# sampled row never ends it within a run (the batch stays full)
LONG = {"type": "array", "minItems": 64, "items": {"type": "object", "properties": {
    "id": {"type": "integer"}, "name": {"type": "string", "maxLength": 24},
    "kind": {"enum": ["alpha", "beta", "gamma"]}, "note": {"type": "string", "maxLength": 48}},
    "required": ["id", "name", "kind", "note"], "additionalProperties": False}}


# the CPU shape: 2 layers, hidden 128, 4 heads (MHA) of 32, fp32
CPU_SHAPE = {"hidden_size": 128, "intermediate_size": 256, "num_layers": 2, "num_heads": 4,
             "num_kv_heads": 4, "head_dim": 32, "torch_dtype": "float32"}


def spec_for(vocab: int, cpu: bool) -> ModelSpec:
    """Llama-2-7B's spec (bench.lib.synthetic) with the tokenizer's vocabulary on a GPU; on the
    CPU that spec in a 2-layer 128-wide shape."""
    return dataclasses.replace(llama7b_spec(), vocab_size=vocab, name="structured-bench",
                               **(CPU_SHAPE if cpu else {}))


def synthetic_tokenizer(vocab: int, seed: int = 0) -> str:
    """A byte-level BPE of `vocab` tokens trained on made-up words, JSON and numbers (its
    tokenizer.json text); ids 0-2 are <unk>, <s>, </s>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    rng = random.Random(seed)
    sylls = [a + b for a in "bcdfghjklmnprstvwz" for b in ("a", "e", "i", "o", "u", "ai", "ou")]
    words = ["".join(rng.choice(sylls) for _ in range(rng.randint(1, 4)))
             for _ in range(max(2000, vocab))]

    def lines():
        for _ in range(max(20000, 4 * vocab)):
            w = rng.sample(words, 6)
            yield (f'{{"{w[0]}": "{w[1]} {w[2]}", "n": {rng.randint(0, 99999)}, '
                   f'"list": ["{w[3]}", "{w[4]}"]}} {w[5].capitalize()} {rng.random():.4f}.')
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(lines(), trainer)
    return tok.to_str()


def schemas(n: int) -> list[dict]:
    """n varied schemas (as the structured-output tests make them) and two large ones."""
    out = []
    for i in range(n):
        rng = random.Random(i)
        props = {f"f{j}": rng.choice([{"type": "string", "maxLength": rng.randint(1, 40)},
                                      {"type": "integer", "minimum": 0, "maximum": 10 ** j},
                                      {"enum": [f"v{k}" for k in range(rng.randint(2, 9))]},
                                      {"type": "array", "items": {"type": "number"},
                                       "maxItems": 5},
                                      {"type": "object", "properties": {
                                          "a": {"type": "boolean"}, "b": {"type": "string"}},
                                       "required": ["a"]}])
                 for j in range(rng.randint(2, 8))}
        out.append({"type": "object", "properties": props, "required": sorted(props)[:2],
                    "additionalProperties": False})
    wide = {"type": "object", "properties": {f"field_{k}": {"type": "string", "maxLength": 64}
                                             for k in range(200)}, "additionalProperties": False}
    return out + [wide, {"type": "array", "items": wide}, LONG]


def build(args, tok_json: str):
    from tokenizers import Tokenizer
    tokenizer = Tokenizer.from_str(tok_json)
    vocab = -(-tokenizer.get_vocab_size() // 64) * 64
    device = torch.device("cpu" if args.cpu else "cuda")
    dtype = torch.float32 if args.cpu else torch.bfloat16
    spec = spec_for(vocab, args.cpu)
    opts = EngineOptions(device=device.type, dtype="float32" if args.cpu else "bfloat16",
                         kv_cache_bytes=(64 << 20) if args.cpu else (16 << 30),
                         max_batch_tokens=4096, max_running=max(64, args.batch),
                         pool_bytes=1 << 20, pool_slots=4, graph_mixed_tokens=0,
                         grammar_mask_threads=args.mask_threads)
    built = assemble(spec, random_weights(spec, device, dtype), tokenizer, opts, device, dtype)
    return built, GrammarCompiler(tok_json, vocab, (2,), GrammarOptions())


def decode_run(built, grammars, args, fraction: float) -> dict:
    """One batch to the end; the decode steps while every row runs."""
    eng, masks = built.engine, built.masks
    g = torch.Generator().manual_seed(1)
    grammar = common_pb2.Grammar(json_schema=json.dumps(LONG))
    constrained = round(fraction * args.batch)
    matchers = asyncio.run(_matchers(grammars, grammar, constrained))
    done = []
    for i in range(args.batch):
        m = matchers[i] if i < constrained else None
        seq = Sequence(f"b{fraction}-{i}", torch.randint(3, built.spec.vocab_size - 1,
                                                         (args.prompt,), generator=g).tolist(),
                       sampling=Sampling(temperature=1.0, seed=i + 1, constrained=m is not None),
                       stopping=Stopping(max_new_tokens=args.new, ignore_eos=True), matcher=m)
        eng.submit(seq, lambda ev, d=done: ev.stop and d.append(ev))
    timings = getattr(eng.runner, "timings", "none")
    if timings != "none":
        eng.runner.timings = []
    mask0, adv0, n0 = masks.mask_seconds, masks.advance_seconds, masks.masks
    steps = []
    while len(done) < args.batch:
        t0 = time.perf_counter()
        full = len(eng.scheduler.running) == args.batch
        eng.step()
        steps.append((time.perf_counter() - t0, full))
    decode = [t for t, full in steps if full][3:]
    n = max(1, masks.masks - n0)
    row = {"fraction": fraction, "constrained_rows": constrained,
           "decode_step_ms": 1e3 * statistics.median(decode) if decode else None,
           "decode_steps": len(decode), "mask_ms": 1e3 * (masks.mask_seconds - mask0) / n,
           "advance_ms": 1e3 * (masks.advance_seconds - adv0) / n,
           "ended_early": sum(1 for ev in done if ev.generated_tokens < args.new)}
    if timings != "none":
        torch.cuda.synchronize()
        gpu = [s.elapsed_time(e) for b, s, e in eng.runner.timings if b >= args.batch]
        row["graph_device_ms"] = statistics.median(gpu) if gpu else None
        eng.runner.timings = None
    return row


async def _matchers(grammars, grammar, n: int) -> list:
    return [await grammars.matcher(grammar) for _ in range(n)]


def compile_rows(grammars, vocab: int, count: int) -> list[dict]:
    """Each schema compiled uncached, and its first mask (llguidance builds lexer states
    lazily)."""
    from llguidance.torch import allocate_token_bitmask, fill_next_token_bitmask
    from services.worker.api.grammar import grammar_text
    rows = []
    for i, schema in enumerate(schemas(count)):
        text = grammar_text(common_pb2.Grammar(json_schema=json.dumps(schema)))[1]
        t0 = time.perf_counter()
        m = grammars.compile_now("json_schema", text)
        t1 = time.perf_counter()
        fill_next_token_bitmask(m, allocate_token_bitmask(1, vocab))
        rows.append({"schema": i, "bytes": len(json.dumps(schema)),
                     "compile_ms": 1e3 * (t1 - t0),
                     "first_mask_ms": 1e3 * (time.perf_counter() - t1)})
    return rows


def header(args, vocab: int) -> dict:
    """bench.lib.header's (the card `cpu` under --cpu) with the versions this one reports at
    its top and the run's settings."""
    import llguidance
    head = base_header("cpu" if args.cpu else "cuda")
    versions = {**head["versions"], "llguidance": llguidance.__version__}
    return {**head, "card": "cpu" if args.cpu else head["card"], "versions": versions,
            "torch": torch.__version__, "triton": versions.get("triton"),
            "llguidance": llguidance.__version__, "python": versions["python"],
            "batch": args.batch, "prompt": args.prompt, "new": args.new,
            "vocab": vocab, "tokenizer": args.tokenizer or f"synthetic BPE ({args.vocab})",
            "mask_threads": args.mask_threads or "auto",
            "model": "2 layers, hidden 128, fp32 (CPU)" if args.cpu else
                     "Llama-2-7B shape, random bf16, CUDA graphs, overlap on"}


def write(out: pathlib.Path, head: dict, decode: list[dict], compiles: list[dict]) -> pathlib.Path:
    out.mkdir(parents=True, exist_ok=True)
    device = "cpu" if head["card"] == "cpu" else "cuda"
    stem = out / f"structured-{card_slug(head['card'], device)}"
    stem.with_suffix(".json").write_text(json.dumps(
        {"header": head, "decode": decode, "compile": compiles}, indent=1))
    base = decode[0]["decode_step_ms"] or float("nan")
    lines = [f"# Structured output, {head['card']}, {head['date']}", "",
             f"{head['model']}; batch {head['batch']}, prompt {head['prompt']}, {head['new']} "
             f"new tokens, temperature 1 on every row; vocabulary {head['vocab']} "
             f"({head['tokenizer']}); mask threads {head['mask_threads']}. torch {head['torch']}"
             f", triton {head['triton']}, llguidance {head['llguidance']}, python "
             f"{head['python']}, commit {head['commit']}.", "",
             "| rows constrained | decode step ms | vs 0% | mask ms/step (host) | "
             "advance ms/step (host) | graph device ms/step | rows ended early |",
             "|---|---|---|---|---|---|---|"]
    for r in decode:
        ms = r["decode_step_ms"] or float("nan")
        dev = r.get("graph_device_ms")
        lines.append(f"| {100 * r['fraction']:.0f}% ({r['constrained_rows']}) | {ms:.2f} | "
                     f"{ms / base:.3f}x | {r['mask_ms']:.3f} | {r['advance_ms']:.3f} | "
                     f"{'-' if dev is None else f'{dev:.2f}'} | {r['ended_early']} |")
    c = [r["compile_ms"] for r in compiles]
    f = [r["first_mask_ms"] for r in compiles]
    lines += ["", f"Compile, {len(compiles)} schemas (uncached; {len(compiles) - 3} varied, a "
              f"200-field object, an array of it, the decode rows' schema): median "
              f"{statistics.median(c):.2f} ms, max {max(c):.2f} ms; first mask median "
              f"{statistics.median(f):.2f} ms, max {max(f):.2f} ms.", "",
              "| schema | bytes | compile ms | first mask ms |", "|---|---|---|---|"]
    lines += [f"| {r['schema']} | {r['bytes']} | {r['compile_ms']:.2f} | "
              f"{r['first_mask_ms']:.2f} |" for r in compiles]
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    return stem.with_suffix(".md")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=str(RESULTS))
    p.add_argument("--cpu", action="store_true", help="a tiny shape on the CPU (a smoke run)")
    p.add_argument("--tokenizer", default="", help="a tokenizer.json (default: synthetic BPE)")
    p.add_argument("--vocab", type=int, default=0, help="synthetic BPE size (32000; CPU 2000)")
    p.add_argument("--batch", type=int, default=0, help="rows (64; CPU 8)")
    p.add_argument("--prompt", type=int, default=0, help="prompt tokens (128; CPU 16)")
    p.add_argument("--new", type=int, default=0, help="new tokens (128; CPU 24)")
    p.add_argument("--mask-threads", type=int, default=0,
                   help="the worker's --grammar-mask-threads (0: its auto: 4 on a GPU, 1 CPU)")
    p.add_argument("--schemas", type=int, default=0, help="varied schemas compiled (40; CPU 5)")
    a = p.parse_args(argv)
    a.vocab = a.vocab or (2000 if a.cpu else 32000)
    a.batch, a.prompt = a.batch or (8 if a.cpu else 64), a.prompt or (16 if a.cpu else 128)
    a.new, a.schemas = a.new or (24 if a.cpu else 128), a.schemas or (5 if a.cpu else 40)
    if a.cpu:
        torch.set_num_threads(1)                 # as a CPU worker runs (--cpu-threads 1)
    tok_json = (pathlib.Path(a.tokenizer).read_text() if a.tokenizer
                else synthetic_tokenizer(a.vocab))
    built, grammars = build(a, tok_json)
    decode_run(built, grammars, a, 0.0)                     # warm: first steps, sampling
    decode = [decode_run(built, grammars, a, f) for f in (0.0, 0.5, 1.0)]
    for r in decode:
        print(json.dumps(r), flush=True)
    compiles = compile_rows(grammars, built.spec.vocab_size, a.schemas)
    md = write(pathlib.Path(a.out), header(a, built.spec.vocab_size), decode, compiles)
    print(md.read_text())
    grammars.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
