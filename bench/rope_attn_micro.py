"""(exp/lora-fused) Chained qkv shrink -> (expand + rope | fused rope) -> decode attention at the e2e shapes
(64 rows, 32 rank-16 adapters, 32 MHA heads of 128, 192 tokens of context), CUDA graphs of 20
chained steps, PDL as in the engine. Does the fused rope's grid delay attention?"""
import os, sys, itertools
sys.path[:0] = ["tests", "."]
import torch
from test_sgmv import build_case
from kernels import lora_fused as lf
from kernels.fused import rope_write_kv_
from kernels.sgmv_split import pick_split_config, shrink
from kernels.attention_triton import paged_attention_triton

dev = "cuda"
T, HQ, D, BS, CTX = 64, 32, 128, 16, 192
HID = HQ * D
c = build_case(("bf16", HID, (HID,) * 3, T, "uniform", 32, 16, ""), seed=1, device=dev)
c["ranks"].fill_(16)
qkv = c["y"]
nb = T * (CTX // BS + 2)
kc = torch.randn(nb, BS, HQ, D, device=dev, dtype=torch.bfloat16); vc = torch.randn_like(kc)
bt = torch.arange(nb, device=dev, dtype=torch.int32).view(T, -1)
q_seq = torch.arange(T, device=dev, dtype=torch.int32)
q_pos = torch.full((T,), CTX - 1, device=dev, dtype=torch.int32)
pos = q_pos.long()
slots = (bt[:, (CTX - 1) // BS].long() * BS + (CTX - 1) % BS)
cos = torch.randn(1024, D // 2, device=dev, dtype=torch.bfloat16); sin = torch.randn_like(cos)
cfg = pick_split_config(T, 16, True, c["seg_slot"].shape[0])

def deferred():
    sh = shrink(c["x"], c["pool"], c["a_off"], c["ranks"], c["seg_start"], c["seg_slot"], 3, 16,
                cfg, align=1)
    return lf.DeferredLora(sh, c["pool"], c["b_off"], c["ranks"], c["scales"], c["slice_starts"],
                           c["seg_start"], c["seg_slot"], 16, 1, cfg)

def views():
    return (qkv[:, :HID].view(T, HQ, D), qkv[:, HID:2 * HID].view(T, HQ, D),
            qkv[:, 2 * HID:].view(T, HQ, D))

def attn():
    paged_attention_triton(qkv[:, :HID].view(T, HQ, D), kc, vc, bt, q_seq, q_pos, D ** -0.5, CTX)

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

res = {}
res["attention alone"] = timed(attn)
res["rope + attention"] = timed(lambda: (rope_write_kv_(*views(), cos, sin, pos, kc, vc, slots), attn()))
res["shrink + expand + rope + attention"] = timed(lambda: (
    deferred().expand_into(qkv), rope_write_kv_(*views(), cos, sin, pos, kc, vc, slots), attn()))
for rw, ch in ((2, 4), (2, 8), (4, 8), (8, 8), (8, 4)):
    os.environ["LORAFLEET_LORA_FUSED"] = f"rope_warps={rw},rope_heads={ch}"
    res[f"shrink + fused rope {rw}w {ch}h + attention"] = timed(lambda: (
        lf.qkv_rope_write_kv_(qkv, HQ, HQ, cos, sin, pos, kc, vc, slots, deferred()), attn()))
    res[f"shrink + fused rope {rw}w {ch}h"] = timed(lambda: lf.qkv_rope_write_kv_(
        qkv, HQ, HQ, cos, sin, pos, kc, vc, slots, deferred()))
res["shrink + expand + rope"] = timed(lambda: (
    deferred().expand_into(qkv), rope_write_kv_(*views(), cos, sin, pos, kc, vc, slots)))
for name, v in res.items():
    print(f"{name:48s} {v:8.2f} us")
