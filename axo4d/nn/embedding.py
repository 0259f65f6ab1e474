"""Lookup tables whose features are split over x (replicated over y, z and data; a model slices its
y block of the looked-up rows, :func:`~axo4d.dist.mappings.slice_features`), and the
vocabulary-parallel lookup of tied embeddings from the LM head's weight."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from axo4d.dist.eager import eager
from axo4d.dist.mappings import gather_features, scatter_features
from axo4d.facts.grid import Grid
from axo4d.facts.placement import normal, place
from axo4d.facts.spec import EmbeddingSpec


def embedding_table(spec: EmbeddingSpec, grid: Grid) -> nn.Parameter:
    """The ``(rows, dim/G_x)`` piece of a table, carrying its placement and init."""
    pl = spec.placements()[""]
    return place(nn.Parameter(torch.empty(pl.local_shape(grid))), pl, normal(spec.init_std))


class _VocabParallelLookup(torch.autograd.Function):
    """Token embedding read from a vocabulary-parallel LM head's weight (tied embeddings); ``v`` is
    the head's output axis (its vocabulary: y as built, x where the head is turned,
    :func:`axo4d.facts.orientation.head_turns`), ``f`` its input axis (the table's features).

    forward: the head's block gathered over z (from its schedule), rows of this rank's vocabulary
    slice looked up (others zero), reduce-scattered over v along the features -> ``(B, T, C/(x*y))``;
    backward: the output gradient all-gathered over v (features) and scattered into this rank's rows,
    handed to the schedule as the weight gradient (reduce-scatter over z); no input gradient."""

    @staticmethod
    def forward(ctx, w_piece: torch.Tensor, idx: torch.Tensor, head) -> torch.Tensor:
        v = head.out_axis
        w = head.schedule.weight(head, w_piece.dtype, backward=False)  # (V/v, C/f)
        nv = w.shape[0]
        local = idx - head.comm.coord(v) * nv  # (B, T)
        inside = (local >= 0) & (local < nv)
        out = F.embedding(local.clamp(0, nv - 1), w) * inside[..., None].to(w.dtype)  # (B, T, C/f)
        out = scatter_features(out, head.comm, v)  # (B, T, C/(x*y))
        ctx.save_for_backward(local.clamp(0, nv - 1), inside)
        ctx.head, ctx.nv = head, nv
        return out

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        local, inside = ctx.saved_tensors
        head = ctx.head
        head.schedule.backward_step(head)
        dy = gather_features(dy.contiguous(), head.comm, head.out_axis)  # (B, T, C/f)
        g = dy.reshape(-1, dy.shape[-1]) * inside.reshape(-1, 1).to(dy.dtype)
        dw = torch.zeros(ctx.nv, dy.shape[-1], dtype=head.weight.dtype, device=dy.device)
        dw.index_add_(0, local.reshape(-1), g.to(dw.dtype))  # (V/v, C/f), partial over z-batch
        return head.schedule.weight_grad(head, dw), None, None


@eager
def tied_embedding(idx: torch.Tensor, head) -> torch.Tensor:
    """``(B, T, C/(x*y))`` embeddings of ``idx`` from the LM head ``head`` (a ``Linear3D``)."""
    return _VocabParallelLookup.apply(head.weight, idx, head)
