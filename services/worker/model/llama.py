"""The decoder of every family served (Llama 2/3, Mistral, Qwen2/3, Phi-3, Gemma 3; what sets
them apart: services.common.families) over a paged KV cache, with LoRA.

Layers never see a sequence: every per-step tensor comes in a StepContext
(services.worker.model.step_context) built in one place (services.worker.executor.step_inputs), its
LoRA part a LoraMeta that also carries the adapter pool's tables. LoRA and attention go through
kernels/, so the Triton kernels replace the torch references on GPU without touching this file.
Where the norms run (kernels, or folded into the GEMMs) is a strategy chosen at build time
(services.worker.model.norms). The decoder layers' GEMMs go through `qlinear`, so a weight may
be FP8 (services.worker.model.fp8: W8A16, the activations and LoRA stay in the model dtype; or
W8A8, where the norms and the MLP's gate write their outputs' e4m3 rows too, `into` the weight
that reads them, and the input travels as an fp8.Quantized; the LoRA reads its plain x).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.attention import paged_attention
from kernels.fused import gate_mul, rope_write_kv_
from kernels.sgmv import lora, lora_expand_columns, lora_shrink_rows
from services.worker.model.fp8 import Activation, Weight, input_rows, plain, qlinear, with_rows
from services.worker.model.lora_columns import LoraColumns
from services.worker.model.norms import Norms, PlainNorms
from services.worker.model.rope import dynamic_ropes, rope_tables
from services.worker.model.spec import GROUPS, ModelSpec
from services.worker.model.step_context import LoraMeta, StepContext


ROW_MAX_ROWS = 128


class LlamaModel:
    """Forward pass over fused weights (services.worker.model.checkpoint.fuse_layers)."""

    def __init__(self, spec: ModelSpec, weights: dict, device: torch.device, dtype: torch.dtype,
                 norms: Norms | None = None, columns: LoraColumns | None = None):
        """weights as services.worker.model.transforms left them; norms: the strategy that
        matches them (services.worker.model.norms; default: plain norm kernels); columns: the LoRA
        column blocks of the q/k/v weights (services.worker.model.lora_columns), None without."""
        self.norms = norms or PlainNorms(spec.rms_norm_eps)
        self.spec, self.w, self.device, self.dtype = spec, weights, device, dtype
        self.rope = rope_tables(spec, device, dtype)          # per layer: cos, sin [P, D/2]
        self.dynamic = dynamic_ropes(spec, device)            # per layer: None, or per step
        self.scale = spec.scale
        self.windows = [spec.window(i) for i in range(spec.num_layers)]
        # each layer's (k_scale, v_scale) of an e4m3 KV cache (services.worker.model.kv_scales;
        # set by the engine's assembly; a cache of the model dtype ignores them)
        self.kv_scales = [(1.0, 1.0)] * spec.num_layers
        # Gemma: the embedding's rows times sqrt(hidden), rounded to the dtype as HF does
        self.embed_scale = (torch.tensor(spec.embed_scale).to(dtype)
                            if spec.embed_scale != 1.0 else None)
        self.slices = {g: spec.slice_starts(g) for g in ("qkv", "o", "gate_up", "down")}
        # run only the first N layers (the warm-up: every layer runs the same kernels on the
        # same shapes, so one layer meets every specialization a step needs); None: all
        self.layer_limit: int | None = None
        self.column_impl = "auto"      # lora_expand_columns: the kernel on CUDA, else torch
        self.row_impl = "auto"         # lora_shrink_rows: the kernel on CUDA, else torch
        # a step with prompt chunks: its decode rows in the decode attention launch
        # (PerfConfig.split_attention; the same outputs)
        self.split_attention = False
        self.columns = columns
        # row LoRA for o (columns.rows): its shrink's rank parts (PerfConfig.lora_rows), and the
        # largest step that takes it (a program a row and rank part re-reads its adapter's A
        # for every row; the split SGMV's row tiles read it once a tile: bench/PERF_NOTES.md)
        self.row_parts = 4
        self.row_max_rows = ROW_MAX_ROWS

    def _lora(self, group: str, layer: int, y: torch.Tensor, x: Activation,
              meta: LoraMeta) -> None:
        """y += the step's LoRA of this group and layer on x (its plain rows; nothing when no
        adapter in the step targets the group)."""
        if meta.runs(group):
            lora(y, plain(x), meta.args(group, layer, self.slices[group]))

    def _qkv(self, i: int, w: dict, x: Activation, meta: LoraMeta) -> torch.Tensor:
        """q/k/v of layer i with its LoRA: [T, q + 2kv]. As column LoRA (meta.columns) one GEMM
        over the extended weight gives the base output and every resident adapter's x @ A.T;
        the expand reads v from those columns (the result: a view, rows strided)."""
        if not (meta.columns and self.columns is not None and meta.runs("qkv")):
            qkv = qlinear(x, w["qkv"], w.get("qkv_bias"))
            self._lora("qkv", i, qkv, x, meta)
            return qkv
        ext = F.linear(plain(x), w["qkv_ext"], w.get("qkv_ext_bias"))
        out, v_cols = ext[:, :self.columns.n_base], ext[:, self.columns.n_base:]
        lora_expand_columns(out, v_cols, self.columns.col_slot,
                            meta.column_args(i, self.slices["qkv"]), impl=self.column_impl)
        return out

    def _attn_o(self, i: int, w: dict, h: torch.Tensor, q: torch.Tensor,
                kv: tuple[torch.Tensor, torch.Tensor], ctx: StepContext) -> torch.Tensor:
        """Attention, then o with its LoRA (the norm strategy's projection output). As row LoRA
        (services.worker.model.lora_columns) attention writes into the first q_size columns of a
        [T, q_size + row_width] buffer, the shrink each row's x @ A_o.T into its adapter's
        block of the rest, and one GEMM over the buffer and o_ext adds the expand."""
        s, meta, t = self.spec, ctx.lora, q.shape[0]
        cols = self.columns
        rows = (meta.columns and cols is not None and cols.rows and meta.runs("o")
                and t <= self.row_max_rows)
        buf = q.new_empty(t, s.q_size + cols.row_width) if rows else None
        attn = paged_attention(q, kv[0], kv[1], ctx.block_tables, ctx.q_seq, ctx.q_pos,
                               self.scale, ctx.max_context, split_kinds=self.split_attention,
                               out=None if buf is None else
                               buf[:, :s.q_size].view(t, s.num_heads, s.head_dim),
                               window=self.windows[i], softcap=s.attn_softcap,
                               kv_scale=self.kv_scales[i])
        attn = attn.reshape(-1, s.q_size)
        if buf is None:
            y = self.norms.project(h, attn, w["o"], w.get("o_bias"))
            self._lora("o", i, y, attn, meta)
            return y
        self._row_shrink(i, buf, attn, meta)
        return self.norms.project(h, buf, w["o_ext"], w.get("o_bias"))

    def _row_shrink(self, i: int, buf: torch.Tensor, attn: torch.Tensor,
                    meta: LoraMeta) -> None:
        """Row LoRA's shrink of layer i: each row's attn @ A_o.T into its adapter's block of
        buf's columns past q_size (attn: the first q_size columns, attention's output)."""
        lora_shrink_rows(buf[:, self.spec.q_size:], attn, self.columns.col_slot,
                         meta.row_args(i), self.row_parts, impl=self.row_impl)

    def lora_witness(self, path: str, group: str, meta: LoraMeta, rows: int) -> None:
        """One LoRA call of layer 0 on `rows` rows of zeros, laid out as a step lays them out
        (the warm-up's kernel witnesses: services.worker.startup.kernel_warmup): the group's
        SGMV (path "sgmv"), q/k/v as column LoRA ("columns", with its GEMM over the extended
        weight) or o's row LoRA shrink ("rows")."""
        s, w = self.spec, self.w["layers"][0]
        def zeros(n: int) -> torch.Tensor:
            return torch.zeros(rows, n, dtype=self.dtype, device=self.device)
        if path == "columns":
            self._qkv(0, w, zeros(s.hidden_size), meta)
        elif path == "rows":
            buf = zeros(s.q_size + self.columns.row_width)
            self._row_shrink(0, buf, buf[:, :s.q_size], meta)
        else:
            k = s.in_out(GROUPS[group][0])[0]
            self._lora(group, 0, zeros(self.slices[group][-1]), zeros(k), meta)

    def _angles(self, ctx: StepContext) -> list[tuple]:
        """Each layer's (cos, sin, index): its tables and the rows' positions, or, for dynamic
        NTK RoPE, this step's angles a row (computed once a step) and the row index."""
        step = {}
        out = []
        for table, dyn in zip(self.rope, self.dynamic):
            if dyn is None:
                out.append((*table, ctx.positions))
                continue
            if id(dyn) not in step:
                rows = torch.arange(ctx.positions.shape[0], device=ctx.positions.device)
                step[id(dyn)] = (*dyn.angles(ctx.positions, ctx.rope_len, self.dtype), rows)
            out.append(step[id(dyn)])
        return out

    def _layer(self, i: int, w: dict, h: torch.Tensor, x: Activation, ctx: StepContext,
               kv: tuple[torch.Tensor, torch.Tensor], next_norm: torch.Tensor,
               rope: tuple, into: Weight | None) -> Activation:
        """Decoder layer i on the residual h (updated in place) and its normed input x (the
        norm strategy's); returns the next layer's input, for the weight `into` (the next
        layer's q/k/v; None: the final norm's output, for lm_head). Gemma's norms of the
        attention's and the MLP's outputs (attn_out_norm, mlp_out_norm) go before their
        residual adds, in the add's own launch (norms.close)."""
        s, norms, meta = self.spec, self.norms, ctx.lora
        qkv = self._qkv(i, w, x, meta)
        t = qkv.shape[0]
        q = qkv[:, :s.q_size].view(t, s.num_heads, s.head_dim)          # views, strided rows
        k = qkv[:, s.q_size:s.q_size + s.kv_size].view(t, s.num_kv_heads, s.head_dim)
        v = qkv[:, s.q_size + s.kv_size:].view(t, s.num_kv_heads, s.head_dim)
        # (q/k norms,) rotate q and k in place, write k and v to their KV slots (one launch
        # on GPU)
        qk_norm = (w["q_norm"], w["k_norm"], s.rms_norm_eps) if s.qk_norm else None
        rope_write_kv_(q, k, v, *rope, kv[0], kv[1], ctx.slot_mapping, rms=norms.rms(h),
                       qk_norm=qk_norm, kv_scale=self.kv_scales[i])
        if not q.is_cuda:
            q = q.contiguous()               # the torch reference attention wants dense rows
        y = self._attn_o(i, w, h, q, kv, ctx)
        x = norms.close(h, y, w["post_norm"], w.get("attn_out_norm"), into=w["gate_up"])
        gu = qlinear(x, w["gate_up"])                                  # [T, 2I]
        self._lora("gate_up", i, gu, x, meta)
        rows = input_rows(w["down"], gu)             # W8A8: the gate's launch quantizes too
        act = with_rows(gate_mul(gu, s.act, rms=norms.rms(h), rows=rows), rows)    # [T, I]
        y = norms.project(h, act, w["down"], None)
        self._lora("down", i, y, act, meta)
        return norms.close(h, y, next_norm, w.get("mlp_out_norm"), into=into)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, ctx: StepContext,
                kv_cache: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """input_ids [T] -> logits [R, vocab] for ctx.sample_rows (every row when None), in
        the model's dtype: a bf16 model's lm_head GEMM rounds them to bf16 either way, and
        sampling (services.worker.executor.sampling.sample) takes fp32 copies only where it computes
        with them (a greedy step's argmax does not: bf16 values order as their fp32 copies).
        The residual h is updated in place, as the norm strategy says (services.worker.model.norms).
        """
        layers = self.w["layers"][:self.layer_limit]
        h = self.w["embed"][input_ids]                                   # [T, H], a new tensor
        if self.embed_scale is not None:
            h = h * self.embed_scale
        x = self.norms.enter(h, layers[0]["in_norm"], into=layers[0]["qkv"])
        angles = self._angles(ctx)
        for i, w in enumerate(layers):
            last = i + 1 == len(layers)
            after = self.w["norm"] if last else layers[i + 1]["in_norm"]
            into = None if last else layers[i + 1]["qkv"]          # lm_head reads a plain x
            x = self._layer(i, w, h, x, ctx, kv_cache[i], after, angles[i], into)
        logits = self.norms.logits(h, x, ctx.sample_rows, self.w["norm"], self.w["lm_head"])
        cap = self.spec.final_softcap
        return logits if not cap else torch.tanh(logits / cap) * cap
