"""Launch configurations of the weight-only FP8 GEMM (kernels.fp8_gemm): a tile per M bucket, a
split-K count per (bucket, N, K) from one rule, and the sweep's neighbours of a configuration.

The TILES rows follow from first principles, not yet from a sweep (what the card measured of
them: bench/PERF_NOTES.md); `python -m bench.kernels.fp8_gemm --sweep` times each picked config
beside its neighbours in one device call, so the lead can replace them (OVERRIDES, or the TILES
rows). A config's `act_fp8` (off in every row) runs the W8A8 form of the kernel: each x tile
quantized to e4m3 in registers, the MMA on e4m3 operands, so W's tile goes from shared memory to
the tensor cores as it was loaded instead of being converted to bf16 first.

At decode M the GEMM is bound by W's bytes (M x N x K MACs are nothing beside N x K bytes), so the
kernel's time is W's bytes over the bandwidth it reaches. Three things set that bandwidth:

1. Bytes in flight. HBM at 3.35 TB/s (H100) or 4.8 (H200) with ~0.7-1 us of load latency needs
   ~3-5 MB in flight over the chip, 25-35 KB an SM. A CTA has STAGES K tiles of W in flight
   (Triton's software pipeline), BLOCK_N x BLOCK_K bytes each: 32 KB for every row below.
2. Every SM busy to the end: at least ~2 CTAs an SM (one streams while another ramps its pipeline
   or sits in its epilogue), hence split-K where N alone gives too few tiles.
3. Few bytes beyond W: x is re-read (from L2) once per N tile, 2 * M * K bytes, so x / W = 2M /
   BLOCK_N; split-K's fp32 partials are S * M * N * 4 bytes written and read again.

TILES, per M bucket (the smallest bucket >= M). W is the MMA's A operand (swap-AB: the weight
tile, converted to bf16 in registers, never goes back to shared memory), so M rides the MMA's N
side, where 16 is Triton's smallest tile:

| M <= | BM  | BN  | BK  | warps | stages | W + x a stage | shared   | why |
|------|-----|-----|-----|-------|--------|---------------|----------|-----|
| 16   | 16  | 64  | 128 | 4     | 4      | 8 + 4 KB      | 48 KB    | ~100 regs a thread: 4 CTAs an SM by registers and shared memory; x / W = 0.5 |
| 32   | 32  | 64  | 128 | 4     | 4      | 8 + 8 KB      | 64 KB    | 3 CTAs an SM; x / W = 1 |
| 64   | 64  | 128 | 64  | 8     | 4      | 8 + 8 KB      | 64 KB    | BN 128 keeps x / W at 1; 8 warps keep the 128 x 64 fp32 accumulator at 32 regs a thread |
| 128  | 128 | 128 | 64  | 8     | 3      | 8 + 16 KB     | 72 KB    | 64 accumulator regs a thread, 2 CTAs an SM; x / W = 2, and the MMAs start to matter (M = 128 is ~13 GFLOP on q/k/v) |
| 256  | 128 | 128 | 64  | 8     | 3      | 8 + 16 KB     | 72 KB    | two row tiles, launched side by side so the second reads W from L2; a 256-row tile would need 128 accumulator regs a thread |

SPLIT-K (`split_for`): the smallest S with m_tiles * n_tiles * S >= 0.9 * 2 * SMs, within three
caps: each split streams at least MIN_SPLIT_TILES K tiles (the pipeline's ramp of STAGES tiles
is paid once per split, so at least 2x amortized); the partials' traffic S * M * N * 8 bytes at
most half W's N * K (S <= K / (16 * BM * m_tiles)); MAX_SPLIT. The last CTA of an output tile to
finish sums the partials in split order (deterministic) and runs the epilogue (kernels.fp8_gemm).
Resolved on 132 SMs (`python -m bench.kernels.fp8_gemm --table` prints them all):

| shape (N x K)            | M <= 16 | 32 | 64 | 128 | 256 |
|--------------------------|---------|----|----|-----|-----|
| 7B qkv 12288 x 4096      | 2       | 2  | 3  | 2   | 1   |
| 7B o 4096 x 4096         | 4       | 4  | 4  | 2   | 1   |
| 7B gate_up 22016 x 4096  | 1       | 1  | 2  | 2   | 1   |
| 7B down 4096 x 11008     | 4       | 4  | 8  | 5   | 2   |

Groups (per-group or block scales): the K tile must lie inside one group, so BLOCK_K is the
largest power of two dividing both the bucket's BLOCK_K and the group; a group that is not a
multiple of 16 (Triton's smallest K tile) is not served by the kernel (kernels.fp8_gemm
.supported).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

DECODE_MAX_ROWS = 256        # above this the prefill path (kernels.fp8_linear.fp8_prefill)
# W8A8 (x already e4m3): above this many rows torch._scaled_mm, where it can take the weight
# (one scale a row), is faster than the kernel (bench/PERF_NOTES.md, the W8A8 step)
DYNAMIC_KERNEL_MAX_ROWS = 32
# up to this many rows (a multiple of 16) _scaled_mm runs with its operands swapped (W @ x.T,
# then transposed back: cuBLAS then tiles the few rows on its N side); 0: never, until the
# card says it pays (bench.kernels.fp8_gemm's scaled_mm_t column)
SCALED_MM_SWAP_MAX_ROWS = 0
SMS_DEFAULT = 132            # H100 SXM and H200: the table's SM count off a GPU
TARGET_PER_SM = 2            # split-K aims at this many CTAs an SM
MIN_SPLIT_TILES = 8          # K tiles a split streams at least
MAX_SPLIT = 8
N_COUNTERS = 4096            # arrival counters a device keeps: output tiles of a split-K call
SMEM_BYTES = 227 * 1024      # Hopper's shared memory a CTA may use


@dataclass(frozen=True)
class Fp8GemmConfig:
    """One launch: tile BLOCK_M rows of x by BLOCK_N rows of W by BLOCK_K, K in split_k parts."""
    block_m: int
    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 4
    act_fp8: bool = False       # x quantized to e4m3 per K tile in the kernel: e4m3 MMAs
    w_bits: bool = True         # W's e4m3 bits moved into place by integer ops (fp8_tiles)

    def __post_init__(self):
        for name in ("block_m", "block_n", "block_k"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"Fp8GemmConfig.{name} must be a power of two >= 16, got {v}")
        if self.split_k < 1 or self.num_warps not in (1, 2, 4, 8, 16) or self.num_stages < 1:
            raise ValueError(f"Fp8GemmConfig: bad split_k / num_warps / num_stages in {self}")

    def smem_bytes(self, x_bytes: int = 2) -> int:
        """Shared memory the pipeline holds: STAGES of a W tile (fp8) and an x tile."""
        return self.num_stages * self.block_k * (self.block_n + self.block_m * x_bytes)

    def label(self) -> str:
        return (f"m{self.block_m}n{self.block_n}k{self.block_k}s{self.split_k}"
                f"w{self.num_warps}st{self.num_stages}" + ("a8" if self.act_fp8 else "")
                + ("" if self.w_bits else "cv"))


BUCKETS = (16, 32, 64, 128, 256)
TILES = {                                       # the table of the module docstring
    16: Fp8GemmConfig(16, 64, 128, 1, 4, 4),
    32: Fp8GemmConfig(32, 64, 128, 1, 4, 4),
    64: Fp8GemmConfig(64, 128, 64, 1, 8, 4),
    128: Fp8GemmConfig(128, 128, 64, 1, 8, 3),
    256: Fp8GemmConfig(128, 128, 64, 1, 8, 3),
}
# (bucket, N, K) -> a measured config that replaces the rule's (the sweep's picks go here)
OVERRIDES: dict[tuple[int, int, int], Fp8GemmConfig] = {}


def bucket(m: int) -> int:
    """The M bucket of m rows (1 <= m <= DECODE_MAX_ROWS)."""
    for b in BUCKETS:
        if m <= b:
            return b
    raise ValueError(f"fp8 GEMM: {m} rows is above the decode buckets ({DECODE_MAX_ROWS})")


def group_block_k(block_k: int, group: int) -> int:
    """The K tile for scales over `group` columns (0: one scale a row): the largest power of two
    dividing both; below 16 the kernel cannot serve the group."""
    if not group:
        return block_k
    return math.gcd(block_k, group & -group)


def split_for(tile: Fp8GemmConfig, m: int, n: int, k: int, sms: int) -> int:
    """Split-K count for an M x N x K GEMM on this tile (the rule of the module docstring)."""
    m_tiles = -(-m // tile.block_m)
    n_tiles = -(-n // tile.block_n)
    k_tiles = -(-k // tile.block_k)
    cap = min(MAX_SPLIT, max(1, k_tiles // MIN_SPLIT_TILES),
              max(1, k // (16 * tile.block_m * m_tiles)))
    if m_tiles * n_tiles > N_COUNTERS:
        return 1
    target = 0.9 * TARGET_PER_SM * sms
    s = 1
    while m_tiles * n_tiles * s < target and s < cap:
        s += 1
    return s


def pick_config(m: int, n: int, k: int, group: int = 0, sms: int = SMS_DEFAULT) -> Fp8GemmConfig:
    """The configuration for x [m, K] @ W[n, K].T with scales over `group` columns (0: one a
    row): OVERRIDES first, else the bucket's tile and the split rule."""
    b = bucket(m)
    cfg = OVERRIDES.get((b, n, k))
    if cfg is None:
        tile = TILES[b]
        # from the bucket, not m: every m of a bucket runs one compiled kernel
        cfg = replace(tile, split_k=split_for(tile, b, n, k, sms))
    bk = group_block_k(cfg.block_k, group)
    return cfg if bk == cfg.block_k else replace(cfg, block_k=bk)


def neighbours(cfg: Fp8GemmConfig) -> list[Fp8GemmConfig]:
    """cfg and the configs one step from it (split, tile sides, warps, stages), each fitting
    Hopper's shared memory: what the sweep times."""
    out = [cfg]
    steps = [dict(split_k=s) for s in (1, cfg.split_k // 2, cfg.split_k + 1, cfg.split_k * 2)]
    for name in ("block_m", "block_n", "block_k"):
        v = getattr(cfg, name)
        steps += [{name: v // 2}, {name: v * 2}]
    steps += [dict(num_warps=8 if cfg.num_warps == 4 else 4),
              dict(num_stages=cfg.num_stages - 1), dict(num_stages=cfg.num_stages + 1),
              dict(act_fp8=not cfg.act_fp8), dict(w_bits=not cfg.w_bits)]
    for change in steps:
        try:
            c = replace(cfg, **change)
        except ValueError:
            continue
        if (c not in out and c.block_m <= 256 and c.block_n <= 256 and c.block_k <= 256
                and c.split_k <= 16 and c.smem_bytes() <= SMEM_BYTES):
            out.append(c)
    return out


def grid(cfg: Fp8GemmConfig, x_bytes: int = 2) -> list[Fp8GemmConfig]:
    """cfg and, at its BLOCK_M, every BLOCK_N 64 / 128, BLOCK_K 128 / 256, split 1 / 2 / 4 / 8,
    4 or 8 warps and 4 or 6 stages that fits Hopper's shared memory (x_bytes: an element of x's
    tile, 1 for W8A8's e4m3): the sweep's --grid, for the configs several steps from the
    picked one that the neighbours do not reach."""
    out = [cfg]
    for bn in (64, 128):
        for bk in (128, 256):
            for split in (1, 2, 4, 8):
                for warps in (4, 8):
                    for stages in (4, 6):
                        c = Fp8GemmConfig(cfg.block_m, bn, bk, split, warps, stages)
                        if c not in out and c.smem_bytes(x_bytes) <= SMEM_BYTES:
                            out.append(c)
    return out
