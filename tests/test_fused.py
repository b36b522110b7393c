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
        gu = torch.randn(6, 2 * 80, generator=g).to(device, dtype)
        torch.testing.assert_close(fused.silu_mul(gu, impl="triton"), fused.silu_mul_ref(gu),
                                   atol=tol, rtol=tol)


def check_rope_write_kv(g, device, dtype, tol) -> None:
    """The fused rope + KV write (GQA: 4 q heads, 2 kv heads; one row with no slot) against
    rope_ then write_kv; caches poisoned with NaN, so unwritten or stray writes show."""
    from kernels import fused
    from kernels.attention_ref import write_kv_ref
    t, hq, hk, d = 5, 4, 2, 16
    qkv = torch.randn(t, (hq + 2 * hk) * d, generator=g).to(device, dtype)
    pos = torch.tensor([0, 3, 9, 2, 30]).to(device)
    slots = torch.tensor([5, -1, 0, 13, 7]).to(device)
    cos = torch.randn(64, d // 2, generator=g).to(device, dtype)
    sin = torch.randn(64, d // 2, generator=g).to(device, dtype)
    out = []
    for impl in ("triton", "torch"):
        x = qkv.clone()
        q = x[:, :hq * d].view(t, hq, d)
        k = x[:, hq * d:(hq + hk) * d].view(t, hk, d)
        v = x[:, (hq + hk) * d:].view(t, hk, d)
        kc = torch.full((4, 4, hk, d), float("nan"), dtype=dtype, device=device)
        vc = kc.clone()
        if impl == "triton":
            fused.rope_write_kv_(q, k, v, cos, sin, pos, kc, vc, slots, impl="triton")
        else:
            fused.rope_ref(q, k, cos, sin, pos)
            write_kv_ref(kc, vc, k, v, slots)
        out.append((x, kc, vc))
    for got, want in zip(*out):
        torch.testing.assert_close(got, want, atol=10 * tol, rtol=10 * tol, equal_nan=True)
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
