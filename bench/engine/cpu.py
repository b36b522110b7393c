"""Engine decode throughput on this CPU: base-only batches against batches spread over 1, 8 and 32
distinct LoRA adapters (random rank-16 q/k/v/o adapters placed in the engine's DevicePool).

    python -m bench.engine.cpu [--model models/tiny-llama] [--out bench/results] [--threads 1]
                                 [--profile]

Each scenario submits --batch sequences of --prompt random tokens with --new new tokens (ignore_eos)
to a fresh engine built by services.worker.startup.factory.build_engine, steps it by hand and times
every step; a decode step is one where every running sequence feeds exactly one token. Reported:
median ms per decode step and decode tokens/s (batch / median step), plus the
end-to-end tokens/s of the whole run (prefill included); the fastest of --repeats runs, as the
machine may be shared. The model is models/tiny-llama when it has been generated (`make`), else a
random Llama of the same shape. --profile adds the top functions of one 32-adapter decode step
(cProfile) to the results.
Writes OUT/engine-cpu.json and OUT/engine-cpu.md.
"""
from __future__ import annotations

import argparse
import cProfile
import datetime
import io
import json
import os
import pathlib
import platform
import pstats
import statistics
import tempfile
import time

import torch

from bench.lib.header import RESULTS, ROOT
from bench.lib.synthetic import SHAPES, adapter_tensors
from services.worker.adapters.layout import staged_from_tensors
from services.worker.engine.sequence import Sequence, Stopping
from services.worker.config import EngineOptions
from services.worker.startup.factory import build_engine

SCENARIOS = {"base-only": 0, "1 adapter": 1, "8 adapters": 8, "32 adapters": 32}
TINY = {k: v for k, v in SHAPES["tiny"].items() if k != "torch_dtype"}     # the demo model's


def random_model(path: pathlib.Path) -> pathlib.Path:
    """A random Llama checkpoint of the tiny default's shape (when models/ is not generated)."""
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, models, pre_tokenizers
    g = torch.Generator().manual_seed(0)
    h, i, n, v = (TINY[k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers",
                                    "vocab_size"))
    q, kv = TINY["num_attention_heads"] * 32, TINY["num_key_value_heads"] * 32
    shapes = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,),
              "lm_head.weight": (v, h)}
    for layer in range(n):
        p = f"model.layers.{layer}."
        shapes.update({p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight":
                       (h,), p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight":
                       (kv, h), p + "self_attn.v_proj.weight": (kv, h),
                       p + "self_attn.o_proj.weight": (h, q), p + "mlp.gate_proj.weight": (i, h),
                       p + "mlp.up_proj.weight": (i, h), p + "mlp.down_proj.weight": (h, i)})
    tensors = {k: (torch.ones(s) if len(s) == 1 else torch.randn(s, generator=g) * 0.02)
               for k, s in shapes.items()}
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "rms_norm_eps": 1e-5,
           "rope_theta": 10000.0, "eos_token_id": 2, "bos_token_id": 1, **TINY}
    (path / "config.json").write_text(json.dumps(cfg))
    tok = Tokenizer(models.WordLevel({f"t{k}": k for k in range(v)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(path / "tokenizer.json"))
    return path


def build(model_dir: pathlib.Path, args, n_adapters: int):
    """A fresh engine with n_adapters random adapters placed; returns (built, slots)."""
    tokens = args.batch * (args.prompt + args.new)
    opts = EngineOptions(device="cpu", dtype="float32", kv_cache_bytes=64 << 20, block_size=16,
                         max_batch_tokens=max(1024, args.batch * args.prompt),
                         max_running=max(64, args.batch), pool_bytes=64 << 20,
                         pool_slots=64, max_model_len=max(512, tokens))
    built = build_engine(model_dir, opts)
    config = {"r": args.rank, "lora_alpha": 2 * args.rank}
    slots = [built.pool.place(f"a{i}", staged_from_tensors(
                 adapter_tensors(built.spec, args.rank, i, std=0.05), config, built.spec))
             for i in range(n_adapters)]
    return built, slots


def run_scenario(model_dir: pathlib.Path, args, n_adapters: int, profile: bool = False):
    built, slots = build(model_dir, args, n_adapters)
    engine, sched = built.engine, built.engine.scheduler
    g = torch.Generator().manual_seed(1)
    for i in range(args.batch):
        prompt = torch.randint(4, built.spec.vocab_size, (args.prompt,), generator=g).tolist()
        slot = slots[i % n_adapters] if n_adapters else -1
        seq = Sequence(f"s{i}", prompt, slot=slot,
                       stopping=Stopping(max_new_tokens=args.new, ignore_eos=True))
        engine.submit(seq, lambda ev: None)
    decode_ms, top = [], None
    start = time.perf_counter()
    while True:
        decoding = (not sched.waiting and sched.running
                    and all(s.is_decoding for s in sched.running))
        prof = cProfile.Profile() if profile and decoding and len(decode_ms) == 8 else None
        t0 = time.perf_counter()
        if prof:
            prof.enable()
        if not engine.step():
            break
        dt = time.perf_counter() - t0
        if prof:
            prof.disable()
            top = _top(prof)
        if decoding:
            decode_ms.append(dt * 1e3)
    wall = time.perf_counter() - start
    med = statistics.median(decode_ms)
    return {"adapters": n_adapters, "decode_steps": len(decode_ms),
            "ms_per_decode_step_median": round(med, 3),
            "ms_per_decode_step_p90": round(statistics.quantiles(decode_ms, n=10)[-1], 3),
            "decode_tokens_per_s": round(args.batch * 1e3 / med, 1),
            "end_to_end_tokens_per_s": round(engine.tokens_generated / wall, 1),
            "wall_s": round(wall, 2)}, top


def _top(prof: cProfile.Profile, n: int = 15) -> list[str]:
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats(n)
    return [line for line in s.getvalue().splitlines() if line.strip()][-n - 1:]


def cpu_model() -> str:
    for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def write(out: pathlib.Path, result: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "engine-cpu.json").write_text(json.dumps(result, indent=2) + "\n")
    base = result["scenarios"]["base-only"]["ms_per_decode_step_median"]
    lines = [f"# Engine decode on CPU ({result['date']})", "",
             f"{result['cpu']}, {result['threads']} torch thread(s), torch {result['torch']}, "
             f"load average {result['load_average_before']:.1f} at start, best of "
             f"{result['repeats']} runs; "
             f"model {result['model']}; {result['batch']} sequences x {result['prompt_tokens']} "
             f"prompt + {result['new_tokens']} new tokens; rank-{result['rank']} q/k/v/o "
             "adapters.", "",
             "| batch | ms / decode step (median) | decode tok/s | vs base-only "
             "| end-to-end tok/s |",
             "| --- | ---: | ---: | ---: | ---: |"]
    for name, r in result["scenarios"].items():
        lines.append(f"| {name} | {r['ms_per_decode_step_median']:.2f} | "
                     f"{r['decode_tokens_per_s']:.0f} | "
                     f"{r['ms_per_decode_step_median'] / base:.2f}x | "
                     f"{r['end_to_end_tokens_per_s']:.0f} |")
    if result.get("profile_32_adapters"):
        lines += ["", "One 32-adapter decode step under cProfile (cumulative):", "", "```",
                  *result["profile_32_adapters"], "```"]
    (out / "engine-cpu.md").write_text("\n".join(lines) + "\n")


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=str(ROOT / "models" / "tiny-llama"))
    p.add_argument("--out", default=str(RESULTS))
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--prompt", type=int, default=32)
    p.add_argument("--new", type=int, default=64)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--threads", type=int, default=1,
                   help="torch intra-op threads (1: steadiest on a shared machine)")
    p.add_argument("--repeats", type=int, default=3,
                   help="runs per scenario; the fastest is kept (the machine is shared)")
    p.add_argument("--profile", action="store_true")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    model = pathlib.Path(args.model)
    tmp = None
    if not (model / ".complete").exists() and not (model / "model.safetensors").exists():
        tmp = tempfile.TemporaryDirectory(prefix="engine-bench-")
        model = random_model(pathlib.Path(tmp.name) / "random-tiny-llama")
    result = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "cpu": cpu_model(), "threads": torch.get_num_threads(), "torch": torch.__version__,
              "model": model.name if tmp is None else "random (tiny-llama shape)",
              "batch": args.batch, "prompt_tokens": args.prompt, "new_tokens": args.new,
              "rank": args.rank, "repeats": args.repeats,
              "load_average_before": os.getloadavg()[0], "scenarios": {}}
    for name, n in SCENARIOS.items():
        runs = [run_scenario(model, args, n, profile=args.profile and n == 32 and k == 0)
                for k in range(args.repeats)]
        r = min((x[0] for x in runs), key=lambda x: x["ms_per_decode_step_median"])
        prof = runs[0][1]
        result["scenarios"][name] = r
        if prof:
            result["profile_32_adapters"] = prof
        print(f"{name:12s} {r['ms_per_decode_step_median']:7.2f} ms/step "
              f"{r['decode_tokens_per_s']:8.0f} tok/s (decode) "
              f"{r['end_to_end_tokens_per_s']:8.0f} tok/s (end to end)", flush=True)
    write(pathlib.Path(args.out), result)
    return result


if __name__ == "__main__":
    main()
