"""(exp/lora-fused) Micro timing of the fused LoRA expands at the e2e shapes (T=64, 32 rank-16 adapters,
hidden 4096, 32 heads of 128): shrink + expand + op against shrink + fused op, CUDA graphs of
20 chained calls; registers and spills of each compiled variant."""
import os, sys, json, itertools
sys.path[:0] = ["tests", "."]
import torch, triton
from test_sgmv import build_case
from kernels import lora_fused as lf
from kernels.fused import add_rms_norm, rope_write_kv_
from kernels.sgmv_split import pick_split_config, shrink, expand

dev = "cuda"
T, HID, HQ, D = 64, 4096, 32, 128

def case(widths):
    c = build_case(("bf16", HID, widths, T, "uniform", 32, 16, ""), seed=1, device=dev)
    # the pool's ranks are mixed 1..16; make all 16 (as the bench)
    c["ranks"].fill_(16)
    return c

def deferred(c):
    cfg = pick_split_config(T, 16, True, c["seg_slot"].shape[0])
    sh = shrink(c["x"], c["pool"], c["a_off"], c["ranks"], c["seg_start"], c["seg_slot"],
                len(c["slice_starts"]) - 1, 16, cfg, align=1)
    return lf.DeferredLora(sh, c["pool"], c["b_off"], c["ranks"], c["scales"], c["slice_starts"],
                           c["seg_start"], c["seg_slot"], 16, 1, cfg)

def timed(fn, n=20, reps=30):
    fn(); torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(n):
            fn()
    g.replay(); torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(True), torch.cuda.Event(True)
        a.record(); g.replay(); b.record(); b.synchronize()
        ts.append(a.elapsed_time(b) * 1e3 / n)
    ts.sort()
    return ts[len(ts) // 2]

out = {}
# norm (o): widths (4096,)
c = case((HID,))
h = torch.randn(T, HID, device=dev, dtype=torch.bfloat16)
w = torch.rand(HID, device=dev, dtype=torch.bfloat16) + 0.5
y = c["y"]
def shrink_only():
    deferred(c)
def unfused_norm():
    l = deferred(c); add_rms_norm(h, l.expand_into(y), w, 1e-5)
def norm_only():
    add_rms_norm(h, y, w, 1e-5)
out["norm: shrink"] = timed(shrink_only)
out["norm: plain add_rms_norm"] = timed(norm_only)
out["norm: shrink+expand+norm"] = timed(unfused_norm)
for nw in (4, 8, 16):
    os.environ["LORAFLEET_LORA_FUSED"] = f"norm_warps={nw}"
    def fused_norm():
        l = deferred(c); lf.add_rms_norm_lora(h, y, w, 1e-5, l)
    out[f"norm: shrink+fused norm_warps={nw}"] = timed(fused_norm)
# rope (qkv)
c = case((HQ * D, HQ * D, HQ * D))
qkv = c["y"]
pos = torch.randint(0, 190, (T,), device=dev)
slots = torch.randperm(4096, device=dev)[:T]
kc = torch.zeros(256, 16, HQ, D, device=dev, dtype=torch.bfloat16); vc = kc.clone()
cos = torch.randn(1024, D // 2, device=dev, dtype=torch.bfloat16); sin = cos.clone()
def views():
    return (qkv[:, :HQ*D].view(T, HQ, D), qkv[:, HQ*D:2*HQ*D].view(T, HQ, D), qkv[:, 2*HQ*D:].view(T, HQ, D))
def rope_only():
    rope_write_kv_(*views(), cos, sin, pos, kc, vc, slots)
def unfused_rope():
    l = deferred(c); l.expand_into(qkv); rope_write_kv_(*views(), cos, sin, pos, kc, vc, slots)
out["rope: shrink"] = timed(lambda: deferred(c))
out["rope: plain rope_write_kv_"] = timed(rope_only)
out["rope: shrink+expand+rope"] = timed(unfused_rope)
for rw, ch in itertools.product((2, 4, 8), (1, 2, 4, 8)):
    os.environ["LORAFLEET_LORA_FUSED"] = f"rope_warps={rw},rope_heads={ch}"
    def fused_rope():
        l = deferred(c); lf.qkv_rope_write_kv_(qkv, HQ, HQ, cos, sin, pos, kc, vc, slots, l)
    out[f"rope: shrink+fused rope_warps={rw},heads={ch}"] = timed(fused_rope)
for name, v in out.items():
    print(f"{name:48s} {v:8.2f} us")
for kern in (lf._lora_norm_kernel, lf._lora_rope_kv_kernel):
    try:
        for dev_cache in kern.device_caches.values():
            for key, ck in dev_cache[0].items():
                print(kern.fn.__name__, "regs", ck.n_regs, "spills", ck.n_spills, "warps",
                      ck.metadata.num_warps, "smem", ck.metadata.shared)
    except Exception as exc:
        print("no register report:", type(exc).__name__, exc)

# ---- the shrink beside the base GEMM (second stream) against after it
import torch.nn.functional as F
side = torch.cuda.Stream()
res = {}
for name, widths, n_out in (("qkv", (HQ * D,) * 3, 3 * HQ * D), ("o", (HID,), HID)):
    c = case(widths)
    x = c["x"]
    W = torch.randn(HID, n_out, device=dev, dtype=torch.bfloat16).t()   # [N, K], column-major
    yb = torch.empty(T, n_out, device=dev, dtype=torch.bfloat16)
    cfg = pick_split_config(T, 16, True, c["seg_slot"].shape[0])
    def run(overlap, with_lora=True):
        if with_lora:
            sh = shrink(x, c["pool"], c["a_off"], c["ranks"], c["seg_start"], c["seg_slot"],
                        len(widths), 16, cfg, align=1, stream=side if overlap else None)
        y = F.linear(x, W)
        if with_lora:
            if overlap:
                torch.cuda.current_stream().wait_stream(side)
            expand(y, sh, c["pool"], c["b_off"], c["ranks"], c["scales"], c["slice_starts"],
                   c["seg_start"], c["seg_slot"], 16, cfg)
    res[f"{name}: GEMM alone"] = timed(lambda: run(False, False))
    res[f"{name}: GEMM + shrink + expand, one stream"] = timed(lambda: run(False))
    res[f"{name}: GEMM + shrink + expand, shrink beside"] = timed(lambda: run(True))
for name, v in res.items():
    print(f"{name:48s} {v:8.2f} us")
