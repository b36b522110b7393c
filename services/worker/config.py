"""The worker's configuration: one frozen dataclass (WorkerConfig, its engine's build options
in it: EngineOptions), built once in main() from flags + env."""
from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field

from services.common.config import ServiceFlags, add_flags
from services.common.internal_auth import check_internal_server
from services.common.runtime import parse_bytes
from services.worker.model.quant_scheme import QUANTIZATION_MODES
from services.worker.perf_config import PerfConfig

# --tool-call-format: auto (the chat template's), none, or one of the formats the chat template
# reads (services.worker.chat_template.TOOL_FORMATS)
TOOL_CALL_FORMATS = ("auto", "none", "hermes", "llama3_json", "mistral")
# --kv-cache-dtype: auto (the model dtype) or fp8 (e4m3, scale 1.0: twice the blocks a budget)
KV_CACHE_DTYPES = ("auto", "fp8", "model")


@dataclass(frozen=True)
class GrammarOptions:
    """The worker's flags for structured output (services.worker.api.grammar, token_mask)."""
    compile_threads: int = 2      # grammars compiled at once (--grammar-compile-threads)
    mask_threads: int = 0         # a step's mask threads (--grammar-mask-threads; 0: auto)
    timeout_s: float = 10.0       # a compile running longer is refused (--grammar-compile-timeout)
    cache: int = 512              # compiled grammars kept (--grammar-cache)

    def __post_init__(self) -> None:
        if self.compile_threads < 1 or self.mask_threads < 0:
            raise ValueError("--grammar-compile-threads must be >= 1, --grammar-mask-threads "
                             ">= 0")
        if not 0 < self.timeout_s <= 600:
            raise ValueError("--grammar-compile-timeout must be in (0, 600] seconds")
        if self.cache < 1:
            raise ValueError("--grammar-cache must be >= 1")


@dataclass(frozen=True)
class EngineOptions:
    """How the engine is built (services.worker.startup.factory.build_engine): the worker's flags
    give it as WorkerConfig.engine; tests and benchmarks make their own (these defaults are
    small: the worker's are WORKER_ENGINE)."""
    device: str = "cpu"                 # cpu, cuda, cuda:N, or auto (cuda when there is one)
    dtype: str = "auto"                 # auto: bf16 on GPU, fp32 on CPU
    quantization: str = "auto"          # auto: as the checkpoint is stored; fp8 (--quantization)
    kv_cache_bytes: int = 64 << 20
    kv_cache_dtype: str = "auto"        # auto: the checkpoint's, else the model dtype; fp8: e4m3
    block_size: int = 16
    max_batch_tokens: int = 512
    max_prefill_with_decode: int = 0    # prompt tokens beside decode rows (scheduler.py; 0: no cap)
    max_running: int = 64
    pool_bytes: int = 64 << 20          # the adapter pool on the device (--gpu-pool-bytes)
    pool_slots: int = 64
    max_model_len: int = 0              # 0 = the model's max_position_embeddings
    cuda_graphs: bool = True            # capture decode steps on CUDA
    graph_max_rank: int = 64            # largest LoRA rank the graphs serve (tiles 16 .. this)
    graph_mixed_tokens: int = 1024      # mixed steps up to this many tokens replay graphs (0: off)
    overlap: bool = True                # launch decode step N+1 before post-processing N
    share_prefixes: bool = True         # prompt blocks shared by sequences of one prefix
    fair: bool = True                   # admission in the tenants' VTC order (--fair-queue)
    perf: PerfConfig = field(default_factory=PerfConfig)   # forms of the same math (LORAFLEET_*)
    fault_inject_after_steps: int = 0   # TEST HOOK: forward passes after which one raises
    grammar_mask_threads: int = 0       # a step's grammar mask threads (0: auto; --grammar-*)

    def __post_init__(self) -> None:
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"--device: {self.device!r} is not auto, cpu or cuda[:N]")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"--dtype: {self.dtype!r} is not auto, float32, bfloat16, float16")
        if self.quantization not in QUANTIZATION_MODES:
            raise ValueError(f"--quantization: {self.quantization!r} is not one of "
                             f"{', '.join(QUANTIZATION_MODES)}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"--kv-cache-dtype: {self.kv_cache_dtype!r} is not one of "
                             f"{', '.join(KV_CACHE_DTYPES)}")
        if self.block_size < 1 or self.max_batch_tokens < 1 or self.max_running < 1:
            raise ValueError("--block-size, --max-batch-tokens, --max-running must be >= 1")
        if self.max_prefill_with_decode < 0:
            raise ValueError("--max-prefill-with-decode must be >= 0 (0: no cap)")
        if self.graph_mixed_tokens < 0:
            raise ValueError("--graph-mixed-tokens must be >= 0 (0: mixed steps run eagerly)")
        if self.fault_inject_after_steps < 0:
            raise ValueError("--fault-inject-after-steps must be >= 0")


# the worker's engine (its flags' defaults)
WORKER_ENGINE = EngineOptions(device="auto", kv_cache_bytes=256 << 20, max_batch_tokens=1024,
                              max_running=128, pool_bytes=256 << 20, pool_slots=128)


@dataclass(frozen=True)
class WorkerConfig:
    model: str = "models/tiny-llama"
    store: str = "127.0.0.1:7003"
    engine: EngineOptions = WORKER_ENGINE
    host_pool_bytes: int = 1 << 30
    max_new_tokens: int = 64            # default when a request leaves it 0
    max_new_tokens_limit: int = 4096
    tenant_share: float = 0.5           # per-tenant cap of each adapter tier; 0 = caps off
    eviction: str = "lru"               # the GPU pool's order: lru, or cost (GDSF)
    metrics_tenants: int = 50           # tenants named on /metrics; the rest are "other"
    # the flags every service takes (services.common.config)
    common: ServiceFlags = ServiceFlags(listen="127.0.0.1:7002", metrics_port=9102)
    worker_id: str = ""
    cpu_threads: int = 1                # torch intra-op threads for a CPU engine (0 = torch's)
    store_shm_dir: str = ""             # the store's --shm-dir when on this host ("" = stream)
    loader_threads: int = 8             # cold loads that run at once
    host_placement: str = "inline"      # where a load from the host tier is placed (or loader)
    warm_gpu_share: float = 0.5         # of the GPU pool a fleet warm-up may fill (Prefetch warm)
    frontend: str = "process"           # process: the gRPC port in a process of its own
    grammar: GrammarOptions = field(default_factory=GrammarOptions)   # --grammar-*
    tool_call_format: str = "auto"      # auto (the chat template's), none, or a format
    kernel_cache: str = ""              # compiled kernels kept here across restarts ("": Triton's)
    warmup: str = "auto"                # run every eager step shape before SERVING (auto: GPU)
    warmup_max_rank: int = 128          # the largest adapter rank the warm-up prepares for
    precompile_procs: int = 0           # child processes compiling a cold kernel cache

    def __post_init__(self) -> None:
        if self.metrics_tenants < 0:
            raise ValueError("--metrics-tenants must be >= 0")
        if not 0.0 <= self.tenant_share <= 1.0:
            raise ValueError("--tenant-share must be within [0, 1]")
        if self.eviction not in ("lru", "cost"):
            raise ValueError(f"--eviction: {self.eviction!r} is not lru or cost")
        if self.kernel_cache and os.path.exists(self.kernel_cache) and \
                not os.path.isdir(self.kernel_cache):
            raise ValueError(f"--kernel-cache {self.kernel_cache}: not a directory")
        if self.warmup not in ("auto", "on", "off"):
            raise ValueError(f"--warmup: {self.warmup!r} is not auto, on or off")
        if not 0 <= self.precompile_procs <= 64:
            raise ValueError("--precompile-procs must be in 0..64")
        if not 1 <= self.warmup_max_rank <= 4096:
            raise ValueError("--warmup-max-rank must be in 1..4096")
        if self.frontend not in ("process", "inline"):
            raise ValueError(f"--frontend: {self.frontend!r} is not process or inline")
        if self.loader_threads < 1:
            raise ValueError("--loader-threads must be >= 1")
        if not 0.0 <= self.warm_gpu_share <= 1.0:
            raise ValueError("--warm-gpu-share must be within [0, 1]")
        if self.host_placement not in ("inline", "loader"):
            raise ValueError(f"--host-placement: {self.host_placement!r} is not inline or loader")
        if self.store_shm_dir and not os.path.isdir(self.store_shm_dir):
            raise ValueError(f"--store-shm-dir {self.store_shm_dir}: not a directory")
        if self.tool_call_format not in TOOL_CALL_FORMATS:
            raise ValueError(f"--tool-call-format: {self.tool_call_format!r} is not one of "
                             f"{', '.join(TOOL_CALL_FORMATS)}")
        check_internal_server(self.common)
        from services.worker.model.spec import load_spec   # torch-free; reads config.json
        try:
            load_spec(self.model)
        except (OSError, ValueError) as exc:
            raise ValueError(f"--model {self.model}: {exc}") from None


def parse_args(argv: list[str] | None = None) -> WorkerConfig:
    """The worker's config from its flags (argv; None: sys.argv) and environment."""
    a = parser().parse_args(argv)
    return WorkerConfig(
        common=ServiceFlags.from_args(a), model=a.model, store=a.store, engine=engine_options(a),
        host_pool_bytes=a.host_pool_bytes, max_new_tokens=a.max_new_tokens,
        tenant_share=a.tenant_share, eviction=a.eviction, worker_id=a.worker_id,
        cpu_threads=a.cpu_threads, store_shm_dir=a.store_shm_dir,
        loader_threads=a.loader_threads, host_placement=a.host_placement,
        warm_gpu_share=a.warm_gpu_share,
        frontend=a.frontend, warmup=a.warmup, kernel_cache=a.kernel_cache,
        warmup_max_rank=a.warmup_max_rank, metrics_tenants=a.metrics_tenants,
        precompile_procs=a.precompile_procs, **_grammar_values(a))


def flag_defaults() -> dict:
    """Each flag's default, by its argparse name (gpu_pool_bytes, ...; sizes in bytes): what a
    benchmark describes a run's unset flags by."""
    return vars(parser().parse_args([]))


def parser() -> argparse.ArgumentParser:
    """The worker's flags."""
    p = argparse.ArgumentParser(prog="python -m services.worker",
                                description="lorafleet worker: base model, engine, adapter pool")
    add_flags(p, listen="127.0.0.1:7002", metrics_port=9102, grace=10.0)
    p.add_argument("--model", default="models/tiny-llama", help="HF checkpoint directory")
    p.add_argument("--store", default=os.environ.get("LORAFLEET_STORE", "127.0.0.1:7003"),
                   help="adapter-store address (127.0.0.1:7003)")
    _add_engine_flags(p)
    p.add_argument("--host-pool-bytes", type=parse_bytes, default="1GiB",
                   help="pinned host tier of staged adapters")
    p.add_argument("--max-new-tokens", type=int, default=64, help="default max_new_tokens")
    p.add_argument("--tenant-share", type=float, default=0.5,
                   help="per-tenant cap of each adapter tier (fraction; 0 = caps off)")
    p.add_argument("--eviction", default="lru", choices=("lru", "cost"),
                   help="the GPU pool's eviction order: lru, or cost (Greedy-Dual-Size-"
                        "Frequency: uses x reload time / bytes) (lru)")
    p.add_argument("--worker-id", default="", help="name in residency streams (default: random)")
    p.add_argument("--cpu-threads", type=int, default=1,
                   help="torch threads for a CPU engine; 0 = torch's default (1: small decode "
                        "steps are faster on one thread than split over cores)")
    p.add_argument("--store-shm-dir", default="",
                   help="the adapter-store's --shm-dir, when it runs on this host: adapters "
                        "then come through shared memory instead of a gRPC stream")
    p.add_argument("--loader-threads", type=int, default=8,
                   help="cold loads (fetch + placement) that run at once (8)")
    _add_start_flags(p)
    _add_grammar_flags(p)
    return p


def engine_options(a: argparse.Namespace) -> EngineOptions:
    """The engine's options from its flags (_add_engine_flags) and the LORAFLEET_* variables
    (PerfConfig.from_env)."""
    return EngineOptions(
        device=a.device, dtype=a.dtype, quantization=a.quantization,
        kv_cache_bytes=a.kv_cache_bytes, kv_cache_dtype=a.kv_cache_dtype,
        block_size=a.block_size, max_batch_tokens=a.max_batch_tokens,
        max_prefill_with_decode=a.max_prefill_with_decode, max_running=a.max_running,
        pool_bytes=a.gpu_pool_bytes, pool_slots=a.pool_slots, max_model_len=a.max_model_len,
        graph_mixed_tokens=a.graph_mixed_tokens, share_prefixes=a.share_prefixes,
        fair=a.fair_queue == "on", perf=PerfConfig.from_env(os.environ),
        fault_inject_after_steps=a.fault_inject_after_steps,
        grammar_mask_threads=a.grammar_mask_threads)


def _grammar_values(a: argparse.Namespace) -> dict:
    return {"grammar": GrammarOptions(a.grammar_compile_threads, a.grammar_mask_threads,
                                      a.grammar_compile_timeout, a.grammar_cache),
            "tool_call_format": a.tool_call_format}


def _add_grammar_flags(p: argparse.ArgumentParser) -> None:
    """Structured output's flags (services.worker.api.grammar, token_mask)."""
    p.add_argument("--grammar-compile-threads", type=int, default=2,
                   help="grammars (JSON schemas, regexes, ...) compiled at once, on threads of "
                        "their own (2)")
    p.add_argument("--grammar-mask-threads", type=int, default=0,
                   help="threads computing a step's token masks when it has 8 or more "
                        "constrained rows (0: auto, 1 on a CPU worker, 4 on a GPU) (0)")
    p.add_argument("--grammar-compile-timeout", type=float, default=10.0,
                   help="a grammar still compiling after this many seconds is refused "
                        "INVALID_ARGUMENT (10)")
    p.add_argument("--grammar-cache", type=int, default=512,
                   help="compiled grammars kept, per grammar and tokenizer (512)")
    p.add_argument("--tool-call-format", default="auto",
                   choices=TOOL_CALL_FORMATS,
                   help="how the model writes tool calls (the router parses and enforces "
                        "them in it); auto: read from the chat template (auto)")


def _add_engine_flags(p: argparse.ArgumentParser) -> None:
    """The flags of the engine's options (EngineOptions; defaults: WORKER_ENGINE)."""
    d = WORKER_ENGINE
    p.add_argument("--device", default=d.device, help="auto, cpu, cuda, cuda:N (auto)")
    p.add_argument("--dtype", default=d.dtype, help="auto (bf16 on GPU, fp32 on CPU), float32, "
                                                     "bfloat16, float16")
    p.add_argument("--quantization", default=d.quantization, choices=QUANTIZATION_MODES,
                   help="fp8 (alias fp8-dynamic): W8A8, the decoder layers' linear weights "
                        "quantized at load to FP8 (e4m3, a scale per output channel) and each "
                        "linear's input quantized to FP8 per token (LoRA stays in --dtype and "
                        "reads the unquantized input); fp8-weight-only: W8A16, the same weights "
                        "with activations in --dtype; auto: as the checkpoint is stored (a "
                        "published FP8 checkpoint as it declares: docs/models.md) (auto)")
    p.add_argument("--kv-cache-bytes", type=parse_bytes, default=d.kv_cache_bytes)
    p.add_argument("--kv-cache-dtype", default=d.kv_cache_dtype, choices=KV_CACHE_DTYPES,
                   help="fp8: the paged KV cache in FP8 (e4m3: K / k_scale and V / v_scale "
                        "clamped to +-448 and rounded on write, read back in --dtype; a "
                        "layer's scales from the checkpoint, else 1.0), so --kv-cache-bytes "
                        "holds twice the tokens and decode streams half the KV bytes; auto: "
                        "fp8 where the checkpoint declares an FP8 KV cache (kv_cache_scheme), "
                        "else --dtype; model: --dtype whatever the checkpoint declares (auto)")
    p.add_argument("--gpu-pool-bytes", type=parse_bytes, default=d.pool_bytes,
                   help="adapter pool on the compute device")
    p.add_argument("--pool-slots", type=int, default=d.pool_slots, help="most adapters in the pool")
    p.add_argument("--block-size", type=int, default=d.block_size, help="KV block size in tokens")
    p.add_argument("--max-batch-tokens", type=int, default=d.max_batch_tokens,
                   help="token budget per step")
    p.add_argument("--max-prefill-with-decode", type=int, default=d.max_prefill_with_decode,
                   help="most prompt tokens a step takes while sequences decode: a burst of "
                        "long prompts stalls the streams in flight less, and waits longer for "
                        "its first tokens (0: only --max-batch-tokens)")
    p.add_argument("--max-running", type=int, default=d.max_running,
                   help="most sequences per step")
    p.add_argument("--max-model-len", type=int, default=d.max_model_len, help="0 = the model's")
    p.add_argument("--graph-mixed-tokens", type=int, default=d.graph_mixed_tokens,
                   help="on CUDA, steps with prompt tokens (beside decode rows or not) of up to "
                        "this many tokens (at most 1024: above, a step's GPU time hides its "
                        "launches) replay CUDA graphs captured at start, padded to the next "
                        "captured size; larger ones run eagerly (0: all of them) (1024)")
    p.add_argument("--fair-queue", default="on", choices=("on", "off"),
                   help="admit waiting sequences in the tenants' virtual-token-counter order, "
                        "as the router does (on); off: arrival order")
    p.add_argument("--share-prefixes", action=argparse.BooleanOptionalAction,
                   default=d.share_prefixes,
                   help="a sequence takes the KV blocks of its prompt's start that a running "
                        "one of the same tenant and adapter computed (on)")
    p.add_argument("--fault-inject-after-steps", type=int, default=0, metavar="N",
                   help="TEST HOOK, never in production: after N forward passes every further "
                        "one raises, as a device error would (the worker fails its requests, "
                        "drains and exits 1); 0: off (0)")


def _add_start_flags(p: argparse.ArgumentParser) -> None:
    """The flags of the worker's processes, kernels, warm-up and metrics."""
    p.add_argument("--frontend", default="process", choices=("process", "inline"),
                   help="process: the public gRPC port is served by a process of its own, "
                        "which streams tokens while this one runs the engine; inline: one "
                        "process (process)")
    p.add_argument("--host-placement", default="inline", choices=("inline", "loader"),
                   help="a cold load whose bytes are in the worker's host tier is only a "
                        "placement (a millisecond or two): inline places it on the event loop, "
                        "one a loop iteration; loader on a loader thread as the loads that "
                        "fetch (a hop there and back, each waiting for the GIL under decode "
                        "load) (inline)")
    p.add_argument("--warm-gpu-share", type=float, default=0.5,
                   help="a worker that joins empty is warmed by the router with the fleet's "
                        "hot adapters (Prefetch warm): each is staged into the host tier, one "
                        "at a time behind the requests' own loads, and onto the GPU while the "
                        "pool has free room within this share of it (never evicting); 0: the "
                        "host tier only (0.5)")
    p.add_argument("--kernel-cache", default="",
                   help="directory that keeps compiled GPU kernels across restarts (created if "
                        "missing; default: Triton's own cache, ~/.triton/cache)")
    p.add_argument("--warmup", default="auto", choices=("auto", "on", "off"),
                   help="before SERVING, run each kind of eager step once (prompt lengths up "
                        "to --max-batch-tokens, beside decode rows, with adapters of each rank "
                        "tile) so no kernel compiles while serving; auto: on a GPU (auto)")
    p.add_argument("--precompile-procs", type=int, default=0,
                   help="on a kernel cache that has not seen this build: child processes that "
                        "compile the warm-up's kernels in parallel while the model loads (GPU; "
                        "each holds a one-layer model, 1/L of the KV cache; 0: none)")
    p.add_argument("--warmup-max-rank", type=int, default=128,
                   help="largest adapter rank the warm-up prepares for (the store's --max-rank)")
    p.add_argument("--metrics-tenants", type=int, default=50, help="tenants named in /metrics' "
                   "tenant labels, most requests first; the rest are tenant=other (50)")
