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
from axo4d.dist.eager import eager


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


@eager
def _apply(fn: type[torch.autograd.Function], t: torch.Tensor, comm: Comm, axes: tuple[str, ...]) -> torch.Tensor:
    """``fn.apply`` outside any compiled graph (the collectives run eagerly)."""
    return fn.apply(t, comm, axes)


def all_reduce_sum(t: torch.Tensor, comm: Comm, axes: Iterable[str] | str) -> torch.Tensor:
    """Differentiable sum over ``axes`` (identity when the group has one rank: decided before the
    compiler-disabled call, so a compiled graph on a group of one has no break)."""
    axes = _key(axes)
    return t if comm.size(axes) == 1 else _apply(AllReduce, t, comm, axes)


# ---- feature pieces: the activation between two GEMMs split over a tensor axis (section 15) ----------
def gather_features(
    t: torch.Tensor,
    comm: Comm,
    axes: Iterable[str] | str,
    async_op: bool = False,
    out: torch.Tensor | None = None,
):
    """``(..., n)`` pieces of every rank of the group -> ``(..., G*n)`` in group order (no autograd);
    ``out``: a ``(..., G*n)`` tensor to write it into (a row block of a layer's gathered input);
    ``async_op``: a handle whose ``wait()`` gives it."""
    axes = _key(axes)
    g = comm.size(axes)
    if g == 1:
        res = t if out is None else out.copy_(t)
        return Done(res) if async_op else res
    h = comm.all_gather(t, axes, async_op=async_op)  # (G * ... * n,)
    pending = _Gathered(h if async_op else Done(h), g, tuple(t.shape), out)
    return pending if async_op else pending.wait()


class _Gathered:
    """A pending :func:`gather_features`: ``wait()`` gives ``(..., G*n)`` (in ``out`` when given)."""

    def __init__(self, h, g: int, shape: tuple[int, ...], out: torch.Tensor | None) -> None:
        self.h, self.g, self.shape, self.out = h, g, shape, out

    def wait(self) -> torch.Tensor:
        blocks = self.h.wait().view(self.g, *self.shape).movedim(0, -2)  # (..., G, n)
        if self.out is None:
            return blocks.reshape(*self.shape[:-1], self.g * self.shape[-1])
        self.out.view(*self.shape[:-1], self.g, self.shape[-1]).copy_(blocks)
        return self.out


def _grouped(t: torch.Tensor, g: int) -> torch.Tensor:
    """``(..., G*n)`` -> contiguous ``(G, ..., n)``: rank i's features first-dim block i."""
    return t.unflatten(-1, (g, -1)).movedim(-2, 0).contiguous()


class _Piece:
    """A pending :func:`scatter_features`: ``wait()`` gives ``(..., n)``."""

    def __init__(self, h, shape: tuple[int, ...]) -> None:
        self.h, self.shape = h, shape

    def wait(self) -> torch.Tensor:
        return self.h.wait().view(self.shape)


def scatter_features(t: torch.Tensor, comm: Comm, axes: Iterable[str] | str, async_op: bool = False):
    """Sum ``(..., G*n)`` over the group and keep this rank's ``(..., n)`` feature block (no autograd);
    ``async_op``: a handle whose ``wait()`` gives it."""
    axes = _key(axes)
    g = comm.size(axes)
    if g == 1:
        return _Piece(Done(t), t.shape) if async_op else t
    shape = (*t.shape[:-1], t.shape[-1] // g)
    h = comm.reduce_scatter(_grouped(t, g), axes, async_op=async_op)
    return _Piece(h, shape) if async_op else h.view(shape)


class Done:
    """A finished collective's result behind the handle interface (``wait()`` returns it)."""

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t

    def wait(self) -> torch.Tensor:
        return self.t


def feature_slice(t: torch.Tensor, comm: Comm, axes: Iterable[str] | str) -> torch.Tensor:
    """This rank's block of the last dimension over ``axes`` (group order), a view; no communication."""
    g = comm.size(axes)
    if g == 1:
        return t
    n = t.shape[-1] // g
    i = comm.index(axes)
    return t[..., i * n : (i + 1) * n]


class SliceFeatures(torch.autograd.Function):
    """forward: this rank's feature block over axes (no communication); backward: all-gather of the
    gradient's feature blocks over axes (each rank's block of a replicated tensor's gradient)."""

    @staticmethod
    def forward(ctx, t: torch.Tensor, comm: Comm, axes: tuple[str, ...]) -> torch.Tensor:
        ctx.comm, ctx.axes = comm, axes
        return feature_slice(t, comm, axes).contiguous()

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        return gather_features(g.contiguous(), ctx.comm, ctx.axes), None, None


class ScatterFeatures(torch.autograd.Function):
    """forward: reduce-scatter over axes along the last dimension (sum of partials, this rank's
    feature block); backward: all-gather of the gradient's feature blocks over axes."""

    @staticmethod
    def forward(ctx, t: torch.Tensor, comm: Comm, axes: tuple[str, ...]) -> torch.Tensor:
        ctx.comm, ctx.axes = comm, axes
        return scatter_features(t, comm, axes)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        return gather_features(g.contiguous(), ctx.comm, ctx.axes), None, None


def slice_features(t: torch.Tensor, comm: Comm, axes: Iterable[str] | str) -> torch.Tensor:
    """Differentiable :class:`SliceFeatures` (identity when the group has one rank)."""
    axes = _key(axes)
    return t if comm.size(axes) == 1 else _apply(SliceFeatures, t, comm, axes)


class GatherFeatures(torch.autograd.Function):
    """forward: all-gather over axes along the last dimension (the whole features on every rank, whose
    consumers then compute alike); backward: this rank's feature block of the gradient (no
    communication: every rank of the group holds the same gradient)."""

    @staticmethod
    def forward(ctx, t: torch.Tensor, comm: Comm, axes: tuple[str, ...]) -> torch.Tensor:
        ctx.comm, ctx.axes = comm, axes
        return gather_features(t.contiguous(), comm, axes)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        return feature_slice(g, ctx.comm, ctx.axes).contiguous(), None, None


def replicate_features(t: torch.Tensor, comm: Comm, axes: Iterable[str] | str) -> torch.Tensor:
    """Differentiable :class:`GatherFeatures` (identity when the group has one rank)."""
    axes = _key(axes)
    return t if comm.size(axes) == 1 else _apply(GatherFeatures, t, comm, axes)


class AllToAll(torch.autograd.Function):
    """forward: all-to-all over axes of dimension-0 rows (``send[i]`` rows to rank ``i``,
    ``recv[i]`` rows from it); backward: the reverse all-to-all of the gradient (``recv`` rows
    back to each rank, ``send`` from it)."""

    @staticmethod
    def forward(ctx, t: torch.Tensor, comm: Comm, axes: tuple[str, ...], send: list[int], recv: list[int]):
        ctx.comm, ctx.axes, ctx.send, ctx.recv = comm, axes, send, recv
        return comm.all_to_all(t, axes, send, recv)[0]

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        return ctx.comm.all_to_all(g, ctx.axes, ctx.recv, ctx.send)[0], None, None, None, None


@eager
def all_to_all(
    t: torch.Tensor, comm: Comm, axes: Iterable[str] | str, send: list[int], recv: list[int]
) -> torch.Tensor:
    """Differentiable :class:`AllToAll` of the rows of ``t`` (``(sum(send), ...)`` ->
    ``(sum(recv), ...)``; identity when the group has one rank)."""
    axes = _key(axes)
    return t if comm.size(axes) == 1 else AllToAll.apply(t, comm, axes, list(send), list(recv))
