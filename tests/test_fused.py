"""The fused elementwise kernels (kernels/fused.py) against their torch semantics, run under the
Triton interpreter in a child process (TRITON_INTERPRET must be set before triton loads)."""
from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import torch

ROOT = pathlib.Path(__file__).resolve().parent.parent


def check(device: str = "cpu") -> None:
    from kernels import fused
    g = torch.Generator().manual_seed(0)
    for dtype, tol in ((torch.float32, 1e-5), (torch.float16, 2e-3)):
        x = torch.randn(7, 96, generator=g).to(device, dtype)
        w = torch.randn(96, generator=g).to(device, dtype)
        torch.testing.assert_close(fused.rms_norm(x, w, 1e-5, impl="triton"),
                                   fused.rms_norm_ref(x, w, 1e-5), atol=tol, rtol=tol)
        d = torch.randn(7, 96, generator=g).to(device, dtype)
        h1, h2 = x.clone(), x.clone()
        out = fused.add_rms_norm(h1, d, w, 1e-5, impl="triton")
        ref = fused.add_rms_norm_ref(h2, d, w, 1e-5)
        torch.testing.assert_close(h1, h2, atol=tol, rtol=tol)
        torch.testing.assert_close(out, ref, atol=tol, rtol=tol)
        # with the delta's own norm (Gemma's output norms): as the two launches it replaces
        dw = (1 + 0.1 * torch.randn(96, generator=g)).to(device, dtype)
        h1, h2 = x.clone(), x.clone()
        out = fused.add_rms_norm(h1, d, w, 1e-5, impl="triton", delta_norm=dw)
        ref = fused.add_rms_norm_ref(h2, fused.rms_norm_ref(d, dw, 1e-5), w, 1e-5)
        torch.testing.assert_close(h1, h2, atol=tol, rtol=tol)
        torch.testing.assert_close(out, ref, atol=tol, rtol=tol)
        assert (h1 - (x + d)).abs().max() > 10 * tol        # the delta was normed, not added
        qkv = torch.randn(5, (4 + 2 + 2) * 16, generator=g).to(device, dtype)
        pos = torch.tensor([0, 3, 9, 2, 30]).to(device)
        cos = torch.randn(64, 8, generator=g).to(device, dtype)
        sin = torch.randn(64, 8, generator=g).to(device, dtype)
        a, b = qkv.clone(), qkv.clone()
        for t, impl in ((a, "triton"), (b, "torch")):
            q = t[:, :64].view(5, 4, 16)
            k = t[:, 64:96].view(5, 2, 16)
            fused.rope_(q, k, cos, sin, pos, impl=impl)
        torch.testing.assert_close(a, b, atol=10 * tol, rtol=10 * tol)
        check_rope_write_kv(g, device, dtype, tol)
        check_rope_write_kv(g, device, dtype, tol, folded=True)
        check_rope_write_kv(g, device, dtype, tol, qk=True)            # Qwen3's, Gemma 3's
        fused.ROPE_LAUNCH["parts"] = 3          # each row's heads and v in three programs
        try:
            check_rope_write_kv(g, device, dtype, tol, folded=True)
            check_rope_write_kv(g, device, dtype, tol, qk=True)
        finally:
            fused.ROPE_LAUNCH["parts"] = 1
        gu = torch.randn(6, 2 * 80, generator=g).to(device, dtype)
        torch.testing.assert_close(fused.silu_mul(gu, impl="triton"), fused.silu_mul_ref(gu),
                                   atol=tol, rtol=tol)
        gelu = fused.gate_mul(3 * gu, "gelu_pytorch_tanh", impl="triton")     # GeGLU
        torch.testing.assert_close(gelu, fused.silu_mul_ref(3 * gu, act="gelu_pytorch_tanh"),
                                   atol=tol, rtol=tol)
        gate, up = (3 * gu).float().chunk(2, dim=-1)
        torch.testing.assert_close(gelu.float(), torch.nn.functional.gelu(gate, approximate="tanh")
                                   * up, atol=4 * tol, rtol=4 * tol)
        # folded norms: gate and up scaled by each row's RMS factor of h (H = 96 of 128 lanes)
        h = (torch.randn(6, 96, generator=g) * torch.arange(1, 7)[:, None]).to(device, dtype)
        got = fused.silu_mul(gu, impl="triton", rms=(h, 1e-5))
        torch.testing.assert_close(got, fused.silu_mul_ref(gu, (h, 1e-5)), atol=tol, rtol=tol)
        normed = fused.rms_norm_ref(h, torch.ones(96, dtype=dtype, device=device), 1e-5)
        factor = (normed.float() / h.float()).mean(-1, keepdim=True)
        unscaled = fused.silu_mul_ref(gu)
        assert not torch.allclose(got, unscaled, atol=tol, rtol=tol)    # the factor did act
        torch.testing.assert_close(fused.silu_mul_ref((gu.float() * factor).to(dtype)), got,
                                   atol=20 * tol, rtol=20 * tol)


def check_rope_write_kv(g, device, dtype, tol, folded: bool = False, qk: bool = False) -> None:
    """The fused rope + KV write (GQA: 4 q heads, 2 kv heads; one row with no slot) against
    rope_ then write_kv; caches poisoned with NaN, so unwritten or stray writes show. folded:
    with rms=(h, eps), against q, k, v scaled by h's row factors first. qk: with q/k norms
    (their own weights), against qk_norm_ref before the rotation."""
    from kernels import fused
    from kernels.attention_ref import write_kv_ref
    t, hq, hk, d = 5, 4, 2, 16
    qkv = torch.randn(t, (hq + 2 * hk) * d, generator=g).to(device, dtype)
    pos = torch.tensor([0, 3, 9, 2, 30]).to(device)
    slots = torch.tensor([5, -1, 0, 13, 7]).to(device)
    cos = torch.randn(64, d // 2, generator=g).to(device, dtype)
    sin = torch.randn(64, d // 2, generator=g).to(device, dtype)
    rms = qk_norm = None
    if folded:
        rms = ((torch.randn(t, 40, generator=g) * 3).to(device, dtype), 1e-5)
    if qk:
        qk_norm = ((1 + torch.randn(d, generator=g)).to(device, dtype),
                   (1 + torch.randn(d, generator=g)).to(device, dtype), 1e-6)
    out = []
    for impl in ("triton", "torch", "fallback"):
        x = qkv.clone()
        q = x[:, :hq * d].view(t, hq, d)
        k = x[:, hq * d:(hq + hk) * d].view(t, hk, d)
        v = x[:, (hq + hk) * d:].view(t, hk, d)
        kc = torch.full((4, 4, hk, d), float("nan"), dtype=dtype, device=device)
        vc = kc.clone()
        if impl == "triton":
            fused.rope_write_kv_(q, k, v, cos, sin, pos, kc, vc, slots, impl="triton", rms=rms,
                                 qk_norm=qk_norm)
        elif impl == "fallback":       # not side by side: the two ops (and torch's scaling)
            fused.rope_write_kv_(q.clone(), k, v.clone(), cos, sin, pos, kc, vc, slots,
                                 impl="triton", rms=rms, qk_norm=qk_norm)
            x = None
        else:
            if folded:               # q and k scaled in place, v only in the cache
                x[:, :(hq + hk) * d] = fused.scale_rows_ref(x[:, :(hq + hk) * d], rms)
                v = fused.scale_rows_ref(v, rms)
            if qk:
                fused.qk_norm_ref(q, k, qk_norm)
            fused.rope_ref(q, k, cos, sin, pos)
            write_kv_ref(kc, vc, k, v, slots)
        out.append((x, kc, vc))
    for got, want, fallback in zip(*out):
        torch.testing.assert_close(got, want, atol=10 * tol, rtol=10 * tol, equal_nan=True)
        if fallback is not None:
            torch.testing.assert_close(fallback, want, atol=10 * tol, rtol=10 * tol,
                                       equal_nan=True)
    assert out[0][1].isnan().sum() == out[0][1].numel() - 4 * hk * d     # 4 rows written


def test_fused_kernels_match_torch_under_the_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, __file__], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "ok" in proc.stdout


if __name__ == "__main__":
    check()
    print("ok")
