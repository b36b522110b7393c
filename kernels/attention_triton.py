"""Triton paged attention over block tables (GQA, decode and chunked-prefill rows); the KV
writes: kernels.kv_write_triton.

Semantics (the same as kernels.attention_ref), for row t with s = q_seq[t] >= 0, p = q_pos[t],
w0 = max(0, p + 1 - window) with a sliding window (window > 0), else 0:
    out[t, h] = softmax(cap(scale * q[t, h] @ K_s[w0:p+1, h // g].T)) @ V_s[w0:p+1, h // g]
K_s[i] = k_cache[block_tables[s, i // BS], i % BS]; rows with q_seq < 0 get zeros; cap(x) =
softcap * tanh(x / softcap) with a softcap > 0, else x.
Shapes: q [T, H_q, D]; k_cache, v_cache [NB, BS, H_kv, D] in q's dtype or e4m3 (read as q's
dtype, times the layer's k_scale and v_scale: kv_scale); block_tables int32 [S, MB]; q_seq, q_pos
int32 [T]; out [T, H_q, D].

Design. Grid (T, H_kv). A program owns one kv head and a run of up to ROWS consecutive rows of one
sequence with consecutive positions (a chunked-prefill run; a decode row is a run of one): the
row that starts a run ("leader") does the work, other programs return at once. Its query tile
stacks the run's rows times the g query heads that share the kv head, so each K/V block is loaded
once for all of them. Keys are gathered through the block table BLOCK_N positions at a time; the
softmax is online (running max and sum in fp32, exp2 with log2(e) folded into the scale); each
row is masked causally at its own position. When BLOCK_N equals the cache's block size (decode
steps) a tile is one KV block: one block-table load a tile and a scalar base address, not a
block-table gather and an address per key. With a window the key tiles start at the tile of
the run's first row's w0 (tiles before it are skipped, not masked), so a long context costs what
its window does.
A row leads when it is the first row, follows a different sequence or a non-consecutive
position, or has q_pos % ROWS == 0; so runs never exceed ROWS rows and need no host metadata.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.fp8_tiles import FP8, kv_fp8_args, kv_scale_args
from kernels.pdl import launch_args, wait_then_release

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_LOG2E = 1.4426950408889634


@triton.jit
def _starts_run(seq, prev_seq, pos, prev_pos, ROWS: tl.constexpr):
    return (seq != prev_seq) | (pos != prev_pos + 1) | (pos % ROWS == 0) | (seq < 0)


@triton.jit
def _attend_tile(q, kt, vt, p_n, pos, first, ctx, m_i, l_i, acc, qk_scale,
                 DOT_PREC: tl.constexpr, UPCAST: tl.constexpr, SOFTCAP: tl.constexpr,
                 KV_FP8: tl.constexpr):
    """One key tile of the online softmax: kt [D, BLOCK_N], vt [BLOCK_N, D] at positions p_n;
    row r sees positions first[r] .. pos[r]. A row that sees no key of a tile yet gets weights
    that the first tile it does see rescales to zero (alpha = exp2(-1e30 - m) = 0). KV_FP8: the
    tiles are e4m3 (scale 1.0), converted (exactly) to q's dtype first."""
    if KV_FP8:
        kt = kt.to(q.dtype)
        vt = vt.to(q.dtype)
    if UPCAST:
        kt = kt.to(tl.float32)
        vt = vt.to(tl.float32)
    s = tl.dot(q, kt, input_precision=DOT_PREC) * qk_scale           # log2 domain
    if SOFTCAP > 0:                       # cap * tanh(x / cap), x = s / log2(e); tanh via exp
        y = s * (0.6931471805599453 / SOFTCAP)
        s = (SOFTCAP * 1.4426950408889634) * (1.0 - 2.0 / (1.0 + tl.exp(2.0 * y)))
    keep = ((p_n[None, :] <= pos[:, None]) & (p_n[None, :] >= first[:, None])
            & (p_n < ctx)[None, :])
    s = tl.where(keep, s, -1.0e30)
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.math.exp2(m_i - m_new)
    p = tl.math.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt, input_precision=DOT_PREC)
    return m_new, l_i, acc


@triton.jit(do_not_specialize=("window",))    # a layer's: one kernel serves every layer
def _paged_attn_kernel(out_ptr, q_ptr, k_ptr, v_ptr, bt_ptr, q_seq_ptr, q_pos_ptr, part_ptr,
                       ml_ptr, T, ctx_cap, block_size, bt_stride, qk_scale, window, v_scale,
                       stride_qt, stride_qh, stride_ot, stride_oh,
                       stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, H_q,
                       GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, ROWS: tl.constexpr,
                       D: tl.constexpr, D_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
                       DOT_PREC: tl.constexpr, UPCAST: tl.constexpr, ALIGNED: tl.constexpr,
                       SPLITS: tl.constexpr, USE_PDL: tl.constexpr, ROW_KIND: tl.constexpr,
                       SOFTCAP: tl.constexpr, KV_FP8: tl.constexpr = False):
    t0 = tl.program_id(0)
    kvh = tl.program_id(1)
    sp = tl.program_id(2)                          # the part of the context (SPLITS > 1)
    seq0 = tl.load(q_seq_ptr + t0)                 # step inputs: read before the PDL wait
    pos0 = tl.load(q_pos_ptr + t0)
    prev_seq = tl.load(q_seq_ptr + t0 - 1, mask=t0 > 0, other=-1)
    prev_pos = tl.load(q_pos_ptr + t0 - 1, mask=t0 > 0, other=-2)
    if ROW_KIND != 0:                              # split_kinds: which launch owns the row
        next_seq = tl.load(q_seq_ptr + t0 + 1, mask=t0 + 1 < T, other=-1)
    wait_then_release(USE_PDL)                     # q and this step's K/V: after it
    leads = (t0 == 0) | _starts_run(seq0, prev_seq, pos0, prev_pos, ROWS)
    if ROW_KIND == 1:                              # the decode launch: a sequence's only row
        leads = leads & (seq0 != prev_seq) & (seq0 != next_seq)
    elif ROW_KIND == 2:                            # the prefill launch: the others
        leads = leads & ((seq0 == prev_seq) | (seq0 == next_seq))
    # Query tile rows m = (run row ri, head g in the kv group).
    M: tl.constexpr = ROWS * GROUP_PAD
    m = tl.arange(0, M)
    ri = m // GROUP_PAD
    g = m % GROUP_PAD
    d = tl.arange(0, D_PAD)
    if D == D_PAD:
        d_ok = tl.full((D_PAD,), 1, tl.int1)       # no head-dim mask to compute
    else:
        d_ok = d < D
    t = t0 + ri
    t_ok = t < T
    if seq0 < 0:                                   # padding row: zeros (the combine's)
        if SPLITS == 1:
            o_ptrs = (out_ptr + t0.to(tl.int64) * stride_ot
                      + (kvh * GROUP + g)[:, None] * stride_oh)
            zero = tl.zeros((M, D_PAD), dtype=out_ptr.dtype.element_ty)
            tl.store(o_ptrs + d[None, :], zero,
                     mask=((ri == 0) & (g < GROUP))[:, None] & d_ok[None, :])
    elif leads:
        seq = tl.load(q_seq_ptr + t, mask=t_ok, other=-1)
        pos = tl.load(q_pos_ptr + t, mask=t_ok, other=0)
        pseq = tl.load(q_seq_ptr + t - 1, mask=t_ok & (t > 0), other=-1)
        ppos = tl.load(q_pos_ptr + t - 1, mask=t_ok & (t > 0), other=-2)
        new_run = (_starts_run(seq, pseq, pos, ppos, ROWS) | (t >= T)) & (ri > 0)
        in_run = tl.cumsum(new_run.to(tl.int32), axis=0) == 0
        row_ok = in_run & (g < GROUP)
        h = kvh * GROUP + g
        q_ptrs = q_ptr + t.to(tl.int64)[:, None] * stride_qt + h[:, None] * stride_qh + d[None, :]
        q = tl.load(q_ptrs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
        ctx = tl.minimum(tl.max(tl.where(row_ok, pos, 0), axis=0) + 1, ctx_cap)
        # the window's first key of each row, and the tile of the run's first row's
        first = tl.where(window > 0, pos - window + 1, 0)
        lo = tl.maximum(pos0 - window + 1, 0) // BLOCK_N * BLOCK_N
        lo = tl.where(window > 0, lo, 0)
        m_i = tl.full((M,), -1.0e30, dtype=tl.float32)
        l_i = tl.zeros((M,), dtype=tl.float32)
        acc = tl.zeros((M, D_PAD), dtype=tl.float32)
        if UPCAST:
            q = q.to(tl.float32)
        n = tl.arange(0, BLOCK_N)
        k_off = (n * stride_ks)[None, :] + d[:, None]      # ALIGNED: offsets within a block
        v_off = (n * stride_vs)[:, None] + d[None, :]
        # this program's part of the key tiles from lo (all of them unless SPLITS > 1)
        per = ((ctx - lo + BLOCK_N - 1) // BLOCK_N + SPLITS - 1) // SPLITS * BLOCK_N
        for start in range(lo + sp * per, tl.minimum(lo + sp * per + per, ctx), BLOCK_N):
            p_n = start + n
            n_ok = p_n < ctx
            if ALIGNED:
                blk = tl.load(bt_ptr + seq0 * bt_stride + start // BLOCK_N).to(tl.int64)
                kt = tl.load(k_ptr + (blk * stride_kb + kvh * stride_kh) + k_off,
                             mask=n_ok[None, :] & d_ok[:, None], other=0.0)
                vt = tl.load(v_ptr + (blk * stride_vb + kvh * stride_vh) + v_off,
                             mask=n_ok[:, None] & d_ok[None, :], other=0.0)
            else:
                blk = tl.load(bt_ptr + seq0 * bt_stride + p_n // block_size, mask=n_ok,
                              other=0)
                off = p_n % block_size
                k_rows = blk.to(tl.int64) * stride_kb + off * stride_ks + kvh * stride_kh
                v_rows = blk.to(tl.int64) * stride_vb + off * stride_vs + kvh * stride_vh
                kt = tl.load(k_ptr + k_rows[None, :] + d[:, None],
                             mask=n_ok[None, :] & d_ok[:, None], other=0.0)  # [D_PAD, BLOCK_N]
                vt = tl.load(v_ptr + v_rows[:, None] + d[None, :],
                             mask=n_ok[:, None] & d_ok[None, :], other=0.0)  # [BLOCK_N, D_PAD]
            m_i, l_i, acc = _attend_tile(q, kt, vt, p_n, pos, first, ctx, m_i, l_i, acc,
                                         qk_scale, DOT_PREC, UPCAST, SOFTCAP, KV_FP8)
        if KV_FP8:                                 # the cache holds V / v_scale
            acc = acc * v_scale
        if SPLITS == 1:
            out = acc / l_i[:, None]
            o_ptrs = (out_ptr + t.to(tl.int64)[:, None] * stride_ot + h[:, None] * stride_oh
                      + d[None, :])
            tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty),
                     mask=row_ok[:, None] & d_ok[None, :])
        else:                                      # this part's running max, sum and acc
            part = (t.to(tl.int64) * H_q + h) * SPLITS + sp
            tl.store(part_ptr + part[:, None] * D_PAD + d[None, :], acc,
                     mask=row_ok[:, None] & d_ok[None, :])
            tl.store(ml_ptr + part * 2, m_i, mask=row_ok)
            tl.store(ml_ptr + part * 2 + 1, l_i, mask=row_ok)


@triton.jit
def _split_combine_kernel(out_ptr, part_ptr, ml_ptr, q_seq_ptr, T, H_q, stride_ot, stride_oh,
                          SPLITS: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
                          USE_PDL: tl.constexpr, ROW_KIND: tl.constexpr):
    """out[t, h] from the SPLITS parts of its context: each part's acc weighted by
    exp2(m_part - max m), over the weighted sum of the parts' l (zeros for padding rows).
    ROW_KIND 1: only rows that are their sequence's only one (another launch owns the rest,
    whose parts were not written)."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    seq = tl.load(q_seq_ptr + t)                   # a step input: before the PDL wait
    if ROW_KIND == 1:
        prev = tl.load(q_seq_ptr + t - 1, mask=t > 0, other=-1)
        nxt = tl.load(q_seq_ptr + t + 1, mask=t + 1 < T, other=-1)
    wait_then_release(USE_PDL)
    sp = tl.arange(0, SPLITS)
    d = tl.arange(0, D_PAD)
    part = (t * H_q + h) * SPLITS + sp
    n_live = tl.where(seq >= 0, SPLITS, 0)         # a padding row's parts were never written
    n_out = D
    if ROW_KIND == 1:                              # not a row another launch owns
        mine = (seq < 0) | ((seq != prev) & (seq != nxt))
        n_live = tl.where(mine, n_live, 0)
        n_out = tl.where(mine, D, 0)
    live = sp < n_live
    ok = d < n_out
    m = tl.load(ml_ptr + part * 2, mask=live, other=-1.0e30)
    w = tl.math.exp2(m - tl.max(m, axis=0))
    l_sum = tl.sum(w * tl.load(ml_ptr + part * 2 + 1, mask=live, other=0.0), axis=0)
    acc = tl.load(part_ptr + part[:, None] * D_PAD + d[None, :], mask=live[:, None], other=0.0)
    out = tl.sum(w[:, None] * acc, axis=0) / tl.where(l_sum > 0, l_sum, 1.0)  # padding: 0
    tl.store(out_ptr + t * stride_ot + h * stride_oh + d, out.to(out_ptr.dtype.element_ty),
             mask=ok)


def _check(q, k_cache, v_cache, block_tables, q_seq, q_pos):
    if q.dim() != 3 or k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(f"q [T, H, D] and caches [NB, BS, H_kv, D] expected, got "
                         f"{tuple(q.shape)}, {tuple(k_cache.shape)}, {tuple(v_cache.shape)}")
    if q.shape[2] != k_cache.shape[3] or q.shape[1] % k_cache.shape[2]:
        raise ValueError("head dims differ or H_q is not a multiple of H_kv")
    if (q.dtype not in _DTYPES or k_cache.dtype not in (q.dtype, FP8)
            or v_cache.dtype != k_cache.dtype):
        raise TypeError(f"caches must be of q's float dtype or e4m3: {q.dtype}, "
                        f"{k_cache.dtype}, {v_cache.dtype}")
    if q.stride(2) != 1 or k_cache.stride(3) != 1 or v_cache.stride(3) != 1:
        raise ValueError("the head dimension must be contiguous")
    for name, x in (("block_tables", block_tables), ("q_seq", q_seq), ("q_pos", q_pos)):
        if x.dtype != torch.int32 or x.stride(-1) != 1 or x.device != q.device:
            raise TypeError(f"{name} must be int32 on {q.device} with unit last stride")
    if q_seq.shape != (q.shape[0],) or q_pos.shape != (q.shape[0],) or block_tables.dim() != 2:
        raise ValueError("q_seq, q_pos [T] and block_tables [S, MB] expected")


# Launch shape of decode steps (one row per sequence): key tile, warps, pipeline stages. One
# warp a program (the softmax's reductions over the key tile need no barrier), and a key tile
# of one KV block (block_n = the engine's block size: ALIGNED). bench/attn_tune.py measures the
# alternatives; why these: bench/PERF_NOTES.md, "Why the defaults".
DECODE_CONFIG = {"block_n": 16, "num_warps": 1, "num_stages": 2}
# That launch needs many programs (a step's rows x KV heads) to fill the card: from
# MANY_PROGRAMS on it is used; with fewer, each program's loop over the context is the critical
# path and wider tiles on four warps win (64-key tiles for groups of 8+ query heads a KV head,
# whose query tile is fuller). The scan: bench/PERF_NOTES.md, "Why the defaults".
FEW_PROGRAMS_CONFIG = {"block_n": 32, "num_warps": 4, "num_stages": 2}
FEWEST_PROGRAMS_CONFIG = {"block_n": 64, "num_warps": 4, "num_stages": 2}
MANY_PROGRAMS = 1024
# Below 512 programs the context is cut into parts, a program each, and a second launch
# combines their softmaxes (flash-decoding): 129-511 programs, one-block tiles in 4 parts;
# 65-128, 64-key tiles in 4 parts; 64 or fewer, 64-key tiles in 8 parts. The scan behind it:
# bench/PERF_NOTES.md, "Why the defaults".
SPLIT_ONE_BLOCK_CONFIG = {**DECODE_CONFIG, "splits": 4}
SPLIT4_CONFIG = {**FEWEST_PROGRAMS_CONFIG, "splits": 4}
SPLIT8_CONFIG = {**FEWEST_PROGRAMS_CONFIG, "splits": 8}
# A launch for every decode step, whatever the shape (bench/e2e_gpu_bench.py --attn-config):
# empty = the choice above.
DECODE_OVERRIDE: dict = {}


def decode_config(t_rows: int, h_kv: int, group: int, head_dim: int = 128) -> dict:
    """The launch of a decode step of t_rows rows (one a sequence) over h_kv KV heads of
    head_dim with `group` query heads each (see DECODE_CONFIG's notes). Programs are counted in
    128-wide heads: a head of 256 (Gemma 3) keeps twice the bytes of a key tile in flight, so
    half as many programs fill the card (bench/PERF_NOTES.md, Gemma 3's decode step)."""
    if DECODE_OVERRIDE:
        return DECODE_OVERRIDE
    programs = t_rows * h_kv * max(1, head_dim // 128)
    if programs >= MANY_PROGRAMS:
        return DECODE_CONFIG
    if programs >= MANY_PROGRAMS // 2:
        return FEWEST_PROGRAMS_CONFIG if group >= 8 else FEW_PROGRAMS_CONFIG
    if programs > MANY_PROGRAMS // 8:
        return SPLIT_ONE_BLOCK_CONFIG
    if programs > MANY_PROGRAMS // 16:
        return SPLIT4_CONFIG
    return SPLIT8_CONFIG


def paged_attention_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, q_seq: torch.Tensor, q_pos: torch.Tensor,
                           scale: float, max_context: int, rows_per_program: int | None = None,
                           block_n: int | None = None, num_warps: int | None = None,
                           num_stages: int | None = None,
                           splits: int | None = None, split_kinds: bool = False,
                           out: torch.Tensor | None = None, window: int = 0,
                           softcap: float = 0.0,
                           kv_scale: tuple[float, float] = (1.0, 1.0)) -> torch.Tensor:
    """Causal paged attention of each row over its sequence's cache; see kernels.attention_ref
    (window > 0: each row's last `window` positions; softcap > 0: scores capped).

    rows_per_program bounds a prefill run (default: 1 when T <= S, as in decode, else enough
    rows for a 64-row query tile). splits > 1 (a power of two; default: the launch's, 1) cuts
    each row's context into that many parts, each its own program, and a second launch
    combines them (flash-decoding). split_kinds, for a step with prefill runs (T > S): the rows
    that are their sequence's only one (decode rows) take the decode launch (decode_config for
    S rows), the others the prefill launch that the arguments above shape. Returns out
    ([T, H_q, D], unit last stride), a new tensor when None. kv_scale: an e4m3 cache's
    (k_scale, v_scale), k_scale folded into the scores' scale, v_scale into the output. No
    host syncs.
    """
    _check(q, k_cache, v_cache, block_tables, q_seq, q_pos)
    t_rows, s_rows, h_kv = q.shape[0], block_tables.shape[0], k_cache.shape[2]
    group = q.shape[1] // h_kv
    decode = t_rows <= s_rows
    out = torch.empty_like(q) if out is None else out
    if t_rows == 0:
        return out
    kinds = split_kinds and not decode
    k_scale, v_scale = kv_scale_args(kv_scale, k_cache)
    extra = {"window": int(window), "softcap": float(softcap), "v_scale": v_scale}
    scale = scale * k_scale                         # an e4m3 cache holds K / k_scale
    if kinds:
        _launch(out, q, k_cache, v_cache, block_tables, q_seq, q_pos, scale, max_context,
                decode_config(s_rows, h_kv, group, q.shape[2]), 1, kind=1, **extra)
    cfg = (decode_config(t_rows, h_kv, group, q.shape[2]) if decode
           else {"block_n": 64, "num_warps": 4, "num_stages": 2})
    cfg = {"block_n": block_n or cfg["block_n"], "num_warps": num_warps or cfg["num_warps"],
           "num_stages": num_stages or cfg["num_stages"], "splits": splits or cfg.get("splits", 1)}
    if rows_per_program is None:
        rows_per_program = 1 if decode else max(1, 64 // triton.next_power_of_2(group))
    _launch(out, q, k_cache, v_cache, block_tables, q_seq, q_pos, scale, max_context, cfg,
            rows_per_program, kind=2 if kinds else 0, **extra)
    return out


def _launch(out, q, k_cache, v_cache, block_tables, q_seq, q_pos, scale, max_context,
            cfg: dict, rows_per_program: int, kind: int, window: int = 0,
            softcap: float = 0.0, v_scale: float = 1.0) -> None:
    """One attention launch into out (and its combine when the context is cut into parts),
    over the rows of `kind`: 0 all, 1 those that are their sequence's only row, 2 the rest."""
    t_rows, h_q, d = q.shape
    bs, h_kv = k_cache.shape[1], k_cache.shape[2]
    group = h_q // h_kv
    group_pad = triton.next_power_of_2(group)
    block_n, splits = cfg["block_n"], cfg.get("splits", 1)
    if splits < 1 or splits & (splits - 1):
        raise ValueError(f"splits must be a power of two, got {splits}")
    rows = max(triton.next_power_of_2(rows_per_program), triton.cdiv(16, group_pad))
    ctx_cap = min(block_tables.shape[1], triton.cdiv(max_context, bs)) * bs
    d_pad = max(16, triton.next_power_of_2(d))
    part = ml = out                                 # (unused unless splits > 1)
    if splits > 1:
        part = torch.empty(t_rows * h_q * splits * d_pad, dtype=torch.float32, device=q.device)
        ml = torch.empty(t_rows * h_q * splits * 2, dtype=torch.float32, device=q.device)
    _paged_attn_kernel[(t_rows, h_kv, splits)](
        out, q, k_cache, v_cache, block_tables, q_seq, q_pos, part, ml,
        t_rows, ctx_cap, bs, block_tables.stride(0), scale * _LOG2E, window, v_scale,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), h_q,
        GROUP=group, GROUP_PAD=group_pad, ROWS=rows, D=d, D_PAD=d_pad, BLOCK_N=block_n,
        DOT_PREC="ieee" if q.dtype == torch.float32 else "tf32",
        UPCAST=(q.dtype == torch.bfloat16 and not q.is_cuda),
        ALIGNED=(block_n == bs), SPLITS=splits, ROW_KIND=kind, SOFTCAP=softcap,
        **kv_fp8_args(k_cache),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **launch_args(q.device))
    if splits > 1:
        _split_combine_kernel[(t_rows, h_q)](
            out, part, ml, q_seq, t_rows, h_q, out.stride(0), out.stride(1), SPLITS=splits,
            D=d, D_PAD=d_pad, ROW_KIND=kind, num_warps=1 if d_pad * splits <= 1024 else 4,
            **launch_args(q.device))
