"""Adapter placement: lay a staged adapter's tensors out in the pool in one launch.

A cold load copies the adapter's safetensors bytes to the device as they are (one copy), and
this kernel moves each tensor to where the SGMV kernels read it: LoRA A [r, K] as it is, LoRA B
[N, r] transposed into Bt [r, N], each A of a group whose RMSNorm the model folded multiplied
by that norm's weight, the q/k/v A rows of a column-LoRA adapter also into its block of the
extended q/k/v weight, and zeros into the rows of that block past the rank. One launch, where
doing this with torch ops cost about 250 calls an adapter (each a GIL round trip that waited
behind the engine thread under load).

Semantics (segs int64 [S, NFIELDS], one row a segment: a matrix moved from src to one of dsts):

    for d, d_off, s_off, R, C, s_rs, d_rs, d_cs, f, flags in segs:
        x = zeros(R, C) if flags & ZERO else src.as_strided((R, C), (s_rs, 1), s_off)
        x = x.float() * fold[f, :C].float() if f >= 0 else x      # the norm fold
        dsts[d].as_strided((R, C), (d_rs, d_cs), d_off)[...] = x   # in dsts' dtype

and, with tables = (writes, n_wide, wide, narrow), the slot tables' writes after them:

    pos, val = writes                       # int64 [2, n]
    wide.view(-1)[pos[:n_wide]] = val[:n_wide]       # int64 table (flat positions)
    narrow.view(-1)[pos[n_wide:]] = val[n_wide:]     # int32 table

Shapes: src [E_src] (the staged bytes viewed as the tensors' dtype), dsts: flat tensors of one
dtype (the pool, then the extended q/k/v weights), fold [F, K] or None. Offsets and strides are
in elements. Segments must not overlap in their destinations (the pool's plan guarantees it).
`adapter_scatter_ref` is the same in torch, with the same signature.
"""
from __future__ import annotations

from typing import Sequence

import torch

# the fields of one segment row
DST, DST_OFF, SRC_OFF, ROWS, COLS, SRC_RS, DST_RS, DST_CS, FOLD, FLAGS = range(10)
NFIELDS = 10
ZERO = 1                  # flags: store zeros (src is not read)
BLOCK = 2048              # elements a program moves


def adapter_scatter_ref(src: torch.Tensor, dsts: Sequence[torch.Tensor], segs: torch.Tensor,
                        fold: torch.Tensor | None = None, *, max_elems: int = 0,
                        dst_ptrs: torch.Tensor | None = None, tables: tuple | None = None
                        ) -> None:
    """The semantics in torch, a segment at a time (max_elems, dst_ptrs: unused here)."""
    for d, d_off, s_off, rows, cols, s_rs, d_rs, d_cs, f, flags in segs.tolist():
        dst = dsts[d]
        if flags & ZERO:
            x = torch.zeros(rows, cols, dtype=torch.float32, device=dst.device)
        else:
            x = src.as_strided((rows, cols), (s_rs, 1), src.storage_offset() + s_off).float()
        if f >= 0:
            x = x * fold[f, :cols].float()
        dst.as_strided((rows, cols), (d_rs, d_cs), dst.storage_offset() + d_off).copy_(x)
    if tables is not None:
        writes, n_wide, wide, narrow = tables
        wide.view(-1).index_copy_(0, writes[0, :n_wide], writes[1, :n_wide])
        narrow.view(-1).index_copy_(0, writes[0, n_wide:], writes[1, n_wide:].to(narrow.dtype))


def adapter_scatter(src: torch.Tensor, dsts: Sequence[torch.Tensor], segs: torch.Tensor,
                    fold: torch.Tensor | None = None, *, max_elems: int,
                    dst_ptrs: torch.Tensor | None = None, tables: tuple | None = None,
                    impl: str = "auto") -> None:
    """Run the segments and the table writes (see the module docstring); on CUDA one Triton
    launch.

    max_elems: the host's bound on rows * cols over the segments (the launch's second grid
    dimension). dst_ptrs: int64 [len(dsts)] on the device, the dsts' data_ptr()s, kept by the
    caller so a placement does not copy them again (built here when None). impl: "auto"
    (Triton on CUDA, else torch), "triton" (also on CPU under TRITON_INTERPRET=1), "torch".
    """
    _check(src, dsts, segs, fold, tables)
    if impl == "torch" or (impl == "auto" and src.device.type != "cuda"):
        adapter_scatter_ref(src, dsts, segs, fold, tables=tables)
        return
    n_writes = 0 if tables is None else tables[0].shape[1]
    if (segs.shape[0] == 0 or max_elems <= 0) and n_writes == 0:
        return
    if dst_ptrs is None:
        dst_ptrs = torch.tensor([d.data_ptr() for d in dsts], dtype=torch.int64,
                                device=src.device)
    from kernels import adapter_scatter_triton as tri
    tri.launch(src, dsts[0].dtype, dst_ptrs, segs, segs.shape[0] if max_elems > 0 else 0,
               fold, max_elems, None if tables is None else
               (tables[0], n_writes, tables[1], tables[2], tables[3]))


def _check(src, dsts, segs, fold, tables=None) -> None:
    if not dsts or any(d.dtype != dsts[0].dtype or d.device != src.device for d in dsts):
        raise ValueError("dsts: one dtype, on src's device")
    if segs.dtype != torch.int64 or segs.dim() != 2 or segs.shape[1] != NFIELDS \
            or not segs.is_contiguous() or segs.device != src.device:
        raise ValueError(f"segs: contiguous int64 [S, {NFIELDS}] on src's device, got "
                         f"{segs.dtype} {tuple(segs.shape)} on {segs.device}")
    if src.dim() != 1 or not src.is_contiguous():
        raise ValueError("src: a contiguous 1-D tensor")
    if fold is not None and (fold.dim() != 2 or not fold.is_contiguous()
                             or fold.device != src.device):
        raise ValueError("fold: a contiguous [F, K] tensor on src's device")
    if tables is not None:
        writes, n_wide, wide, narrow = tables
        if writes.dtype != torch.int64 or writes.dim() != 2 or writes.shape[0] != 2 \
                or writes.stride(1) != 1 or not 0 <= n_wide <= writes.shape[1]:
            raise ValueError("tables: writes int64 [2, n] (rows contiguous), 0 <= n_wide <= n")
        if wide.dtype != torch.int64 or narrow.dtype != torch.int32 \
                or not (wide.is_contiguous() and narrow.is_contiguous()) \
                or {writes.device, wide.device, narrow.device} != {src.device}:
            raise ValueError("tables: contiguous int64 and int32 tables on src's device")
