"""The Llama-family decoder (Llama 2/3, Mistral, Qwen2) over a paged KV cache, with LoRA.

Layers never see a sequence: every per-step tensor comes in a StepContext built in one place
(services.worker.step_inputs). LoRA and attention go through kernels/, so the Triton kernels
replace the torch references on GPU without touching this file.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from kernels.attention import paged_attention
from kernels.fused import add_rms_norm, rms_norm, rope_write_kv_, silu_mul
from kernels.sgmv import HostSegments, sgmv, sgmv_expand_columns
from services.worker.lora_columns import RANK_TILE as COLUMN_RANK_TILE, LoraColumns
from services.worker.lora_tables import LoraTables
from services.worker.model_spec import ALL_GROUPS, GROUP_BIT, GROUPS, ModelSpec

# A LoRA mask bit beside the groups': the step's q/k/v adapters all have column blocks
# (services.worker.lora_columns), so the q/k/v LoRA runs as the extended GEMM + expand
COLUMNS_BIT = 1 << len(GROUPS)


@dataclass
class StepContext:
    """Per-step metadata. T = rows (tokens) this step, S = sequences, R = rows that sample."""
    positions: torch.Tensor     # int64 [T]   absolute position of each row's token
    slot_mapping: torch.Tensor  # int64 [T]   KV slot of each row (-1 = padding)
    block_tables: torch.Tensor  # int32 [S, MB]
    q_seq: torch.Tensor         # int32 [T]   row -> sequence index in block_tables
    q_pos: torch.Tensor         # int32 [T]   = positions, as the attention kernel wants it
    sample_rows: torch.Tensor | None  # int64 [R] rows whose logits are needed; None: all
    seg_start: torch.Tensor     # int32 [G+1] LoRA segments over rows (sorted by adapter)
    seg_slot: torch.Tensor      # int32 [G]   adapter slot per segment, -1 = base only
    max_context: int            # host bound on positions + 1 (for sizing attention)
    has_lora: bool              # host flag: any segment with an adapter
    lora_mask: int = ALL_GROUPS  # host: GROUP_BIT of each group some row's adapter targets
    lora_rank: int = 0          # host: the SGMV rank tile (a graph's); 0 = the pool's max rank
    # host: (first row, end row, slot) of the only segment with an adapter, from the host's copy
    # of the segment table (eager steps; None with none or several, and in captured graphs)
    host_single: tuple[int, int, int] | None = None


def rope_inv_freq(spec: ModelSpec) -> torch.Tensor:
    """Inverse frequencies, with linear or Llama-3 scaling when the config asks for it."""
    d = spec.head_dim
    # fp32, as transformers computes it, so long positions get the very same angles
    inv = 1.0 / (spec.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    sc = spec.rope_scaling or {}
    kind = sc.get("rope_type", sc.get("type"))
    if kind == "linear":
        inv = inv / float(sc["factor"])
    elif kind == "llama3":
        factor, lo, hi = float(sc["factor"]), float(sc["low_freq_factor"]), float(
            sc["high_freq_factor"])
        old = float(sc["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv
        smooth = ((old / wavelen) - lo) / (hi - lo)
        mid = (1 - smooth) * inv / factor + smooth * inv
        inv = torch.where(wavelen > old / lo, inv / factor,
                          torch.where(wavelen < old / hi, inv, mid))
    elif kind not in (None, "default"):
        raise ValueError(f"rope scaling {kind!r} is not supported")
    return inv


class LlamaModel:
    """Forward pass over fused weights (services.worker.loader.fuse_layers)."""

    def __init__(self, spec: ModelSpec, weights: dict, device: torch.device, dtype: torch.dtype,
                 norm_fold: dict[str, torch.Tensor] | None = None, n_cols: int = 0):
        """weights as services.worker.weight_transforms left them. norm_fold: group -> [L, K]
        norm weights folded into that group's GEMM (None: the norms run as kernels); n_cols:
        LoRA column blocks to keep (services.worker.lora_columns)."""
        self.norm_fold = norm_fold
        self.spec, self.w, self.device, self.dtype = spec, weights, device, dtype
        inv = rope_inv_freq(spec).to(device)
        t = torch.arange(spec.max_position, device=device, dtype=torch.float32)
        freqs = torch.outer(t, inv)                                   # [max_pos, D/2]
        self.cos, self.sin = freqs.cos().to(dtype), freqs.sin().to(dtype)
        self.scale = 1.0 / math.sqrt(spec.head_dim)
        self.slices = {g: spec.slice_starts(g) for g in ("qkv", "o", "gate_up", "down")}
        self.lora: LoraTables | None = None
        # run only the first N layers (the warm-up: every layer runs the same kernels on the
        # same shapes, so one layer meets every specialization a step needs); None: all
        self.layer_limit: int | None = None
        self.column_impl = "auto"      # sgmv_expand_columns: the kernel on CUDA, else torch
        self.columns = LoraColumns(weights, len(self.slices["qkv"]) - 1, n_cols, device) \
            if n_cols else None

    def lora_mask(self, slots) -> int:
        """GROUP_BIT mask of the groups that the adapters in these slots target (-1 = none),
        with COLUMNS_BIT when every q/k/v adapter among them has a column block."""
        t = self.lora
        if t is None:
            return 0
        s = np.fromiter(slots, dtype=np.int64)
        s = s[s >= 0]
        if not len(s):
            return 0
        mask = int(np.bitwise_or.reduce(t.slot_groups[s]))
        qkv = s[(t.slot_groups[s] & GROUP_BIT["qkv"]) != 0]
        if self.columns is not None and self.columns.covers(qkv):
            mask |= COLUMNS_BIT
        return mask

    def _lora(self, group: str, layer: int, y: torch.Tensor, x: torch.Tensor,
              ctx: StepContext) -> None:
        t = self.lora
        if ctx.has_lora and t is not None and ctx.lora_mask & GROUP_BIT[group]:
            host = None
            if ctx.host_single is not None and group in t.a_off_host:
                host = HostSegments(ctx.host_single, t.a_off_host[group][layer],
                                    t.b_off_host[group][layer], t.ranks_host, t.scales_host)
            sgmv(y, x, t.pool, t.a_off[group][layer], t.b_off[group][layer], t.ranks, t.scales,
                 self.slices[group], ctx.seg_start, ctx.seg_slot, ctx.lora_rank or t.max_rank,
                 host=host, align=t.align)

    def _qkv_columns(self, i: int, w: dict, x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        """q/k/v with the LoRA as column LoRA: one GEMM over the extended weight gives the base
        output and every resident adapter's x @ A.T; the expand reads v from those columns.
        Returns the [T, q + 2kv] view of the extended output (rows strided)."""
        t, cols = self.lora, self.columns
        ext = F.linear(x, w["qkv_ext"], w.get("qkv_ext_bias"))
        n = cols.n_base
        out = ext[:, :n]
        sgmv_expand_columns(out, ext[:, n:], cols.col_slot, t.pool, t.b_off["qkv"][i], t.ranks,
                            t.scales, self.slices["qkv"], ctx.seg_start, ctx.seg_slot,
                            COLUMN_RANK_TILE, impl=self.column_impl, align=t.align)
        return out

    def _attention(self, i: int, w: dict, x: torch.Tensor, ctx: StepContext,
                   kv: tuple[torch.Tensor, torch.Tensor], h: torch.Tensor | None = None
                   ) -> torch.Tensor | None:
        """Attention of layer i on its normed input x, returning the o projection. Folded
        norms (h given): x is the residual h, the q/k/v rows are scaled by its norm factor in
        the rope launch, and the o projection (and its LoRA) is added into h: returns None."""
        s = self.spec
        if ctx.has_lora and ctx.lora_mask & COLUMNS_BIT and self.columns is not None:
            qkv = self._qkv_columns(i, w, x, ctx)
        else:
            qkv = F.linear(x, w["qkv"], w.get("qkv_bias"))             # [T, q + 2kv]
            self._lora("qkv", i, qkv, x, ctx)
        t = qkv.shape[0]
        q = qkv[:, :s.q_size].view(t, s.num_heads, s.head_dim)          # views, strided rows
        k = qkv[:, s.q_size:s.q_size + s.kv_size].view(t, s.num_kv_heads, s.head_dim)
        v = qkv[:, s.q_size + s.kv_size:].view(t, s.num_kv_heads, s.head_dim)
        # rotate q and k in place, write k and v to their KV slots (one launch on GPU)
        rope_write_kv_(q, k, v, self.cos, self.sin, ctx.positions, kv[0], kv[1],
                       ctx.slot_mapping, rms=None if h is None else (h, s.rms_norm_eps))
        if not q.is_cuda:
            q = q.contiguous()               # the torch reference attention wants dense rows
        attn = paged_attention(q, kv[0], kv[1], ctx.block_tables, ctx.q_seq, ctx.q_pos,
                               self.scale, ctx.max_context).reshape(-1, s.q_size)
        if h is None:
            out = F.linear(attn, w["o"], w.get("o_bias"))
            self._lora("o", i, out, attn, ctx)
            return out
        self._residual_linear(h, attn, w["o"], w.get("o_bias"))
        self._lora("o", i, h, attn, ctx)
        return None

    @staticmethod
    def _residual_linear(h: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                         bias: torch.Tensor | None) -> None:
        """h += x @ weight.T (+ bias): the residual add in the GEMM's epilogue (beta = 1)."""
        h.addmm_(x, weight.t())
        if bias is not None:
            h.add_(bias)

    def _mlp(self, i: int, w: dict, x: torch.Tensor, ctx: StepContext,
             h: torch.Tensor | None = None) -> torch.Tensor | None:
        """The MLP of layer i on its normed input x, returning down's output; folded norms (h
        given, x = h): gate/up rows scaled by h's norm factor in the SiLU launch, and down (and
        its LoRA) added into h: returns None."""
        gu = F.linear(x, w["gate_up"])                                 # [T, 2I]
        self._lora("gate_up", i, gu, x, ctx)
        act = silu_mul(gu, rms=None if h is None else (h, self.spec.rms_norm_eps))  # [T, I]
        if h is None:
            out = F.linear(act, w["down"])
            self._lora("down", i, out, act, ctx)
            return out
        self._residual_linear(h, act, w["down"], None)
        self._lora("down", i, h, act, ctx)
        return None

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, ctx: StepContext,
                kv_cache: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """input_ids [T] -> logits [R, vocab] for ctx.sample_rows (every row when None), in
        the model's dtype: a bf16 model's lm_head GEMM rounds them to bf16 either way, and
        sampling (services.worker.sampling.sample) takes fp32 copies only where it computes
        with them (a greedy step's argmax does not: bf16 values order as their fp32 copies).

        The residual h is updated in place. With folded norms (norm_fold) the layers read h
        itself and add into it (no norm launch in a layer); otherwise each residual add is
        fused with the next norm (the last one with the final norm).
        """
        eps = self.spec.rms_norm_eps
        layers = self.w["layers"][:self.layer_limit]
        h = self.w["embed"][input_ids]                                   # [T, H], a new tensor
        if self.norm_fold is not None:
            for i, w in enumerate(layers):
                self._attention(i, w, h, ctx, kv_cache[i], h=h)
                self._mlp(i, w, h, ctx, h=h)
            rows = h if ctx.sample_rows is None else h[ctx.sample_rows]
            return F.linear(rms_norm(rows, self.w["norm"], eps), self.w["lm_head"])
        x = rms_norm(h, layers[0]["in_norm"], eps)
        for i, w in enumerate(layers):
            x = add_rms_norm(h, self._attention(i, w, x, ctx, kv_cache[i]), w["post_norm"], eps)
            after = layers[i + 1]["in_norm"] if i + 1 < len(layers) else self.w["norm"]
            x = add_rms_norm(h, self._mlp(i, w, x, ctx), after, eps)
        rows = x if ctx.sample_rows is None else x[ctx.sample_rows]
        return F.linear(rows, self.w["lm_head"])
