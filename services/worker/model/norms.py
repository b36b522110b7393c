"""Where a decoder layer's RMSNorms run: the strategy the model takes at build time.

A layer is norm -> q/k/v -> rope and KV write -> attention -> o (+ residual) -> norm -> gate/up
-> SiLU -> down (+ residual). Two forms of the same math:

- `PlainNorms`: the norms are kernels; each residual add is fused with the norm after it (the
  last one with the final norm), so a block's input is the normed residual.
- `FoldedNorms` (services.worker.model.transforms folded each norm's weight into the GEMM
  after it, and the pool folds it into those groups' LoRA A): a block reads the residual h
  itself, the consumer of its GEMM's output (the rope launch, the SiLU launch) scales rows by
  h's norm factor (their `rms=(h, eps)` argument), and the o and down projections add into h
  in the GEMM's epilogue (addmm, beta = 1). A layer launches no norm kernel.

The model calls, per block: `rms(h)` for the consumer's argument, `project(h, x, w, bias)` for
the output the block's LoRA adds into, then `close(h, y, next_norm, into=w)` for the next
block's input; `enter` gives the first block's input and `logits` the final norm and lm_head.
`into` is the weight the input feeds: a W8A8 one (services.worker.model.fp8.input_rows) gets
the input as a Quantized, its e4m3 rows written by the norm's own launch.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.fused import add_rms_norm, rms_norm
from services.worker.model.fp8 import Activation, Weight, input_rows, qlinear, with_rows


class PlainNorms:
    """Norm kernels between the blocks (residual add + norm fused)."""
    folded = False

    def __init__(self, eps: float):
        self.eps = eps

    def enter(self, h: torch.Tensor, in_norm: torch.Tensor,
              into: Weight | None = None) -> Activation:
        rows = input_rows(into, h)
        return with_rows(rms_norm(h, in_norm, self.eps, rows=rows), rows)

    def rms(self, h: torch.Tensor) -> None:
        return None

    def project(self, h: torch.Tensor, x: Activation, weight: Weight,
                bias: torch.Tensor | None) -> torch.Tensor:
        return qlinear(x, weight, bias)

    def close(self, h: torch.Tensor, y: torch.Tensor, next_norm: torch.Tensor,
              y_norm: torch.Tensor | None = None, into: Weight | None = None) -> Activation:
        """h += y, in place (y_norm: h += norm(y), Gemma's output norms); returns the next
        block's input, norm(h) (with its e4m3 rows for a W8A8 `into`). One launch on CUDA."""
        rows = input_rows(into, h)
        return with_rows(add_rms_norm(h, y, next_norm, self.eps, delta_norm=y_norm, rows=rows),
                         rows)

    def logits(self, h: torch.Tensor, x: torch.Tensor, rows: torch.Tensor | None,
               norm: torch.Tensor, lm_head: torch.Tensor) -> torch.Tensor:
        """x already holds the final norm's output (close's last call)."""
        return F.linear(x if rows is None else x[rows], lm_head)


class FoldedNorms:
    """Norm weights folded into the GEMMs, factors applied by the consumers, residual adds in
    the o and down GEMMs."""
    folded = True

    def __init__(self, eps: float):
        self.eps = eps

    def enter(self, h: torch.Tensor, in_norm: torch.Tensor,
              into: Weight | None = None) -> torch.Tensor:
        """h itself (`into` is never FP8 here: transforms fold no FP8 model's norms)."""
        return h

    def rms(self, h: torch.Tensor) -> tuple[torch.Tensor, float]:
        return h, self.eps

    def project(self, h: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                bias: torch.Tensor | None) -> torch.Tensor:
        """h += x @ weight.T (+ bias): the residual add in the GEMM's epilogue; returns h."""
        h.addmm_(x, weight.t())
        if bias is not None:
            h.add_(bias)
        return h

    def close(self, h: torch.Tensor, y: torch.Tensor, next_norm: torch.Tensor,
              y_norm: torch.Tensor | None = None, into: Weight | None = None) -> torch.Tensor:
        if y_norm is not None:      # transforms.fold_norms never folds a model with them
            raise ValueError("folded norms cannot norm a block's output before its residual add")
        return h

    def logits(self, h: torch.Tensor, x: torch.Tensor, rows: torch.Tensor | None,
               norm: torch.Tensor, lm_head: torch.Tensor) -> torch.Tensor:
        return F.linear(rms_norm(h if rows is None else h[rows], norm, self.eps), lm_head)


Norms = PlainNorms | FoldedNorms


def norms_for(folded: bool, eps: float) -> Norms:
    """The strategy for weights whose norms transforms folded (or not)."""
    return FoldedNorms(eps) if folded else PlainNorms(eps)
