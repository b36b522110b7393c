"""kernels.adapter_scatter: the Triton kernel against its torch reference, on hand-made segments
(copies, B transposed, folded, into a column-major weight, zero rows, one longer than a
program's block) and on every segment of a real placement plan (services.worker.adapters.layout),
source dtypes bf16 / fp16 / fp32 into bf16 / fp32. Run under the Triton interpreter in a child
process (TRITON_INTERPRET must be set before triton loads); on CUDA too when there is one.

On CUDA the two agree bit for bit. The interpreter rounds float32 -> bfloat16 toward zero (the
GPU and torch round to nearest even), so where a segment rounds (a fold, a narrower dtype) it
may differ by one unit in the last place there."""
from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parent.parent
DTYPES = [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16),
          (torch.float16, torch.float32), (torch.float32, torch.float32)]


def same(got, want, device: str, rounds: bool) -> None:
    """Bit for bit, but for the interpreter's float32 -> bfloat16 rounding (module doc)."""
    loose = device != "cuda" and rounds and got.dtype == torch.bfloat16
    torch.testing.assert_close(got, want, equal_nan=True, atol=0,
                               rtol=2 ** -7 if loose else 0)


def hand_made(device: str) -> None:
    from kernels.adapter_scatter import BLOCK, ZERO, adapter_scatter
    g = torch.Generator().manual_seed(0)
    big = BLOCK + 37
    segs = torch.tensor([
        [0, 0, 0, 4, 40, 40, 40, 1, -1, 0],             # A as it is
        [0, 200, 160, 40, 4, 4, 1, 40, -1, 0],          # B [40, 4] -> Bt [4, 40]
        [0, 400, 320, 4, 40, 40, 40, 1, 2, 0],          # A times fold row 2
        [1, 100, 320, 4, 40, 40, 1, 30, 2, 0],          # ... into a column-major [30, 40]
        [1, 104, 0, 2, 40, 0, 1, 30, -1, ZERO],         # zeros, src not read
        [0, 1000, 1000, 1, big, big, big, 1, -1, 0],    # longer than one program's block
    ], dtype=torch.int64, device=device)
    # table writes as a placement makes them: int64 offsets (more than one program's block of
    # 256), then three int32 entries (a negative one: a scale's bits)
    n_wide = 300
    writes = torch.stack([torch.cat([torch.randperm(600, generator=g)[:n_wide],
                                     torch.tensor([5, 12, 19])]),
                          torch.cat([torch.randint(0, 1 << 40, (n_wide,), generator=g),
                                     torch.tensor([16, 3, -1082130432])])]).to(device)
    for src_dt, dst_dt in DTYPES:
        src = torch.randn(1000 + big, generator=g).to(device, src_dt)
        fold = (1 + 0.3 * torch.randn(3, 40, generator=g)).to(device, dst_dt)
        pool = torch.full((1000 + big,), float("nan"), dtype=dst_dt, device=device)
        ext = torch.full((1300,), float("nan"), dtype=dst_dt, device=device)
        outs = []
        for impl in ("triton", "torch"):
            p, e = pool.clone(), ext.clone()
            wide = torch.full((600,), -1, dtype=torch.int64, device=device)
            narrow = torch.zeros(3, 7, dtype=torch.int32, device=device)
            adapter_scatter(src, [p, e], segs, fold, max_elems=big, impl=impl,
                            tables=(writes, n_wide, wide, narrow))
            outs.append((p, e, wide, narrow))
        for got, want in zip(outs[0], outs[1]):
            same(got, want, device, rounds=True)
        written = ~torch.isnan(outs[0][0].float())
        assert int(written.sum()) == 4 * 40 * 3 + big           # nothing else touched
        wide, narrow = outs[0][2].cpu(), outs[0][3].cpu().view(-1)
        pos, val = writes.cpu()
        assert wide[pos[:n_wide]].tolist() == val[:n_wide].tolist()
        assert narrow[pos[n_wide:]].tolist() == val[n_wide:].to(torch.int32).tolist()
        assert int((wide != -1).sum()) == n_wide and int((narrow != 0).sum()) == 3


def real_plan(device: str) -> None:
    """A plan's segments (q/k/v/o + MLP, rank 5, GQA shapes) through both implementations."""
    import dataclasses
    from kernels.adapter_scatter import NFIELDS, adapter_scatter
    from services.worker.adapters.layout import SRC_ALIGN, staged_from_tensors
    from services.worker.model.spec import load_spec
    spec = dataclasses.replace(load_spec(ROOT / "models" / "tiny-llama"), num_layers=2)
    g = torch.Generator().manual_seed(1)
    for src_dt, dst_dt in DTYPES:
        tensors = {}
        for layer in range(spec.num_layers):
            for mod in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "down_proj"):
                k, n = spec.in_out(mod)
                part = "mlp" if mod in ("gate_proj", "down_proj") else "self_attn"
                pre = f"base_model.model.model.layers.{layer}.{part}.{mod}"
                tensors[f"{pre}.lora_A.weight"] = torch.randn(5, k, generator=g).to(src_dt)
                tensors[f"{pre}.lora_B.weight"] = torch.randn(n, 5, generator=g).to(src_dt)
        plan = staged_from_tensors(tensors, {"r": 5}, spec).plan
        staged = staged_from_tensors(tensors, {"r": 5}, spec)
        pad = -plan.data_start % SRC_ALIGN
        raw = torch.zeros(pad + staged.nbytes, dtype=torch.uint8)
        raw[pad:] = staged.blob
        src = raw[:raw.numel() // src_dt.itemsize * src_dt.itemsize].view(src_dt).to(device)
        segs = torch.from_numpy(plan.segs.copy())
        segs[:, 2] = (segs[:, 2] + pad) // src_dt.itemsize
        segs = segs.to(device)
        assert segs.shape[1] == NFIELDS
        outs = []
        for impl in ("triton", "torch"):
            pool = torch.full((plan.numel,), float("nan"), dtype=dst_dt, device=device)
            adapter_scatter(src, [pool], segs, None, max_elems=plan.max_elems, impl=impl)
            outs.append(pool)
        same(outs[0], outs[1], device, rounds=src_dt != dst_dt)
        for name, w in tensors.items():                    # and where the plan says
            layer, mod = int(name.split(".")[4]), name.split(".")[6]
            from services.worker.model.spec import MODULE_GROUP
            group, j = MODULE_GROUP[mod]
            a, b = plan.offsets[group][layer, j]
            want = w if name.endswith("lora_A.weight") else w.t()
            at = a if name.endswith("lora_A.weight") else b
            got = outs[0][at:at + want.numel()].view(want.shape).cpu()
            same(got, want.to(dst_dt), device, rounds=src_dt != dst_dt)


def pool_placements(device: str, kn: bool = True) -> None:
    """A pool that places through the Triton launch (the CUDA path: one launch that scatters
    the weights and writes the slot's table entries, from the kept scratch) on `device` (the
    CPU: interpreted) against a CPU pool that places through the torch reference: pool
    contents, device tables and column blocks (q/k/v A rows and, row LoRA, o Bt rows), with
    folded norms, bf16 and fp32 adapters, after a removal and a reuse of the slot. kn: the
    extended q/k/v and o weights column-major, as a CUDA model keeps them."""
    from services.worker.adapters.device_pool import DevicePool
    from services.worker.adapters.layout import staged_from_peft_dir
    from services.worker.model.lora_columns import LoraColumns
    from services.worker.model.spec import load_spec
    spec = load_spec(ROOT / "models" / "tiny-llama")
    adapters = ROOT / "models" / "adapters"
    g = torch.Generator().manual_seed(5)
    fold = {k: 1 + 0.2 * torch.randn(spec.num_layers, spec.hidden_size, generator=g)
            for k in ("qkv", "gate_up")}
    n_qkv = spec.slice_starts("qkv")[-1]
    base = [{"qkv": torch.randn(n_qkv, spec.hidden_size, generator=g),
             "o": torch.randn(spec.hidden_size, spec.q_size, generator=g)}
            for _ in range(spec.num_layers)]
    pools = []
    for dev, triton_path in (("cpu", False), (device, True)):
        layers = [{k: (w.t().contiguous().t() if kn else w.clone()).to(dev, torch.bfloat16)
                   for k, w in ws.items()} for ws in base]
        cols = LoraColumns({"layers": layers}, 3, 2, torch.device(dev), rows=True)
        pool = DevicePool(spec, torch.device(dev), torch.bfloat16, 1 << 22, 4, columns=cols,
                          norm_fold={k: v.to(dev, torch.bfloat16) for k, v in fold.items()})
        pool._copy.triton = triton_path
        pool.warm_up()
        names = sorted(p.name for p in adapters.iterdir() if p.is_dir())
        for n in names:
            pool.place(n, staged_from_peft_dir(adapters / n, spec))
        pool.remove(names[0])
        pool.place("again", staged_from_peft_dir(adapters / names[0], spec))
        pools.append(pool)
    ref, tri = pools
    same(tri.tables.pool.cpu(), ref.tables.pool, device, rounds=True)
    assert torch.equal(ref._off64, tri._off64.cpu())
    assert torch.equal(ref._meta32, tri._meta32.cpu())
    assert int((tri._off64 >= 0).sum()) > 0 and int(tri._meta32[0].sum()) > 0
    for a, b in zip(ref.columns.ext + ref.columns.o_ext, tri.columns.ext + tri.columns.o_ext):
        same(b.cpu(), a, device, rounds=True)
    assert any(e[:, spec.q_size:].any() for e in ref.columns.o_ext)     # some o rows written


def _child(fn: str) -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    code = f"from tests.test_adapter_scatter import {fn}; {fn}('cpu')"
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]


def test_scatter_kernel_matches_the_reference_on_hand_made_segments():
    _child("hand_made")


def test_scatter_kernel_matches_the_reference_on_a_placement_plan():
    _child("real_plan")


def test_a_pool_placing_through_the_kernel_writes_what_the_reference_writes():
    _child("pool_placements")


@pytest.mark.gpu
def test_scatter_kernel_on_cuda():
    hand_made("cuda")
    real_plan("cuda")
    for kn in (False, True):
        pool_placements("cuda", kn)


@pytest.mark.filterwarnings("ignore:TRITON_DEFAULT_FP_FUSION")
@pytest.mark.parametrize("fold,tables", [(True, True), (False, True), (True, False)])
def test_scatter_kernel_compiles_for_hopper(fold, tables):
    """Both forms compile for sm_90 (ptxas, no GPU): with the table-writing program row, as a
    placement launches it, and without, as the public call without tables does."""
    from test_sgmv import compile_for_sm90
    from kernels.adapter_scatter_triton import _scatter_kernel
    import triton.language as tl
    types = ["*bf16", "*i64", "*i64", "*bf16", "i32", "*i64", "i32", "i32", "i32", "*i64",
             "*i32"]
    consts = dict(DST_DTYPE=tl.bfloat16, HAS_FOLD=fold, NF=10, ZERO_FLAG=1, BLOCK_E=2048,
                  HAS_TABLES=tables, BLOCK_W=256)
    assert compile_for_sm90(_scatter_kernel, types, consts).asm["cubin"]
