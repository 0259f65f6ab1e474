"""Norms of the residual stream, whose features are split over x and, inside each x slice, over y
(docs/design.md section 15): statistics summed over (x, y); each rank applies its y block of the
weight (the parameter stays split over x only: its gradient's y blocks are all-gathered over y)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from axo4d.dist.comm import Comm
from axo4d.dist.mappings import all_reduce_sum, slice_features
from axo4d.facts.placement import constant, place
from axo4d.facts.spec import NormSpec


class _Norm(nn.Module):
    def __init__(self, spec: NormSpec, comm: Comm, eps: float) -> None:
        super().__init__()
        self.spec, self.comm, self.dim, self.eps = spec, comm, spec.dim, eps
        pl = spec.placements()
        self.weight = place(nn.Parameter(torch.ones(pl["weight"].local_shape(comm.grid))), pl["weight"], constant(1.0))
        self.bias = None
        if "bias" in pl:
            self.bias = place(nn.Parameter(torch.zeros(pl["bias"].local_shape(comm.grid))), pl["bias"], constant(0.0))

    def pieces(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """This rank's y blocks ``(C/(x*y),)`` of the weight and bias."""
        w = slice_features(self.weight, self.comm, "y")
        return w, None if self.bias is None else slice_features(self.bias, self.comm, "y")


class LayerNorm(_Norm):
    """LayerNorm of a feature-split activation ``(B, T, C/(x*y))``: mean and mean square summed over (x, y)."""

    def __init__(self, dim: int, comm: Comm, eps: float, bias: bool, name: str = "ln") -> None:
        super().__init__(NormSpec(name, dim, bias), comm, eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, C/(x*y))
        if self.comm.size(("x", "y")) == 1:  # whole features here: the fused kernel
            return F.layer_norm(x, (self.dim,), self.weight, self.bias, self.eps)
        w, b = self.pieces()
        xf = x.float()
        stats = torch.stack([xf.sum(-1), (xf * xf).sum(-1)], -1)  # (B, T, 2)
        stats = all_reduce_sum(stats, self.comm, ("x", "y")) / self.dim
        mean, meansq = stats[..., :1], stats[..., 1:]
        y = (xf - mean) * torch.rsqrt(meansq - mean * mean + self.eps)
        y = y * w if b is None else torch.addcmul(b, y, w)
        return y.to(x.dtype)


class RMSNorm(_Norm):
    """RMSNorm of a feature-split activation ``(B, T, C/(x*y))``: the mean square summed over (x, y).
    Computed in fp32 and cast back before the weight, as Hugging Face's ``LlamaRMSNorm``."""

    def __init__(self, dim: int, comm: Comm, eps: float, name: str = "norm") -> None:
        super().__init__(NormSpec(name, dim, bias=False, rms=True), comm, eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, C/(x*y))
        xf = x.float()
        ms = (xf * xf).sum(-1, keepdim=True)  # (B, T, 1)
        if self.comm.size(("x", "y")) > 1:  # whole features here: no call a compiled graph would break at
            ms = all_reduce_sum(ms, self.comm, ("x", "y"))
        y = xf * torch.rsqrt(ms / self.dim + self.eps)
        return self.pieces()[0] * y.to(x.dtype)
