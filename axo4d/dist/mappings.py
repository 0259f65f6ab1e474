"""Communication primitives as autograd functions: each says what it does forward and backward.

Used by layers whose activations are split over an axis (norm statistics; :class:`AllGather` for
sequence pieces split over z).
:class:`~axo4d.nn.linear.Linear3D` has its own fused autograd function (it must order its
collectives around its GEMMs).
"""

from __future__ import annotations

from typing import Iterable

import torch

from axo4d.dist.comm import Comm, _key


class AllGather(torch.autograd.Function):
    """forward: all-gather (flat concat) over axes; backward: reduce-scatter of the gradient."""

    @staticmethod
    def forward(ctx, t: torch.Tensor, comm: Comm, axes: tuple[str, ...]) -> torch.Tensor:
        ctx.comm, ctx.axes = comm, axes
        return comm.all_gather(t, axes)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        return ctx.comm.reduce_scatter(g, ctx.axes), None, None


class AllReduce(torch.autograd.Function):
    """forward: all-reduce (sum) over axes; backward: all-reduce (sum) over axes.

    For a sum of partial results whose consumers are split over the group
    (e.g. LayerNorm statistics of a feature-split activation).
    """

    @staticmethod
    def forward(ctx, t: torch.Tensor, comm: Comm, axes: tuple[str, ...]) -> torch.Tensor:
        ctx.comm, ctx.axes = comm, axes
        return comm.all_reduce(t.clone(), axes)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        return ctx.comm.all_reduce(g.clone(), ctx.axes), None, None


@torch.compiler.disable
def all_reduce_sum(t: torch.Tensor, comm: Comm, axes: Iterable[str] | str) -> torch.Tensor:
    """Differentiable sum over ``axes`` (identity when the group has one rank)."""
    axes = _key(axes)
    return t if comm.size(axes) == 1 else AllReduce.apply(t, comm, axes)
