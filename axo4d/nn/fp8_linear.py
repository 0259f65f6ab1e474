"""The FP8 GEMMs of a :class:`~axo4d.nn.linear.Linear3D` (docs/fp8.md): its forward, dX and dW
GEMMs as scaled FP8 GEMMs of its recipe (:mod:`axo4d.nn.fp8`), the same collectives as the
layer in the compute dtype, the weight block gathered over z in FP8.

forward:  X_fp8 = cast(X_blk) (amax agreed over the input axis: a scalar, or one per row);
          W_fp8 = the schedule's block, its z pieces cast before the gather (scales of the
          whole weight, :class:`~axo4d.nn.fp8.WeightScales`);
          Y_part = scaled_mm(X_fp8, W_fp8^T) in the compute dtype; Y = reduce_scatter_in(Y_part)
          (X_blk: X's feature blocks all-gathered over the output axis, docs/design.md section 15)
backward: dY_fp8 = cast(all_gather_in(dY)) (amax agreed over the output axis); dX = reduce_scatter_out(scaled_mm(
          dY_fp8, W_fp8)) issued async; dW = scaled_mm(dY_fp8^T, X_fp8) ('rowwise': per-column
          casts of this rank's rows, no collective), in fp32, reduce-scattered over z by the
          schedule (in the gradient dtype, never FP8)
"""

from __future__ import annotations

import torch
from torch import nn

from axo4d.dist.eager import eager
from axo4d.dist.mappings import gather_features, scatter_features
from axo4d.nn.fp8 import Fp8Tensor, Recipe, WeightCast, cast, scaled_mm

Linear3D = nn.Module  # an axo4d.nn.linear.Linear3D with a recipe (``fp8``, ``fp8_plan``); not imported: it imports us


def weight_cast(lin: Linear3D, backward: bool) -> WeightCast:
    """The cast of ``lin``'s weight block for its forward (``backward=False``) or dX GEMM."""
    r: Recipe = lin.fp8
    plan = lin.fp8_plan
    return WeightCast(r.w_dx if backward else r.w, plan.weight_scales, plan.stats)


class _Fp8Linear3DFn(torch.autograd.Function):
    """forward: X gathered over the output axis (features) and cast, the FP8 block from the schedule,
    scaled GEMM, reduce-scatter of Y's features over the input axis; backward: dY gathered over the
    input axis and cast, dX scaled GEMM and its reduce-scatter over the output axis issued async,
    dW scaled GEMM (fp32) handed to the schedule (reduce-scatter over z), wait dX. The block is
    kept from forward for backward when the recipe casts it alike and there is no gather to save
    (G_z = 1); a tensorwise X_fp8 is kept for dW instead of X (1 byte an element)."""

    @staticmethod
    def forward(
        ctx, x: torch.Tensor, w_piece: torch.Tensor, bias: torch.Tensor | None, lin: Linear3D, cd: torch.dtype
    ) -> torch.Tensor:
        r: Recipe = lin.fp8
        st = lin.fp8_plan.stats
        with torch.autocast(x.device.type, enabled=False):
            x2 = gather_features(x.reshape(-1, x.shape[-1]).to(cd), lin.comm, lin.out_axis)  # (M_loc, K/in)
            xq = cast(x2, r.x, lin.comm, (), (lin.in_axis,), st)
            w = lin.schedule.weight(lin, weight_cast(lin, False), backward=False)  # FP8 (N/out, K/in)
            y = scaled_mm(xq, w.t(), cd, fast_accum=True)  # (M_loc, N/out), partial over in
            if bias is not None and lin.comm.coord(lin.in_axis) == 0:  # added once, before the sum
                y = y + bias.to(cd)
            y = scatter_features(y, lin.comm, lin.in_axis)  # (M_loc, N/(x*y))
        keep_x = r.x_dw == r.x  # the forward's cast serves dW
        ctx.keep_block = lin.comm.size("z") == 1 and r.fp8_weight_in_backward
        saved = [xq.data, xq.scale] if keep_x else [x2]
        saved += [w.data, w.scale] if ctx.keep_block else []
        ctx.save_for_backward(*saved)
        ctx.keep_x, ctx.lin, ctx.cd, ctx.x_shape, ctx.x_dtype = keep_x, lin, cd, x.shape, x.dtype
        ctx.bias_dtype = None if bias is None else bias.dtype
        return y.reshape(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        lin: Linear3D = ctx.lin
        r: Recipe = lin.fp8
        st = lin.fp8_plan.stats
        saved = list(ctx.saved_tensors)
        if ctx.keep_x:
            xq, x2 = Fp8Tensor(saved.pop(0), saved.pop(0)), None
        else:
            xq, x2 = None, saved.pop(0)
        lin.schedule.backward_step(lin)
        with torch.autocast(dy.device.type, enabled=False):
            dy2 = gather_features(dy.reshape(-1, dy.shape[-1]).to(ctx.cd), lin.comm, lin.in_axis)  # (M_loc, N/out)
            dyq = cast(dy2, r.dy, lin.comm, (), (lin.out_axis,), st)
            if ctx.keep_block:
                w = Fp8Tensor(saved[0], saved[1])
            else:
                w = lin.schedule.weight(lin, weight_cast(lin, True), backward=True)  # FP8 (N/out, K/in)
            dx = scaled_mm(dyq, w, ctx.cd, fast_accum=False)  # (M_loc, K/in), partial over out
            h = scatter_features(dx, lin.comm, lin.out_axis, async_op=True)  # -> (M_loc, K/(x*y))
            dyq_w = dyq if r.dy_dw == r.dy else cast(dy2, r.dy_dw, lin.comm, (), (lin.out_axis,), st)
            if xq is None:
                xq = cast(x2, r.x_dw, lin.comm, (), (lin.in_axis,), st)
            dw = scaled_mm(dyq_w.t(), xq, ctx.cd, fast_accum=False).to(lin.weight.dtype)  # (N/out, K/in)
            dw_piece = lin.schedule.weight_grad(lin, dw)  # None when reduced in the background
            dx = h.wait()
        db = None if ctx.bias_dtype is None else dy2.sum(0).to(ctx.bias_dtype)  # the same on every in rank
        return dx.reshape(*ctx.x_shape[:-1], dx.shape[-1]).to(ctx.x_dtype), dw_piece, db, None, None


@eager
def fp8_linear3d(
    x: torch.Tensor, w_piece: torch.Tensor, bias: torch.Tensor | None, lin: Linear3D, cd: torch.dtype
) -> torch.Tensor:
    """``lin``'s output ``(..., N/(G_x*G_y))`` from FP8 GEMMs plus ``bias`` (added once in the compute dtype after
    the GEMM, before the reduce-scatter; its gradient from the gathered dY), GEMMs and
    outputs in the compute dtype ``cd``; kept out of torch.compile graphs (collectives)."""
    return _Fp8Linear3DFn.apply(x, w_piece, bias, lin, cd)


__all__ = ["fp8_linear3d", "weight_cast"]
