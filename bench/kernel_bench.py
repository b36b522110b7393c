"""LoRA kernel benchmark: ours (kernels.sgmv_triton) vs vLLM's Triton lora_shrink + lora_expand vs a
per-adapter cuBLAS loop vs per-token gather + bmm, next to the dense base matmul x @ W.

    python bench/kernel_bench.py --out DIR [--vllm-src .peers/vllm_lora_ops] [--quick]

Op: y[T, H] += s * (x[T, H] @ A_i.T) @ Bt_i for the rows of adapter i, bf16, hidden H = 4096; tokens
spread evenly over n adapters drawn from a pool of 128. Kernel times are medians of CUDA-graph
replays under triton.testing.do_bench (L2 flushed before each replay). Each impl is checked once per
shape against an fp32 reference. Bandwidth = useful bytes (x, y read + written, the n adapters'
weights) / time, next to a device-to-device copy measured in the same run.
Writes DIR/kernels-h200.json, DIR/kernels-h200.md and DIR/kernels-h200.png (if matplotlib).
"ours" is what the engine's eager steps run (kernels.sgmv.sgmv with the host tables: split-K at
decode sizes, fused above, cuBLAS pairs for one adapter of rank >= 64); captured decode graphs
run the kernels only (the "fused"/"split" columns, as kernels.sgmv_choice.use_split picks).
"ours_fused" and "ours_split" are the two kernels on every shape.

--vllm-src is a folder holding vLLM's lora_shrink_op.py, lora_expand_op.py, kernel_utils.py and
utils.py (from vllm/lora/ops/triton_ops/, or vllm/runtime/modeling/lora/ops/triton_ops/ in newer
trees); their `vllm.*` imports are stubbed here, so the rest of vLLM need not be installed.
Plumbing check without a GPU (small shapes; fp16 because the interpreter cannot multiply bf16):
    TRITON_INTERPRET=1 python bench/kernel_bench.py --out /tmp/b --device cpu --hidden 64 \
        --dtype fp16 --shapes 16:8:2,32:20:3 --vllm-src .peers/vllm_lora_ops
"""
from __future__ import annotations

import argparse
import datetime
import importlib.abc
import importlib.util
import inspect
import json
import os
import statistics
import sys
import time
import types
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

POOL_SLOTS = 128
SCALE = 0.5
TOL = 2e-2                                   # max |out - ref| / (1 + |ref|) at bf16
FULL = [(r, t, n) for r in (16, 64) for t in (1, 16, 64, 256, 1024, 4096)
        for n in (1, 8, 32, 128) if n <= t]
QUICK = [(16, 1, 1), (16, 64, 8), (64, 1024, 32)]
# ours_nopdl: "ours" launched without programmatic dependent launch (kernels.pdl);
# vllm_pdl: vLLM's kernels with their PDL path on (vLLM takes it only with its dual-stream flag)
IMPLS = ("ours", "ours_nopdl", "ours_fused", "ours_split", "vllm", "vllm_pdl", "loop", "gather")


# ----------------------------------------------------------------------------------------------
# vLLM's kernel files, loaded standalone: every `vllm.*` import they make is answered by a stub
# module, except the kernel files themselves, which load from --vllm-src.
_ENV_DEFAULTS = {"VLLM_TUNED_CONFIG_FOLDER": None}   # vLLM's defaults; every other flag False


class _Envs(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("VLLM_"):
            return _ENV_DEFAULTS.get(name, False)
        raise AttributeError(name)


class _Platform:
    def is_cuda(self):
        return torch.cuda.is_available()

    def has_device_capability(self, cap):
        if not torch.cuda.is_available():
            return False
        major, minor = torch.cuda.get_device_capability()
        return major * 10 + minor >= cap


class _Logger:
    def __getattr__(self, name):              # info, warning, warning_once, ...
        return lambda *a, **k: None


def _shim_attrs():
    import triton
    import triton.language as tl
    envs = _Envs("vllm.envs")

    def h2d(values, dtype, device, pin_memory=True):
        pin = pin_memory and torch.cuda.is_available()
        return torch.tensor(values, dtype=dtype, pin_memory=pin).to(device, non_blocking=True)

    return dict(
        tl=tl, triton=triton, HAS_TRITON=True, envs=envs, current_platform=_Platform(),
        init_logger=lambda name: _Logger(), next_power_of_2=triton.next_power_of_2,
        cdiv=triton.cdiv, round_up=lambda x, m: (x + m - 1) // m * m,
        direct_register_custom_op=lambda *a, **k: None,  # -> torch.ops lookup fails -> plain fn
        async_tensor_h2d=h2d)


class _VllmFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    KERNEL_FILES = ("kernel_utils", "utils", "lora_shrink_op", "lora_expand_op")

    def __init__(self, src: Path):
        self.src, self.attrs = src, _shim_attrs()

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "vllm" and not fullname.startswith("vllm."):
            return None
        head, _, stem = fullname.rpartition(".")
        if head.endswith("lora.ops.triton_ops") and stem in self.KERNEL_FILES:
            return importlib.util.spec_from_file_location(fullname, self.src / f"{stem}.py")
        return importlib.util.spec_from_loader(fullname, self, is_package=True)

    def create_module(self, spec):
        if spec.name.endswith(".envs"):
            return self.attrs["envs"]
        mod = types.ModuleType(spec.name)
        attrs = self.attrs

        def __getattr__(name):
            if name in attrs:
                return attrs[name]
            if name.startswith("VLLM_"):
                return getattr(attrs["envs"], name)
            raise AttributeError(f"{spec.name}.{name} is not shimmed")

        mod.__getattr__ = __getattr__
        return mod

    def exec_module(self, module):
        module.__path__ = []


def load_vllm(src: str | None):
    """(shrink_fn, expand_fn, utils_module) from vLLM's kernel files, or an error string."""
    if not src:
        return "not requested (--vllm-src not given)"
    path = Path(src).resolve()
    missing = [f for f in _VllmFinder.KERNEL_FILES if not (path / f"{f}.py").exists()]
    if missing:
        return f"missing in {path}: {missing}"
    for name in [m for m in sys.modules if m == "vllm" or m.startswith("vllm.")]:
        del sys.modules[name]
    finder = _VllmFinder(path)
    sys.meta_path.insert(0, finder)
    try:
        text = (path / "lora_shrink_op.py").read_text()
        pkg = ("vllm.runtime.modeling.lora.ops.triton_ops"
               if "vllm.runtime.modeling.lora" in text else "vllm.lora.ops.triton_ops")
        shrink = importlib.import_module(f"{pkg}.lora_shrink_op")
        expand = importlib.import_module(f"{pkg}.lora_expand_op")
        utils = importlib.import_module(f"{pkg}.utils")
        return shrink._lora_shrink, expand._lora_expand, utils
    except Exception as exc:                  # any import failure: skip vLLM, say why
        return f"import failed: {type(exc).__name__}: {exc}"


# ----------------------------------------------------------------------------------------------
def make_weights(hidden, rank, dtype, device, gen):
    """A pool of 128 adapters in both layouts: ours (flat, rank-exact) and vLLM's (stacked)."""
    a_all = (torch.randn(POOL_SLOTS, rank, hidden, generator=gen, device=device)
             / hidden ** 0.5).to(dtype)
    bt_all = (torch.randn(POOL_SLOTS, rank, hidden, generator=gen, device=device)
              / rank ** 0.5).to(dtype)
    idx = torch.arange(POOL_SLOTS, dtype=torch.int64, device=device)
    return dict(
        a_all=a_all, bt_all=bt_all,
        pool=torch.cat([a_all.flatten(), bt_all.flatten()]),      # all A blobs, then all Bt
        a_off=(idx * rank * hidden).view(1, -1),
        b_off=(POOL_SLOTS * rank * hidden + idx * rank * hidden).view(1, -1),
        ranks=torch.full((POOL_SLOTS,), rank, dtype=torch.int32, device=device),
        # every offset is a multiple of rank x hidden: the alignment the engine's pool promises
        align=8 if rank * hidden % 8 == 0 else 1,
        scales=torch.full((POOL_SLOTS,), SCALE, dtype=torch.float32, device=device),
        a_stacked=a_all.view(POOL_SLOTS, 1, rank, hidden),          # [loras, 1, r, K]
        b_stacked=bt_all.transpose(1, 2).contiguous().view(POOL_SLOTS, 1, hidden, rank))


def make_problem(weights, hidden, rank, t, n, dtype, device, gen):
    """x, y0, W and the segment metadata for T tokens spread evenly over n adapters."""
    slots = sorted(torch.randperm(POOL_SLOTS, generator=gen, device=device)[:n].tolist())
    lens = [t // n + (i < t % n) for i in range(n)]
    starts = [0]
    for ln in lens:
        starts.append(starts[-1] + ln)
    pad = POOL_SLOTS + 1 - n

    def i32(values):
        return torch.tensor(values, dtype=torch.int32, device=device)

    token_slot = torch.repeat_interleave(torch.tensor(slots), torch.tensor(lens)).to(device)
    return dict(
        weights, hidden=hidden, rank=rank, t=t, n=n, slots=slots, starts=starts,
        x=torch.randn(t, hidden, generator=gen, device=device).to(dtype),
        y0=torch.randn(t, hidden, generator=gen, device=device).to(dtype),
        w=(torch.randn(hidden, hidden, generator=gen, device=device) / hidden ** 0.5).to(dtype),
        seg_start=i32(starts + [t]), seg_slot=i32(slots + [-1]),        # one padded segment
        token_slot=token_slot,
        # vLLM metadata, as LoRAKernelMeta.prepare_tensors builds it (tokens already sorted)
        token_lora_mapping=token_slot.to(torch.int32),
        token_indices_sorted_by_lora_ids=torch.arange(t, dtype=torch.int32, device=device),
        lora_ids=i32(slots + [-1] * pad), num_tokens_per_lora=i32(lens + [0] * pad),
        lora_token_start_loc=i32(starts + [0] * pad),
        no_lora_flag_cpu=torch.tensor([False]),
        num_active_loras=torch.tensor([n], dtype=torch.int32))


def reference(p):
    """fp32: y0 + s * (x @ A.T) @ Bt per adapter segment."""
    ref = p["y0"].float().clone()
    for i, s in enumerate(p["slots"]):
        lo, hi = p["starts"][i], p["starts"][i + 1]
        v = p["x"][lo:hi].float() @ p["a_all"][s].float().T
        ref[lo:hi] += SCALE * v @ p["bt_all"][s].float()
    return ref


def impl_fn(name, p, y, vllm):
    """A closure that adds the LoRA delta into y in place (ours/vllm/loop/gather)."""
    args = (y, p["x"], p["pool"], p["a_off"], p["b_off"], p["ranks"], p["scales"],
            [0, p["hidden"]], p["seg_start"], p["seg_slot"], p["rank"])
    if name == "ours":          # what the engine's eager steps call (with the host tables)
        from kernels.sgmv import sgmv
        from kernels.sgmv_choice import HostSegments, only_live_segment
        host = HostSegments(only_live_segment(p["starts"] + [p["t"]], p["slots"] + [-1]),
                            p["a_off"].cpu().numpy(), p["b_off"].cpu().numpy(),
                            p["ranks"].cpu().numpy(), p["scales"].cpu().numpy())
        return lambda: sgmv(*args, host=host, align=p["align"])
    if name == "ours_nopdl":
        from kernels import pdl
        ours = impl_fn("ours", p, y, vllm)

        def run():                             # the flag is read at each launch
            with pdl.disabled():
                ours()
        return run
    if name == "vllm_pdl":
        plain = impl_fn("vllm", p, y, vllm)

        def run():                             # vLLM reads the flag at each call
            _ENV_DEFAULTS["VLLM_LORA_ENABLE_DUAL_STREAM"] = True
            try:
                plain()
            finally:
                _ENV_DEFAULTS.pop("VLLM_LORA_ENABLE_DUAL_STREAM")
        return run
    if name in ("ours_fused", "ours_split"):
        from kernels.sgmv_split import sgmv_split
        from kernels.sgmv_triton import sgmv_triton
        if name == "ours_fused":
            return lambda: sgmv_triton(*args)
        return lambda: sgmv_split(*args, align=p["align"])
    if name == "vllm":
        shrink, expand, _ = vllm
        meta = {k: p[k] for k in ("token_lora_mapping", "token_indices_sorted_by_lora_ids",
                                  "num_tokens_per_lora", "lora_token_start_loc", "lora_ids",
                                  "no_lora_flag_cpu", "num_active_loras")}
        s_kw = _kwargs(shrink, dict(meta, inputs=p["x"], lora_a_weights=[p["a_stacked"]],
                                    scaling=SCALE))
        e_kw = _kwargs(expand, dict(meta, lora_b_weights=[p["b_stacked"]], output_tensor=y,
                                    offset_start=0, add_inputs=True))

        def run():                             # as PunicaWrapperGPU.add_lora_linear
            buf = torch.empty((1, p["t"], p["rank"]), dtype=torch.float32, device=y.device)
            shrink(output_tensor=buf, **s_kw)
            expand(inputs=buf, **e_kw)
        return run
    if name == "loop":
        segs = [(p["starts"][i], p["starts"][i + 1], s) for i, s in enumerate(p["slots"])]

        def run():
            for lo, hi, s in segs:
                y[lo:hi].addmm_(p["x"][lo:hi] @ p["a_all"][s].T, p["bt_all"][s], alpha=SCALE)
        return run
    if name == "gather":
        def run():
            v = torch.bmm(p["a_all"][p["token_slot"]], p["x"].unsqueeze(2))       # [T, r, 1]
            d = torch.bmm(v.transpose(1, 2), p["bt_all"][p["token_slot"]])      # [T, 1, N]
            y.add_(d.squeeze(1), alpha=SCALE)
        return run
    raise ValueError(name)


def _kwargs(fn, available):
    """The keyword arguments fn takes, from what we have; vLLM's signature varies by version."""
    params = inspect.signature(fn).parameters
    needed = [k for k, v in params.items() if v.default is inspect.Parameter.empty]
    missing = [k for k in needed if k not in available and k not in ("inputs", "output_tensor")]
    if missing:
        raise TypeError(f"{fn.__name__} needs arguments this bench does not know: {missing}")
    return {k: v for k, v in available.items() if k in params}


# ----------------------------------------------------------------------------------------------
def capture_graph(fns):
    """The calls captured back to back in one CUDA graph (after a run on a side stream, as
    torch asks before a capture)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for f in fns:
            f()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for f in fns:
            f()
    return graph


def time_us(fn, device, warmup_ms, rep_ms):
    """Median µs per call: CUDA-graph replays under do_bench (L2 flushed) on GPU, wall clock on
    CPU.

    fn may be a list of calls: they are captured back to back in one graph and the replay time is
    divided by their number ("chain": how kernels run inside the engine's decode graph, where one
    graph launch serves hundreds of kernels). One call alone per graph includes the fixed cost of
    a graph launch (header graph_floor_us)."""
    fns = fn if isinstance(fn, list) else [fn]
    for f in fns:
        f()
    if device.type != "cuda":
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            for f in fns:
                f()
            times.append((time.perf_counter() - t0) * 1e6 / len(fns))
        return statistics.median(times)
    import triton
    graph = capture_graph(fns)
    ms = triton.testing.do_bench(graph.replay, warmup=warmup_ms, rep=rep_ms, return_mode="median")
    del graph
    return ms * 1e3 / len(fns)


def copy_tbps(device, gib, warmup_ms, rep_ms):
    """Device-to-device copy bandwidth, bytes read + written per second, in TB/s. Timed eagerly:
    inside a CUDA graph a plain copy becomes a copy-engine node, far slower than the SMs' copy."""
    n = int(gib * 2 ** 30)
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    if device.type == "cuda":
        import triton
        us = triton.testing.do_bench(lambda: dst.copy_(src), warmup=warmup_ms, rep=rep_ms,
                                     return_mode="median") * 1e3
    else:
        us = time_us(lambda: dst.copy_(src), device, warmup_ms, rep_ms)
    del src, dst
    return 2 * n / (us * 1e-6) / 1e12


def lora_bytes(p, elem):
    return elem * (p["t"] * p["hidden"] * 3 + p["n"] * p["rank"] * 2 * p["hidden"])


def base_bytes(p, elem):
    return elem * (2 * p["t"] * p["hidden"] + p["hidden"] ** 2)


def measure(name, probs, device, vllm, args):
    """One row: median µs of one call per graph, and per call in a chain over all the problems
    (each with its own weights and inputs, so every call reads cold memory after the L2 flush);
    the error of one run of the first problem from y0 against the fp32 reference."""
    p = probs[0]
    row = {"impl": name, "T": p["t"], "n": p["n"], "rank": p["rank"], "median_us": None,
           "chain_us": None, "max_err": None, "ok": False}
    try:
        fns = []
        for i, q in enumerate(probs):
            if name == "base":
                out = torch.empty_like(q["y0"])
                fns.append(lambda q=q, out=out: torch.mm(q["x"], q["w"], out=out))
            else:
                out = q["y0"].clone()
                fns.append(impl_fn(name, q, out, vllm))
            if i == 0:
                fns[0]()
                ref = p["x"].float() @ p["w"].float() if name == "base" else reference(p)
                err = (out.float() - ref).abs()
                row["max_err"] = float(err.max())
                row["ok"] = bool((err / (1 + ref.abs())).max() <= TOL)
        row["median_us"] = round(time_us(fns[0], device, args.warmup_ms, args.rep_ms), 2)
        if len(fns) > 1:
            row["chain_us"] = round(time_us(fns, device, args.warmup_ms, args.rep_ms), 2)
    except Exception as exc:                  # keep going: one failing impl must not stop the run
        row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
    return row


def run(args):
    device = torch.device(args.device)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    status = {"ours": "ok", "ours_nopdl": "ok", "ours_fused": "ok", "ours_split": "ok",
              "vllm": "ok", "vllm_pdl": "ok"}
    vllm = load_vllm(args.vllm_src)
    if isinstance(vllm, str):
        status["vllm"], vllm = "skipped: " + vllm, None
        status["vllm_pdl"] = status["vllm"]
    from kernels import pdl
    if not pdl.enabled(device):
        for key in ("ours_nopdl", "vllm_pdl"):
            status[key] = "skipped: no programmatic dependent launch on this device"
    if device.type == "cpu" and not interpreted:
        for key in ("ours", "ours_fused", "ours_split", "vllm"):
            status[key] = "skipped: CPU without TRITON_INTERPRET=1"
    impls = [i for i in IMPLS if status.get(i, "ok") == "ok"]
    shapes = args.shapes or (QUICK if args.quick else FULL)
    t_start, rows, base_cache = time.time(), [], {}
    header = {"date": datetime.datetime.now().isoformat(timespec="seconds"),
              "gpu": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "triton": _triton_version(),
              "cuda": torch.version.cuda, "hidden": args.hidden, "dtype": args.dtype,
              "pool_slots": POOL_SLOTS, "impls": status, "tolerance": TOL,
              "method": "median of CUDA-graph replays, triton.testing.do_bench, L2 flushed",
              "chain": args.chain}
    copy_gib = args.copy_gib if device.type == "cuda" else min(args.copy_gib, 1 / 16)
    header["copy_tbps"] = copy_tbps(device, copy_gib, args.warmup_ms, args.rep_ms)
    if device.type == "cuda":       # what this harness measures for a graph of one tiny kernel
        one = torch.zeros(1, device=device)
        header["graph_floor_us"] = round(time_us(lambda: one.add_(1), device, args.warmup_ms,
                                                 args.rep_ms), 2)
    print(f"device copy: {header['copy_tbps']:.2f} TB/s; impls: {status}", flush=True)
    elem = torch.finfo(dtype).bits // 8
    gen = torch.Generator(device=device).manual_seed(0)
    weights = {}
    with torch.inference_mode():
        for rank, t, n in shapes:
            if time.time() - t_start > args.budget_s:
                print(f"time budget reached; skipping r={rank} T={t} n={n}", flush=True)
                header.setdefault("skipped_shapes", []).append([rank, t, n])
                continue
            if vllm is not None:               # its pointer cache is keyed by data_ptr only
                vllm[2]._LORA_A_PTR_DICT.clear()
                vllm[2]._LORA_B_PTR_DICT.clear()
            if rank not in weights:
                weights.clear()
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                weights[rank] = [make_weights(args.hidden, rank, dtype, device, gen)
                                 for _ in range(args.chain)]
            probs = [make_problem(w, args.hidden, rank, t, n, dtype, device, gen)
                     for w in weights[rank]]
            p = probs[0]
            floor = lora_bytes(p, elem) / (header["copy_tbps"] * 1e12) * 1e6
            if t not in base_cache:
                base_cache[t] = measure("base", probs, device, vllm, args)
            shape_rows = [dict(base_cache[t], rank=rank, n=n)]
            shape_rows += [measure(name, probs, device, vllm, args) for name in impls]
            for row in shape_rows:
                row["floor_us"] = round(floor, 2)
                nbytes = base_bytes(p, elem) if row["impl"] == "base" else lora_bytes(p, elem)
                if row["median_us"]:
                    row["tbps"] = round(nbytes / (row["median_us"] * 1e-6) / 1e12, 3)
                    row["copy_frac"] = round(row["tbps"] / header["copy_tbps"], 3)
            rows += shape_rows
            print(" ".join(f"{r['impl']}={r['median_us']}{'' if r['ok'] else '!'}"
                           for r in shape_rows), f"<- r={rank} T={t} n={n}", flush=True)
            del p, probs
            if device.type == "cuda":
                torch.cuda.empty_cache()
    header["wall_s"] = round(time.time() - t_start, 1)
    return header, rows


def _triton_version():
    try:
        import triton
        return triton.__version__
    except ImportError:
        return None


# ----------------------------------------------------------------------------------------------
def _ratio(num, den):
    return f"{num / den:.2f}" if num and den else "–"


def write_markdown(path, header, rows):
    by = {}
    for r in rows:
        by.setdefault((r["rank"], r["T"], r["n"]), {})[r["impl"]] = r
    chain = header.get("chain", 1)

    def cell(r, key="median_us"):
        if not r or r.get(key) is None:
            return "–"
        return f"{r[key]:.1f}" + ("" if r["ok"] else " ✗")

    def val(d, impl, key):
        return (d.get(impl) or {}).get(key)

    lines = [f"# LoRA kernels on {header['gpu']} ({header['date']})", "",
             f"torch {header['torch']}, triton {header['triton']}, CUDA {header['cuda']}; "
             f"hidden {header['hidden']}, {header['dtype']}; device copy "
             f"{header['copy_tbps']:.2f} TB/s (eager); {header['method']}.", "",
             "Impls: " + "; ".join(f"{k}: {v}" for k, v in header["impls"].items()), "",
             "Median µs per call (✗ = wrong result). floor = useful bytes / copy bandwidth; "
             "%copy = our achieved bandwidth as a share of the copy; best = the faster of vLLM "
             "and the cuBLAS loop.", ""]
    if header.get("remeasured"):
        re_ = header["remeasured"]
        lines += [f"Shapes re-run on {re_['date']} (every impl, same card): "
                  + ", ".join(f"r={r} T={t} n={n}" for r, t, n in re_["shapes"])
                  + f" - {re_['why']}.", ""]
    lines += [f"After the run: {note}" for note in header.get("notes", [])]
    if header.get("notes"):
        lines.append("")
    if chain > 1:
        lines += [f"## Chained: {chain} calls back to back in one graph, per call", "",
                  "As kernels run inside the engine's decode graph: each call has its own "
                  "weights and inputs (cold after the L2 flush), and the graph launch is shared.",
                  "ours is launched with programmatic dependent launch where the device has it; "
                  "no PDL is the same without; vLLM PDL is vLLM's kernels with their PDL path "
                  "(off by default in vLLM).", "",
                  "| r | T | n | base | floor | ours | vLLM | loop | ours/vLLM | ours/best "
                  "| ours %copy | fused | split | no PDL | vLLM PDL |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for (rank, t, n), d in by.items():
            ours, vl, lp = (val(d, i, "chain_us") for i in ("ours", "vllm", "loop"))
            best = min(x for x in (vl, lp) if x) if (vl or lp) else None
            floor = next(iter(d.values()))["floor_us"]
            frac = f"{100 * floor / ours:.0f}%" if ours else "–"
            lines.append(
                f"| {rank} | {t} | {n} | {cell(d.get('base'), 'chain_us')} | {floor:.1f} | "
                f"{cell(d.get('ours'), 'chain_us')} | {cell(d.get('vllm'), 'chain_us')} | "
                f"{cell(d.get('loop'), 'chain_us')} | {_ratio(ours, vl)} | {_ratio(ours, best)} "
                f"| {frac} | {cell(d.get('ours_fused'), 'chain_us')} | "
                f"{cell(d.get('ours_split'), 'chain_us')} | "
                f"{cell(d.get('ours_nopdl'), 'chain_us')} | "
                f"{cell(d.get('vllm_pdl'), 'chain_us')} |")
        lines.append("")
    lines += ["## One call per graph", "",
              "A graph of one trivial kernel measures "
              f"{header.get('graph_floor_us', float('nan')):.1f} µs here: every figure in this "
              "table includes that fixed cost.", "",
              "| r | T | n | base | floor | ours | vLLM | loop | gather | ours/vLLM | ours/best "
              "| ours %copy | fused | split |", "|---|---|---|---|---|---|---|---|---|---|---|---|"
              "---|---|"]
    for (rank, t, n), d in by.items():
        ours, vl, lp = (val(d, i, "median_us") for i in ("ours", "vllm", "loop"))
        best = min(x for x in (vl, lp) if x) if (vl or lp) else None
        frac = f"{100 * d['ours']['copy_frac']:.0f}%" if d.get("ours", {}).get("copy_frac") \
            else "–"
        floor = next(iter(d.values()))["floor_us"]
        lines.append(f"| {rank} | {t} | {n} | {cell(d.get('base'))} | {floor:.1f} | "
                     f"{cell(d.get('ours'))} | {cell(d.get('vllm'))} | {cell(d.get('loop'))} | "
                     f"{cell(d.get('gather'))} | {_ratio(ours, vl)} | {_ratio(ours, best)} | "
                     f"{frac} | {cell(d.get('ours_fused'))} | {cell(d.get('ours_split'))} |")
    errors = [f"- {r['impl']} r={r['rank']} T={r['T']} n={r['n']}: {r['error']}"
              for r in rows if r.get("error")]
    if errors:
        lines += ["", "Errors:", *errors]
    if header.get("skipped_shapes"):
        lines += ["", f"Skipped for time: {header['skipped_shapes']}"]
    path.write_text("\n".join(lines) + "\n")


def write_plot(path, rows):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    ranks = sorted({r["rank"] for r in rows})
    fig, axes = plt.subplots(1, len(ranks), figsize=(7 * len(ranks), 4.5), squeeze=False)
    for ax, rank in zip(axes[0], ranks):
        shapes = sorted({(r["T"], r["n"]) for r in rows if r["rank"] == rank})
        for impl in ("base", *IMPLS):
            pts = {(r["T"], r["n"]): r["median_us"] for r in rows
                   if r["rank"] == rank and r["impl"] == impl and r["median_us"]}
            if pts:
                ax.plot(range(len(shapes)), [pts.get(s) for s in shapes], marker="o", label=impl)
        floors = {(r["T"], r["n"]): r["floor_us"] for r in rows if r["rank"] == rank}
        ax.plot(range(len(shapes)), [floors[s] for s in shapes], "k--", label="floor")
        ax.set_xticks(range(len(shapes)), [f"{t}/{n}" for t, n in shapes], rotation=60)
        ax.set_yscale("log")
        ax.set_title(f"rank {rank}")
        ax.set_xlabel("T / n adapters")
        ax.set_ylabel("µs (median)")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def _parse_shapes(text):
    return [tuple(int(v) for v in item.split(":")) for item in text.split(",")]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--vllm-src", help="folder with vLLM's lora ops files (lora_shrink_op.py, ...)")
    ap.add_argument("--quick", action="store_true", help="3 shapes, a smoke test")
    ap.add_argument("--shapes", type=_parse_shapes, help="r:T:n,... instead of the sweep")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"])
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--warmup-ms", type=float, default=25)
    ap.add_argument("--rep-ms", type=float, default=100)
    ap.add_argument("--copy-gib", type=float, default=2.0)
    ap.add_argument("--budget-s", type=float, default=300, help="stop starting new shapes after")
    ap.add_argument("--chain", type=int, default=8,
                    help="problems per shape (own weights each), timed back to back in one graph")
    args = ap.parse_args()
    header, rows = run(args)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "kernels-h200.json").write_text(json.dumps({"header": header, "rows": rows},
                                                           indent=1))
    write_markdown(args.out / "kernels-h200.md", header, rows)
    plotted = write_plot(args.out / "kernels-h200.png", rows)
    print(f"wrote {args.out}/kernels-h200.json, .md{', .png' if plotted else ''} "
          f"in {header['wall_s']} s", flush=True)


if __name__ == "__main__":
    main()
