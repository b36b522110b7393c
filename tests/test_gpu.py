"""On a CUDA device: the engine (Triton kernels, CUDA-graph decode) gives the CPU path's greedy
tokens on the tiny model, for a mixed-adapter batch. Skipped without CUDA."""
from __future__ import annotations

import pathlib

import pytest
import torch

from services.worker.adapters.layout import staged_from_peft_dir
from services.worker.config import EngineOptions
from services.worker.engine.sequence import Sequence, Stopping
from services.worker.perf_config import PerfConfig
from services.worker.startup.factory import build_engine
ROOT = pathlib.Path(__file__).resolve().parent.parent
MODEL_DIR, DEMO_ADAPTERS = ROOT / "models" / "tiny-llama", ROOT / "models" / "adapters"

pytestmark = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def greedy_tokens(device: str, dtype: str, graphs: bool = True,
                  overlap: bool = True, perf: PerfConfig = PerfConfig(),
                  quantization: str = "auto", kv_cache_dtype: str = "auto",
                  late: list[str] | None = None,
                  model: pathlib.Path = MODEL_DIR) -> dict[str, list[int]]:
    """late: the worker's warm-up first, then every kernel compiled after it appended."""
    opts = EngineOptions(device=device, dtype=dtype, kv_cache_bytes=16 << 20, block_size=16,
                         max_batch_tokens=512, max_running=32, cuda_graphs=graphs,
                         overlap=overlap, perf=perf, quantization=quantization,
                         kv_cache_dtype=kv_cache_dtype)
    built = build_engine(model, opts)
    if late is not None:
        from kernels import compile_watch
        from services.worker.startup.warmup import Warmup
        built.pool.warm_up()
        Warmup(built.engine, built.pool, built.spec, opts.max_batch_tokens, max_rank=32,
               max_running=opts.max_running).run()
        assert compile_watch.install(late.append)
    names = sorted(p.name for p in DEMO_ADAPTERS.iterdir())
    slots = {n: built.pool.place(n, staged_from_peft_dir(DEMO_ADAPTERS / n, built.spec))
             for n in names}
    prompts = ["Tell me about the weather.", "Hello!", "What should I do today?"]
    out: dict[str, list[int]] = {}
    done: list = []
    for i in range(12):
        name = ([*names, ""])[i % (len(names) + 1)]
        rid = f"{i}-{name}"
        ids = built.tokenizer.encode(prompts[i % len(prompts)]).ids
        out[rid] = []
        seq = Sequence(rid, ids, slot=slots[name] if name else -1,
                       stopping=Stopping(max_new_tokens=24, ignore_eos=True))
        built.engine.submit(seq, lambda ev, r=rid: (out[r].extend(ev.token_ids),
                                                   ev.stop and done.append(r)))
    while len(done) < len(out):
        built.engine.step()
    return out


@needs_cuda
def test_gpu_greedy_matches_cpu_fp32():
    cpu = greedy_tokens("cpu", "float32")
    gpu = greedy_tokens("cuda", "float32")
    assert gpu == cpu


@needs_cuda
def test_gpu_graphs_match_eager_bf16():
    eager = greedy_tokens("cuda", "bfloat16", graphs=False)
    graphs = greedy_tokens("cuda", "bfloat16", graphs=True)
    agree = sum(a == b for a, b in zip(eager.values(), graphs.values()))
    assert agree == len(eager)


@needs_cuda
def test_gpu_fp8_kv_cache_graphs_match_eager_and_compile_nothing_after_the_warm_up():
    """--kv-cache-dtype fp8 (e4m3 caches): decode graphs give the eager steps' greedy tokens,
    and the warm-up compiled every kernel the fp8 cache's workload needs."""
    eager = greedy_tokens("cuda", "bfloat16", graphs=False, kv_cache_dtype="fp8")
    late: list[str] = []
    graphs = greedy_tokens("cuda", "bfloat16", graphs=True, kv_cache_dtype="fp8", late=late)
    assert graphs == eager
    assert not late, late


@needs_cuda
def test_gpu_fp8_kv_cache_with_a_checkpoints_scales_matches_the_cpu(tmp_path):
    """A checkpoint's per-layer KV scales (tests/test_kv_scales.py) on the device: the graphs'
    and the eager steps' greedy tokens are the CPU engine's (fp32, the same e4m3 bytes)."""
    import shutil
    from tests.test_kv_scales import add_kv_scales
    model = tmp_path / "kv"
    shutil.copytree(MODEL_DIR, model)
    add_kv_scales(model, [(0.6875, 1.375), (2.5, 0.4375), (0.3125, 3.25), (1.125, 0.8125)])
    cpu = greedy_tokens("cpu", "float32", model=model)
    eager = greedy_tokens("cuda", "float32", graphs=False, model=model)
    assert greedy_tokens("cuda", "float32", model=model) == eager == cpu


@needs_cuda
def test_gpu_overlapped_decode_matches_waited_steps():
    """Steps launched from the step in flight (tokens gathered on the device, events, double
    buffers) give the tokens of steps that each wait for the last."""
    assert greedy_tokens("cuda", "bfloat16", overlap=True) == greedy_tokens(
        "cuda", "bfloat16", overlap=False)


@needs_cuda
def test_gpu_pdl_gives_the_tokens_of_plain_launches():
    """Kernels launched early (programmatic dependent launch, captured into the decode graphs)
    wait for their predecessors: the tokens equal those of plain launches."""
    from kernels import pdl
    if not pdl.enabled(torch.device("cuda")):
        pytest.skip("no programmatic dependent launch on this device")
    with_pdl = greedy_tokens("cuda", "bfloat16")
    with pdl.disabled():                    # the setting before it comes back after
        plain = greedy_tokens("cuda", "bfloat16", perf=PerfConfig(pdl=False))
    assert with_pdl == plain


@needs_cuda
def test_gpu_column_lora_matches_cpu_fp32():
    """Column LoRA on (a block for each demo adapter: q/k/v A rows beside the base weight,
    decode graphs captured for it on first use) gives the CPU path's tokens."""
    cpu = greedy_tokens("cpu", "float32")
    assert greedy_tokens("cuda", "float32", perf=PerfConfig(lora_columns=4)) == cpu


@needs_cuda
def test_gpu_row_lora_matches_cpu_fp32():
    """Row LoRA on too (the o Bt rows beside the o weight, the o shrink into the attention
    output's buffer, kernels.shrink_blocks, in eager steps and captured decode graphs) gives
    the CPU path's tokens."""
    cpu = greedy_tokens("cpu", "float32")
    assert greedy_tokens("cuda", "float32", perf=PerfConfig(lora_columns=4, lora_rows=4)) == cpu


@needs_cuda
def test_gpu_prefill_logits_match_cpu_fp32():
    """Prefill logits for every demo adapter (and the base), GPU kernels against the CPU path."""
    from services.worker.engine.scheduler import Scheduled
    logits = {}
    for device in ("cpu", "cuda"):
        built = build_engine(MODEL_DIR, EngineOptions(device=device, dtype="float32",
                                                      kv_cache_bytes=16 << 20,
                                                      cuda_graphs=False))
        names = sorted(p.name for p in DEMO_ADAPTERS.iterdir())
        seqs = []
        for i, n in enumerate(["", *names]):
            slot = built.pool.place(n, staged_from_peft_dir(DEMO_ADAPTERS / n,
                                                            built.spec)) if n else -1
            seqs.append(Sequence(n or "base", list(range(5 + i, 40 + 3 * i)), slot=slot))
        runner = built.engine.runner
        for s in seqs:
            assert built.engine.scheduler.blocks.ensure(s, len(s.tokens))
        inp = runner.steps.eager([Scheduled(s, len(s.tokens)) for s in seqs], runner.buffers)
        out = runner.model.forward(inp.input_ids, inp.ctx, runner.kv_cache)
        logits[device] = {e.seq.request_id: out[i].cpu() for i, e in enumerate(inp.sampled)}
    for name, ref in logits["cpu"].items():
        err = (logits["cuda"][name] - ref).abs().max().item()
        assert err < 1e-3, (name, err)


@needs_cuda
def test_gpu_sampling_params_match_cpu_with_many_in_flight():
    """sampling_batch copies the parameters from pinned memory without waiting: many batches
    built back to back, before any sync, all arrive with the CPU's values."""
    import dataclasses
    import random
    from services.worker.engine.scheduler import Scheduled
    from services.worker.engine.sequence import Sampling
    from services.worker.executor.step_inputs import sampling_batch
    rng = random.Random(0)
    pending = []
    for k in range(200):
        rows = []
        for i in range(rng.randrange(1, 130)):
            s = Sampling(temperature=rng.choice([0.0, 0.5, 1.3]), top_k=rng.choice([0, 5, 40]),
                         top_p=rng.choice([1.0, 0.9]), seed=rng.randrange(1 << 62),
                         repetition_penalty=rng.choice([1.0, 1.2]) if k % 2 else 1.0)
            seq = Sequence(f"s{i}", [rng.randrange(3, 900) for _ in range(rng.randrange(3, 30))],
                           sampling=s)
            seq.tokens += [rng.randrange(3, 900) for _ in range(rng.randrange(0, 20))]
            rows.append(Scheduled(seq, 1))
        pending.append((sampling_batch(rows, torch.device("cpu")),
                        sampling_batch(rows, torch.device("cuda"))))
    torch.cuda.synchronize()
    for cpu, gpu in pending:
        for f in dataclasses.fields(cpu):
            a, b = getattr(cpu, f.name), getattr(gpu, f.name)
            if isinstance(a, torch.Tensor):
                assert b.is_cuda and torch.equal(a, b.cpu()), f.name
            else:
                assert a == b, f.name


@needs_cuda
@pytest.mark.parametrize("kn", [False, True])
def test_a_cuda_pool_places_adapters_as_the_cpu_pool_does(kn):
    """The CUDA placement (one Triton launch that scatters the weights and writes the slot's
    table entries) writes what the CPU placement (the torch reference) writes, bit for bit
    (tests/test_adapter_scatter.py: pool_placements)."""
    from test_adapter_scatter import pool_placements
    pool_placements("cuda", kn)


def test_no_kernel_compiles_or_graph_captures_after_serving(tmp_path):
    """Issue 23: after SERVING, a varied workload through the services (the base model and
    adapters of ranks 8, 16 and 64; prompts of 1 to 2,048 tokens; 1 to 64 requests in flight,
    base rows mixed in) needs no kernel specialization and no graph capture the warm-up did
    not make, as the worker's /metrics counts them."""
    import json
    import subprocess
    import sys
    varied = ";".join([
        "v-base:adapters=0,concurrency=64,requests=96,warmup=0,prompt=1:2048,output=8:32",
        "v-one:adapters=8,rank=8,zipf=1.0,concurrency=1,requests=8,warmup=0,prompt=1:2048",
        "v-r8:adapters=64,rank=8,zipf=1.0,concurrency=64,requests=128,warmup=0,prompt=1:2048",
        "v-r16:adapters=32,rank=16,zipf=0.5,concurrency=48,requests=96,warmup=0,prompt=1:1024",
        "v-r64:adapters=4,rank=64,zipf=0,concurrency=16,requests=48,warmup=0,prompt=1:2048"])
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "bench.stack.startup", "--device", "cuda", "--shape", "small",
         "--work", str(tmp_path / "work"), "--out", str(out), "--name", "startup-test",
         "--gpu-pool-bytes", "2GiB", "--kv-cache-bytes", "8GiB", "--max-running", "64",
         "--max-batch-tokens", "2048", "--host-pool-bytes", "1GiB", "--clients", "2",
         "--adapters", "64x8,32x16,4x64", "--output", "8:64",
         "--measure", "m:adapters=32,rank=16,zipf=0,concurrency=64,requests=128,warmup=0,"
                      "preload=1", "--varied", varied],
        cwd=ROOT, capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-3000:]
    doc = json.loads((out / "startup-test.json").read_text())
    assert not any(r["errors"] for r in doc["rows"])
    assert doc["compiles_after_serving"] == 0, doc["late_compiles"]
    assert doc["captures_after_serving"] == 0


def _capture_and_warm(cache: str, opts) -> None:
    """In a fresh process: the worker's graph capture and warm-up on this kernel cache."""
    from kernels import kernel_cache
    from services.worker.startup.warmup import Warmup
    kernel_cache.use(cache)
    built = build_engine(MODEL_DIR, opts)
    Warmup(built.engine, built.pool, built.spec, opts.max_batch_tokens, max_rank=32,
           max_running=opts.max_running).run()


@needs_cuda
def test_precompile_children_compile_everything_the_capture_and_warm_up_need(tmp_path):
    """services.worker.startup.precompile: after two children have filled an empty kernel cache (one
    layer each, shares of the graphs' forwards and of the warm-up), a fresh worker process's
    graph capture and warm-up add no kernel to the cache: each one they need, the children
    built."""
    import multiprocessing
    import os

    from services.worker.startup import precompile
    from triton import knobs
    cache = tmp_path / "kernels"
    cache.mkdir()
    saved, knobs.cache.dir = knobs.cache.dir, str(cache)     # where the children compile
    try:
        opts = EngineOptions(device="cuda", dtype="bfloat16", kv_cache_bytes=256 << 20,
                             max_batch_tokens=256, max_running=32, pool_bytes=64 << 20,
                             pool_slots=16, graph_max_rank=32)
        shape = precompile.WarmShape(max_batch_tokens=256, max_rank=32, max_running=32,
                                     prefill_with_decode=0)
        assert precompile.Children(str(MODEL_DIR), opts, shape, 2).wait(900) == 2
    finally:
        knobs.cache.dir = saved
    before = set(os.listdir(cache))
    assert before
    worker = multiprocessing.get_context("spawn").Process(target=_capture_and_warm,
                                                          args=(str(cache), opts))
    worker.start()
    worker.join(900)
    assert worker.exitcode == 0
    new = sorted(set(os.listdir(cache)) - before)
    assert not new, new


@needs_cuda
@pytest.mark.parametrize("split_attention", [False, True])
def test_gpu_mixed_steps_replayed_from_graphs_give_the_eager_logits(split_attention):
    """A mixed step (decode rows on adapters and the base model, a whole prompt, a prompt's
    first chunk) replayed from its captured mixed graph: the eager step's logits for every
    sampling row, in the eager order (bf16 tolerance), and the tokens sampled from them; with
    the decode rows' attention in a launch of its own or not (PerfConfig.split_attention)."""
    opts = EngineOptions(device="cuda", dtype="bfloat16", kv_cache_bytes=16 << 20, block_size=16,
                         max_batch_tokens=512, max_running=32,
                         perf=PerfConfig(split_attention=split_attention))
    built = build_engine(MODEL_DIR, opts)
    g = built.engine.runner
    assert g.mixed and g.mixed_sizes[-1] == 512
    names = sorted(p.name for p in DEMO_ADAPTERS.iterdir())
    slots = [built.pool.place(n, staged_from_peft_dir(DEMO_ADAPTERS / n, built.spec))
             for n in names]
    from services.worker.engine.scheduler import Scheduled
    blocks, batch = built.engine.scheduler.blocks, []
    for i in range(10):
        seq = Sequence(f"d{i}", list(range(3, 40 + 7 * i)), slot=([*slots, -1])[i % (len(slots)
                                                                                      + 1)])
        assert blocks.ensure(seq, len(seq.tokens))
        seq.num_computed = len(seq.tokens) - 1
        batch.append(Scheduled(seq, 1))
    whole = Sequence("whole", list(range(5, 140)), slot=slots[0])
    part = Sequence("part", list(range(9, 300)), slot=-1)
    for seq, n in ((whole, len(whole.tokens)), (part, 100)):
        assert blocks.ensure(seq, n)
        batch.append(Scheduled(seq, n))
    eager = g.runner.steps.eager(batch, g.runner.buffers)
    want = g.model.forward(eager.input_ids, eager.ctx, g.runner.kv_cache).float()
    if split_attention:                       # the same logits as one launch for all rows
        g.model.split_attention = False
        one = g.model.forward(eager.input_ids, eager.ctx, g.runner.kv_cache).float()
        g.model.split_attention = True
        assert (one - want).abs().max() <= 0.03 * want.abs().max()
    replays = g.mixed_replays
    sampled, tokens, _ = g.collect(g.launch(batch))
    assert g.mixed_replays == replays + 1
    assert [b.seq.request_id for b in sampled] == [b.seq.request_id for b in eager.sampled]
    plan = g.steps.plan(batch, graph=True)
    key = g._graph_key(g.mixed_size(batch), plan.mask, plan.rank, plan.columns, mixed=True)
    got = g.mixed_outputs[key][:len(sampled)].float()
    assert (got - want).abs().max() <= 0.03 * want.abs().max()
    assert tokens == got.argmax(-1).tolist()
