"""Agarwal's 3D parallel linear layer (docs/design.md section 2).

``Y = X @ W.T`` with ``X: (M, K)``, ``W: (N, K)``. Non-transposed: ``K`` split over x, ``N``
over y; transposed: ``K`` over y, ``N`` over x. Rows of X are split over ``(z, data)``. The
weight block ``W[out-slice, in-slice]`` is flattened and split again over z
(:class:`~axo4d.facts.placement.Block3D`): at rest a rank holds ``N*K/(G_x*G_y*G_z)`` weights.

The activations between layers are split over both tensor axes (docs/design.md section 15): the
input arrives as ``(M, K/(G_x*G_y))`` and the output leaves as ``(M, N/(G_x*G_y))``, so nothing
between two GEMMs is computed twice.

forward:  W_blk = all_gather_z(W_piece); X_blk = all_gather_out(X) (features);
          Y = reduce_scatter_in(X_blk @ W_blk.T) (features)
          (in row chunks: every chunk's gather issued at once and waited for before its GEMM, each
          chunk's reduce-scatter behind the next chunk's GEMM when overlapped)
backward: dY_blk = all_gather_in(dY); dX = reduce_scatter_out(dY_blk @ W_blk) (issued before the dW GEMM;
          in row chunks: each chunk's dY gathered before its dX GEMM, its dX reduce-scatter in flight
          behind the next chunks' GEMMs and the dW GEMM);
          dW_piece = reduce_scatter_z(dY.T @ X_blk)
          overlapped schedule: a layer whose output axis is of one rank (no dX all-reduce to run
          behind) leaves its dW GEMM to the next layer whose dX all-reduce is in flight

When the z gather and reduce-scatter happen is the layer's :class:`~axo4d.nn.schedule.Schedule`'s
business; the layer only asks for its block and hands over its gradient. A layer its context's FP8
plan names runs the three GEMMs as scaled FP8 GEMMs (:mod:`axo4d.nn.fp8_linear`), its block
gathered over z in FP8; the others (and every layer without a plan) in the compute dtype.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from axo4d.config.errors import GridError
from axo4d.dist.comm import Comm
from axo4d.dist.eager import eager
from axo4d.dist.mappings import Done, gather_features, scatter_features
from axo4d.facts.fp8_rule import MULTIPLE as FP8_MULTIPLE
from axo4d.facts.placement import Block3D, constant, normal, place
from axo4d.facts.spec import LinearSpec
from axo4d.nn.context import LayerContext, as_context
from axo4d.nn.fp8_linear import fp8_linear3d


def compute_dtype(t: torch.Tensor) -> torch.dtype:
    """The GEMM dtype ``F.linear`` would use here: autocast's on this device type (CUDA or CPU), else ``t``'s."""
    dev = t.device.type
    if torch.is_autocast_enabled(dev):
        return torch.get_autocast_dtype(dev)
    return t.dtype


class _Linear3DFn(torch.autograd.Function):
    """forward: X's feature blocks all-gathered over the output axis, the gathered weight block from
    the schedule, GEMM (bias fused via addmm on the input axis's first rank), reduce-scatter of Y's
    features over the input axis (in row chunks, :meth:`~axo4d.facts.spec.LinearSpec.fwd_chunks`:
    the overlapped schedule leaves each chunk's reduce-scatter in flight behind the next chunk's GEMM);
    backward: dY's feature blocks all-gathered over the input axis, the block again (none when
    G_z = 1: the cast block is saved), dX GEMM and its reduce-scatter over the output axis issued
    async, the dW GEMMs earlier layers deferred (overlapped schedule), dW GEMM -- or, with no
    reduce-scatter of its own, deferred to the next one -- dW handed to the schedule (reduce-scatter
    over z, now or in the background), wait dX."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w_piece: torch.Tensor, bias: torch.Tensor | None, lin: Linear3D) -> torch.Tensor:
        cd = compute_dtype(x)
        comm, a_in, a_out = lin.comm, lin.in_axis, lin.out_axis
        with torch.autocast(x.device.type, enabled=False):
            xp = x.reshape(-1, x.shape[-1]).to(cd)  # (M_loc, K/(x*y))
            k_in, n_out = xp.shape[1] * comm.size(a_out), lin.out_features // comm.size(a_out)
            chunks = lin.spec.fwd_chunks(comm.size(a_in), xp.shape[0], n_out, comm.size(a_out), k_in)
            x2, got = _gather_rows(lin, xp, a_out, chunks, k_in)  # (M_loc, K/in), the chunks' gathers issued
            w = lin.schedule.weight(lin, cd, backward=False)  # (N/out, K/in)
            b = None if bias is None else bias.to(cd)
            if chunks == 1:
                y = scatter_features(_fwd_gemm(lin, x2, w, b), comm, a_in)  # (M_loc, N/(x*y))
            else:  # each chunk's reduce-scatter over the input axis in flight while the next chunk computes
                hs = [lin.schedule.partial_scatter(_fwd_gemm(lin, g.wait(), w, b), a_in) for g in got]
                y = torch.cat([h.wait() for h in hs])  # (M_loc, N/(x*y))
        ctx.keep_block = comm.size("z") == 1  # no gather to save: keep the (cast) block
        ctx.save_for_backward(x2, w if ctx.keep_block else w_piece)
        ctx.lin, ctx.x_shape, ctx.x_dtype = lin, x.shape, x.dtype
        ctx.bias_dtype = None if bias is None else bias.dtype
        return y.reshape(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x2, w_saved = ctx.saved_tensors
        lin: Linear3D = ctx.lin
        lin.schedule.backward_step(lin)
        with torch.autocast(x2.device.type, enabled=False):
            dyp = dy.reshape(-1, dy.shape[-1]).to(x2.dtype)  # (M_loc, N/(x*y))
            comm, a_in, a_out = lin.comm, lin.in_axis, lin.out_axis
            chunks = lin.spec.bwd_chunks(comm.size(a_in), comm.size(a_out), dyp.shape[0])
            dy2, got = _gather_rows(lin, dyp, a_in, chunks, dyp.shape[1] * comm.size(a_in))  # (M_loc, N/out)
            w = w_saved if ctx.keep_block else lin.schedule.weight(lin, x2.dtype, backward=True)
            if chunks == 1:
                hs = [scatter_features(lin.mm("dx", dy2, w), comm, a_out, async_op=True)]  # (M_loc, K/in) partial
            else:  # each chunk's dX reduce-scatter in flight behind the next chunks' GEMMs and the dW GEMM
                hs = [scatter_features(lin.mm("dx", g.wait(), w), comm, a_out, async_op=True) for g in got]
            sched = lin.schedule
            if comm.size(a_out) > 1:
                sched.behind_collective()  # earlier layers' deferred dW GEMMs, behind this reduce-scatter
            db = None if ctx.bias_dtype is None else dy2.sum(0).to(ctx.bias_dtype)  # the same on every in rank
            if sched.defers_weight_grad(lin):  # nothing of its own to hide: behind the next reduce-scatter
                sched.defer_weight_grad(lin, lambda: _dw_gemm(lin, dy2, x2))
                dw_piece = None
            else:
                dw = lin.mm("dw", dy2.t(), x2).to(lin.weight.dtype)  # (N/out, K/in), partial over z-batch
                dw_piece = sched.weight_grad(lin, dw)  # None when reduced in the background
            dx = torch.cat([h.wait() for h in hs]) if len(hs) > 1 else hs[0].wait()  # (M_loc, K/(x*y))
        return dx.reshape(*ctx.x_shape[:-1], dx.shape[-1]).to(ctx.x_dtype), dw_piece, db, None


def _gather_rows(lin: Linear3D, t: torch.Tensor, axis: str, chunks: int, width: int) -> tuple[torch.Tensor, list]:
    """``t``'s features over ``axis``, ``(M_loc, width)`` (a layer's input over its output axis, or dY
    over its input axis); in ``chunks`` row chunks (exactly as many as the model facts count) every
    chunk's all-gather is issued at once, and each handle's ``wait()`` (just before its chunk's GEMM)
    gives its rows: the overlapped schedule leaves the later ones in flight behind the earlier chunks'
    GEMMs."""
    comm = lin.comm
    if chunks == 1:
        return gather_features(t, comm, axis), []
    pieces = t.tensor_split(chunks)  # (M_loc/chunks, width/G) each
    if comm.size(axis) == 1:
        return t, [Done(p) for p in pieces]  # nothing to gather
    whole = t.new_empty(t.shape[0], width)  # (M_loc, width), written chunk by chunk
    return whole, [lin.schedule.partial_gather(p, axis, o) for p, o in zip(pieces, whole.tensor_split(chunks))]


def _fwd_gemm(lin: Linear3D, x2: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """The forward GEMM, partial over the input axis; the bias fused (addmm) when that axis has one
    rank, else added once, by its first rank, before the sum (every rank runs the same GEMM: the
    tuner's choices are agreed over the ranks)."""
    if b is None or lin.comm.size(lin.in_axis) == 1:
        return lin.mm("fwd", x2, w.t(), b)  # (M_loc, N/out)
    y = lin.mm("fwd", x2, w.t())  # (M_loc, N/out), partial over in
    return y.add_(b) if lin.comm.coord(lin.in_axis) == 0 else y


def _dw_gemm(lin: Linear3D, dy2: torch.Tensor, x2: torch.Tensor) -> torch.Tensor:
    """A deferred dW GEMM, as the backward would have run it (autocast off, the layer's layout)."""
    with torch.autocast(x2.device.type, enabled=False), torch.no_grad():
        return lin.mm("dw", dy2.t(), x2).to(lin.weight.dtype)  # (N/out, K/in), partial over z-batch


@eager
def _linear3d(x: torch.Tensor, w_piece: torch.Tensor, bias: torch.Tensor | None, lin: Linear3D) -> torch.Tensor:
    """The autograd function, kept out of torch.compile graphs (collectives, schedule state)."""
    return _Linear3DFn.apply(x, w_piece, bias, lin)


class Linear3D(nn.Module):
    """A linear layer sharded by Agarwal's 3D algorithm over the grid of ``ctx``.

    Input ``(..., K/(G_x*G_y))`` with rows split over (z, data) and features over (x, y) (this
    rank's block of its input-axis slice, by its output-axis coordinate); output
    ``(..., N/(G_x*G_y))``, this rank's block (by input-axis coordinate) of its output-axis slice.
    ``ctx``: a :class:`~axo4d.nn.context.LayerContext` (a bare :class:`~axo4d.dist.comm.Comm` gets an
    eager schedule of its own).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        ctx: LayerContext | Comm,
        *,
        transposed: bool = False,
        bias: bool = True,
        name: str = "linear",
        n_logical: int = 0,
        init_std: float = 0.02,
    ) -> None:
        super().__init__()
        ctx = as_context(ctx)
        #: the FP8 recipe of this layer's GEMMs (:mod:`axo4d.nn.fp8`), or None: the compute dtype
        self.fp8 = ctx.fp8.recipe_for(name) if ctx.fp8 is not None else None
        self.fp8_plan = ctx.fp8 if self.fp8 is not None else None
        fp8 = self.fp8.name if self.fp8 is not None else ""
        self.spec = LinearSpec(name, in_features, out_features, transposed, bias, n_logical, init_std, fp8)
        self.comm, self.schedule, self.tuner, self.name = ctx.comm, ctx.schedule, ctx.tuner, name
        self.in_features, self.out_features, self.transposed = in_features, out_features, transposed
        self.in_axis, self.out_axis = self.spec.axes()
        bad = self.spec.divisibility(self.comm.grid)
        if bad:
            raise GridError(f"{bad[0]}; choose grid sizes that divide the layer's features (and G_z its weight block)")
        grid, pl = self.comm.grid, self.spec.placements()
        wp: Block3D = pl["weight"]  # type: ignore[assignment]
        self.block_shape = wp.block_shape(grid)
        self.weight = place(nn.Parameter(torch.empty(wp.local_shape(grid))), wp, normal(init_std))
        self.bias = None
        if bias:
            bp = pl["bias"]
            self.bias = place(nn.Parameter(torch.zeros(bp.local_shape(grid))), bp, constant(0.0))
        self.index = self.schedule.register(self)
        #: x, y and z all of one rank and no FP8: the layer is an nn.Linear (no collective can occur)
        g1 = self.comm.size(self.in_axis) == self.comm.size(self.out_axis) == self.comm.size("z") == 1
        self.trivial = g1 and self.fp8 is None
        self._tuned_plain: bool | None = None  # the tuner's verdict once decided (see plain())

    @classmethod
    def from_spec(cls, spec: LinearSpec, ctx: LayerContext | Comm) -> Linear3D:
        return cls(
            spec.k,
            spec.n,
            ctx,
            transposed=spec.transposed,
            bias=spec.bias,
            name=spec.name,
            n_logical=spec.n_logical,
            init_std=spec.init_std,
        )

    def mm(self, kind: str, a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``a @ b`` (+ ``bias``) for GEMM ``kind`` ('fwd', 'dx', 'dw'), in the tuner's layout if any."""
        if self.tuner is not None:
            return self.tuner.matmul(kind, a, b, bias, tag=self.name)
        return a @ b if bias is None else torch.addmm(bias, a, b)

    def plain(self) -> bool:
        """Whether this layer runs as ``F.linear``: x, y and z of one rank (no collective can occur)
        and no GEMM layout but the default wanted -- no tuner, or the tuner chose ``a@b`` for the
        forward, dX and dW GEMMs (decided on their first use, through the autograd function).

        The tuner is asked only inside the model's forward (``schedule.in_forward``), never in an
        activation-checkpoint recompute: the recompute must take the path its forward took, even
        when the tuner decided this layer's GEMMs in between (another block's backward)."""
        if not self.trivial:
            return False
        if self.tuner is None:
            return True
        if self._tuned_plain is None and self.schedule.in_forward:
            self._tuned_plain = self.tuner.chose_default(self.name)
        return bool(self._tuned_plain)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.plain():  # exactly nn.Linear: autograd's own, compiles into the block's graph
            return F.linear(x, self.weight.view(self.block_shape), self.bias)
        if self.fp8 is not None:  # bias added after the GEMM in the compute dtype, as torchao does
            return self._fp8_forward(x)  # (..., N/(G_x*G_y))
        return _linear3d(x, self.weight, self.bias, self)  # (..., N/(G_x*G_y))

    def _fp8_forward(self, x: torch.Tensor) -> torch.Tensor:
        """The FP8 layer on ``x``; rows that are not a multiple of 16 (FP8 GEMMs need it: a decoding
        step's, an expert's routed rows) padded with zero rows, whose outputs are dropped: a zero row
        changes no scale (amax) and adds nothing to the weight's or the bias's gradient."""
        rows = math.prod(x.shape[:-1])
        pad = -rows % FP8_MULTIPLE
        if not pad:
            return fp8_linear3d(x, self.weight, self.bias, self, compute_dtype(x))
        flat = F.pad(x.reshape(rows, x.shape[-1]), (0, 0, 0, pad))  # (rows + pad, K/...)
        y = fp8_linear3d(flat, self.weight, self.bias, self, compute_dtype(x))[:rows]
        return y.view(*x.shape[:-1], y.shape[-1])

    def extra_repr(self) -> str:
        return (
            f"in={self.in_features}, out={self.out_features}, transposed={self.transposed}, "
            f"block={self.block_shape}, piece={self.weight.numel()}"
            + (f", fp8={self.fp8.name}" if self.fp8 is not None else "")
        )


__all__ = ["Linear3D", "compute_dtype"]
