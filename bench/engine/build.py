"""The Llama-7B-shaped engine the engine benches drive (random bf16 weights, rank-16 q/k/v/o
adapters in its pool), and the batches they step it with: decode rows after a prefill, or decode
rows beside one prompt chunk."""
from __future__ import annotations

import os

import torch


def build_engine(layers: int, distinct: int, cuda_graphs: bool,
                 graph_max_rank: int | None = None, device: str = "cuda",
                 max_model_len: int = 1024, max_batch_tokens: int = 8192,
                 kv_cache_bytes: int = 4 << 30, max_running: int = 128, **options):
    """The Llama-7B-shaped engine (random bf16 weights, `layers` layers) with `distinct` rank-16
    q/k/v/o adapters placed in its pool (sized for them: 64 slots and 2 GiB at least):
    (built, their slots). options: more EngineOptions."""
    from bench.lib.synthetic import NullTokenizer, adapter_tensors, llama7b_spec, random_weights
    from services.worker.adapters.layout import staged_from_tensors
    from services.worker.perf_config import PerfConfig
    from services.worker.config import EngineOptions
    from services.worker.startup.factory import assemble
    dev = torch.device(device)
    spec = llama7b_spec(layers)
    extra = {} if graph_max_rank is None else {"graph_max_rank": graph_max_rank}
    opts = EngineOptions(device=device, dtype="bfloat16", kv_cache_bytes=kv_cache_bytes,
                         max_batch_tokens=max_batch_tokens, max_running=max_running,
                         pool_bytes=max(2 << 30, distinct * adapter_bytes(spec, 16) * 5 // 4),
                         pool_slots=max(64, distinct), max_model_len=max_model_len,
                         cuda_graphs=cuda_graphs,
                         perf=PerfConfig.from_env(os.environ), **extra, **options)
    built = assemble(spec, random_weights(spec, dev, torch.bfloat16), NullTokenizer(), opts,
                     dev, torch.bfloat16)
    slots = [built.pool.place(f"a{i}", staged_from_tensors(
                 adapter_tensors(spec, 16, i + 1, device=dev), {"r": 16, "lora_alpha": 32},
                 spec)) for i in range(distinct)]
    return built, slots


def adapter_bytes(spec, rank: int) -> int:
    """A rank-`rank` q/k/v/o adapter's bf16 bytes on this spec."""
    return sum(rank * (k + n) * 2 for m in ("q_proj", "k_proj", "v_proj", "o_proj")
               for k, n in [spec.in_out(m)]) * spec.num_layers


def decode_engine(layers: int, batch: int, distinct: int, cuda_graphs: bool,
                  graph_max_rank: int | None = None, max_new: int = 400, device: str = "cuda",
                  prompt: int = 128):
    """build_engine's engine with `batch` requests of `prompt` tokens spread over its
    `distinct` adapters (0: base only), prefilled and a few decode steps in."""
    from services.worker.engine.sequence import Sequence, Stopping
    built, slots = build_engine(layers, distinct, cuda_graphs, graph_max_rank, device)
    eng = built.engine
    for i in range(batch):
        slot = slots[i % len(slots)] if slots else -1
        eng.submit(Sequence(f"r{i}", list(range(3, 3 + prompt)), slot=slot,
                            stopping=Stopping(max_new_tokens=max_new, ignore_eos=True)),
                   lambda e: 0)
    for _ in range(8):                                      # prefill, graph capture, warm steps
        eng.step()
    return eng


def mixed_batch(built, slots: list[int], decode: int, context: int, chunk: int):
    """decode sequences with `context` tokens in the cache (one row each) and one new
    sequence with a `chunk`-token prompt (one run of rows), their KV blocks taken; each on an
    adapter of slots in turn (none: base rows)."""
    from services.worker.engine.scheduler import Scheduled
    from services.worker.engine.sequence import Sequence, Stopping
    blocks = built.engine.scheduler.blocks
    batch = []
    for i in range(decode + (1 if chunk else 0)):
        prefill = i == decode
        n = chunk if prefill else context + 1
        seq = Sequence(f"s{i}", list(range(3, 3 + n)), slot=slots[i % len(slots)] if slots
                       else -1, stopping=Stopping(max_new_tokens=64, ignore_eos=True))
        if not blocks.ensure(seq, n):
            raise SystemExit("KV cache too small for the case")
        seq.num_computed = 0 if prefill else context
        batch.append(Scheduled(seq, n if prefill else 1))
    return batch


def kv_bytes(layers: int, tokens: int) -> int:
    """K and V of `tokens` tokens in `layers` layers of the Llama-7B shape (32 KV heads of
    128, bf16), with a quarter to spare."""
    return tokens * 2 * layers * 32 * 128 * 2 * 5 // 4
