"""Agarwal's 3D parallel linear layer (DESIGN.md section 2).

``Y = X @ W.T`` with ``X: (M, K)``, ``W: (N, K)``. Non-transposed: ``K`` split
over x, ``N`` over y; transposed: ``K`` over y, ``N`` over x. Rows of X are
split over ``(z, data)``. The weight block ``W[out-slice, in-slice]`` is
flattened and split again over z: at rest a rank holds ``N*K/(G_x*G_y*G_z)``
weights.

forward:  W_blk = all_gather_z(W_piece); Y_part = X_blk @ W_blk.T; Y = all_reduce_in(Y_part)
backward: dX = all_reduce_out(dY @ W_blk) (issued before the dW GEMM);
          dW_piece = reduce_scatter_z(dY.T @ X_blk)
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from axo4d.comm import Comm
from axo4d.grid import GridError
from axo4d.sharding import Sharding, set_sharding


def _compute_dtype(t: torch.Tensor) -> torch.dtype:
    if t.is_cuda and torch.is_autocast_enabled("cuda"):
        return torch.get_autocast_dtype("cuda")
    return t.dtype


class _Linear3DFn(torch.autograd.Function):
    """forward: all-gather W over z (prefetched by the model's :class:`~axo4d.overlap.Overlap` when
    there is one), GEMM (bias fused via addmm when G_in = 1), all-reduce Y over the input axis;
    backward: all-gather W over z again (none when G_z = 1: the block is saved), dX GEMM and its
    all-reduce over the output axis issued async, dW GEMM, reduce-scatter of dW over z (left in
    the background under overlap: the gradient is then accumulated by the scheduler), wait dX."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w_piece: torch.Tensor, bias: torch.Tensor | None,
                lin: "Linear3D") -> torch.Tensor:
        cd = _compute_dtype(x)
        with torch.autocast(x.device.type, enabled=False):
            x2 = x.reshape(-1, x.shape[-1]).to(cd)            # (M_loc, K/in)
            w = lin.weight_block(w_piece, cd, backward=False)  # (N/out, K/in)
            b = None if bias is None else bias.to(cd)
            y = lin.mm("fwd", x2, w.t(), b)                  # (M_loc, N/out), partial over in
            y = lin.comm.all_reduce(y, lin.in_axis)
        ctx.keep_block = lin.comm.size("z") == 1             # no gather to save: keep the (cast) block
        ctx.save_for_backward(x2, w if ctx.keep_block else w_piece)
        ctx.lin, ctx.x_shape, ctx.x_dtype = lin, x.shape, x.dtype
        ctx.bias_dtype = None if bias is None else bias.dtype
        return y.reshape(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x2, w_saved = ctx.saved_tensors
        lin: Linear3D = ctx.lin
        if lin.overlap is not None:
            lin.overlap.enter_backward()
        with torch.autocast(x2.device.type, enabled=False):
            dy2 = dy.reshape(-1, dy.shape[-1]).to(x2.dtype)  # (M_loc, N/out)
            w = w_saved if ctx.keep_block else lin.weight_block(w_saved, x2.dtype, backward=True)
            dx = lin.mm("dx", dy2, w)                         # (M_loc, K/in), partial over out
            h = lin.comm.all_reduce(dx, lin.out_axis, async_op=True)
            dw = lin.mm("dw", dy2.t(), x2).to(lin.weight.dtype)  # (N/out, K/in), partial over z-batch
            db = None if ctx.bias_dtype is None else dy2.sum(0).to(ctx.bias_dtype)
            dw_piece = lin.reduce_scatter_grad(dw)           # None when left in the background
            dx = h.wait()
        return dx.reshape(ctx.x_shape).to(ctx.x_dtype), dw_piece, db, None


@torch.compiler.disable
def _linear3d(x: torch.Tensor, w_piece: torch.Tensor, bias: torch.Tensor | None, lin: "Linear3D") -> torch.Tensor:
    """The autograd function, kept out of torch.compile graphs (collectives, scheduler state)."""
    return _Linear3DFn.apply(x, w_piece, bias, lin)


class Linear3D(nn.Module):
    """A linear layer sharded by Agarwal's 3D algorithm over the grid of ``comm``.

    Input ``(..., K/G_in)`` with rows split over (z, data); output
    ``(..., N/G_out)`` replicated over the input axis.
    """

    def __init__(self, in_features: int, out_features: int, comm: Comm, *, transposed: bool = False,
                 bias: bool = True, name: str = "linear") -> None:
        super().__init__()
        self.comm, self.name = comm, name
        self.in_features, self.out_features, self.transposed = in_features, out_features, transposed
        self.in_axis, self.out_axis = ("y", "x") if transposed else ("x", "y")
        g_in, g_out, g_z = comm.size(self.in_axis), comm.size(self.out_axis), comm.size("z")
        for what, n, axis, g in (("input features", in_features, self.in_axis, g_in),
                                 ("output features", out_features, self.out_axis, g_out)):
            if n % g:
                raise GridError(f"{name}: {what} {n} not divisible by G_{axis}={g}; "
                                f"choose G_{axis} among the divisors of {n}")
        self.block_shape = (out_features // g_out, in_features // g_in)
        blk = self.block_shape[0] * self.block_shape[1]
        if blk % g_z:
            raise GridError(f"{name}: weight block of {blk} elements ({self.block_shape}) not divisible by "
                            f"G_z={g_z}; choose G_z among the divisors of {blk}")
        self.weight = set_sharding(nn.Parameter(torch.empty(blk // g_z)), Sharding(
            split=("x", "y", "z"), grad_sum=("data",), layout="linear3d", in_axis=self.in_axis,
            out_axis=self.out_axis, weight_decay=True, full_shape=(out_features, in_features)))
        self.bias = None
        if bias:
            self.bias = set_sharding(nn.Parameter(torch.zeros(self.block_shape[0])), Sharding(
                split=(self.out_axis,), grad_sum=("z", "data"), layout="cols", full_shape=(out_features,)))
        #: set by the owning model: the overlap scheduler (and this layer's index in it), the GEMM tuner
        self.overlap = None
        self.index = -1
        self.tuner = None
        #: x, y and z all of one rank: the layer is an nn.Linear (no collective can occur)
        self.trivial = g_in == g_out == g_z == 1

    # ---- weights -------------------------------------------------------------
    def gather_weight(self, piece: torch.Tensor) -> torch.Tensor:
        """All-gather this rank's z piece into the ``(N/G_out, K/G_in)`` block."""
        return self.comm.all_gather(piece, "z").view(self.block_shape)

    def weight_block(self, piece: torch.Tensor, dtype: torch.dtype, backward: bool) -> torch.Tensor:
        """The gathered block in ``dtype``: from the overlap scheduler (prefetched) or gathered now."""
        if self.overlap is not None and self.comm.size("z") > 1:
            return self.overlap.gather(self, dtype, backward)
        return self.gather_weight(piece.to(dtype))

    def reduce_scatter_grad(self, dw: torch.Tensor) -> torch.Tensor | None:
        """This rank's piece of ``dw`` summed over z, or ``None`` when the overlap scheduler
        reduces it in the background and accumulates it into ``weight.grad`` itself."""
        if self.overlap is not None and self.comm.size("z") > 1:
            self.overlap.reduce_scatter_background(self, dw)
            return None
        return self.comm.reduce_scatter(dw, "z").view_as(self.weight)

    def mm(self, kind: str, a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``a @ b`` (+ ``bias``) for GEMM ``kind`` ('fwd', 'dx', 'dw'), in the tuner's layout if any."""
        if self.tuner is not None:
            return self.tuner.matmul(kind, a, b, bias, tag=self.name)
        return a @ b if bias is None else torch.addmm(bias, a, b)

    def shard_full_weight(self, weight: torch.Tensor) -> torch.Tensor:
        """This rank's flat z piece of a full ``(N, K)`` weight (pure slicing)."""
        return shard_linear_weight(weight, self.comm, self.in_axis, self.out_axis)

    @torch.no_grad()
    def load_full(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> "Linear3D":
        """Load from a full ``nn.Linear``-shaped weight (and bias)."""
        if tuple(weight.shape) != (self.out_features, self.in_features):
            raise ValueError(f"{self.name}: full weight shape {tuple(weight.shape)} != "
                             f"{(self.out_features, self.in_features)}")
        self.weight.copy_(self.shard_full_weight(weight))
        if self.bias is not None:
            if bias is None:
                raise ValueError(f"{self.name}: layer has a bias but none was given")
            self.bias.copy_(bias.chunk(self.comm.size(self.out_axis))[self.comm.coord(self.out_axis)])
        return self

    @classmethod
    def from_linear(cls, linear: nn.Linear, comm: Comm, *, transposed: bool = False,
                    name: str = "linear") -> "Linear3D":
        lin = cls(linear.in_features, linear.out_features, comm, transposed=transposed,
                  bias=linear.bias is not None, name=name)
        return lin.load_full(linear.weight.detach(), None if linear.bias is None else linear.bias.detach())

    def full_weight(self) -> torch.Tensor:
        """The unsharded ``(N, K)`` weight, assembled on every rank (collective)."""
        return gather_linear_weight(self.weight.detach(), self.comm, self.in_axis, self.out_axis,
                                    (self.out_features, self.in_features))

    # ---- compute ---------------------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.trivial and self.tuner is None:       # exactly nn.Linear: no wrapper, compiles as one graph
            return F.linear(x, self.weight.view(self.block_shape), self.bias)
        fuse = self.bias is not None and self.comm.size(self.in_axis) == 1   # output not summed: addmm
        y = _linear3d(x, self.weight, self.bias if fuse else None, self)   # (..., N/G_out)
        if self.bias is not None and not fuse:
            y = y + self.bias.to(y.dtype)    # after the all-reduce over the input axis: added once
        return y

    # ---- test/debug helpers ----------------------------------------------------
    def shard_input(self, x_full: torch.Tensor) -> torch.Tensor:
        """This rank's block of a full input ``(M, K)``: rows over (z, data), features over G_in."""
        return shard_rows(x_full, self.comm).chunk(self.comm.size(self.in_axis), -1)[self.comm.coord(self.in_axis)]

    def gather_output(self, y_blk: torch.Tensor) -> torch.Tensor:
        """The full ``(M, N)`` output from every rank's block (collective over the world)."""
        return gather_blocks(y_blk, self.comm, row_axes=("z", "data"), col_axis=self.out_axis)

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features}, transposed={self.transposed}, "
                f"block={self.block_shape}, piece={self.weight.numel()}")


def shard_linear_weight(weight: torch.Tensor, comm: Comm, in_axis: str, out_axis: str) -> torch.Tensor:
    """Flat z piece of ``weight[out-slice, in-slice]`` for this rank (pure)."""
    blk = weight.chunk(comm.size(out_axis), 0)[comm.coord(out_axis)]
    blk = blk.chunk(comm.size(in_axis), 1)[comm.coord(in_axis)]
    return blk.reshape(-1).chunk(comm.size("z"))[comm.coord("z")].clone()


def gather_linear_weight(piece: torch.Tensor, comm: Comm, in_axis: str, out_axis: str,
                         full_shape: tuple[int, int]) -> torch.Tensor:
    """Inverse of :func:`shard_linear_weight` (collective over the world)."""
    pieces = _gather_world(piece, comm)
    n, k = full_shape
    g_in, g_out, g_z = comm.size(in_axis), comm.size(out_axis), comm.size("z")
    out = torch.empty(n, k, dtype=piece.dtype, device=piece.device)
    bn, bk = n // g_out, k // g_in
    for i in range(g_out):
        for j in range(g_in):
            flat = torch.cat([pieces[comm.grid.rank(**{out_axis: i, in_axis: j, "z": zz})]
                              for zz in range(g_z)])
            out[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk] = flat.view(bn, bk)
    return out


def shard_rows(x_full: torch.Tensor, comm: Comm) -> torch.Tensor:
    """Rows of ``x_full`` for this rank: split over (z, data), z fastest."""
    n = comm.size(("z", "data"))
    if x_full.shape[0] % n:
        raise GridError(f"batch of {x_full.shape[0]} rows not divisible by G_data*G_z={n}")
    return x_full.chunk(n, 0)[comm.index(("z", "data"))]


def _gather_world(t: torch.Tensor, comm: Comm) -> list[torch.Tensor]:
    """``t`` of every rank, indexed by global rank."""
    if comm.grid.world_size == 1:
        return [t]
    out = [torch.empty_like(t) for _ in range(comm.grid.world_size)]
    dist.all_gather(out, t.contiguous())
    return out


def gather_blocks(blk: torch.Tensor, comm: Comm, row_axes: tuple[str, ...], col_axis: str | None) -> torch.Tensor:
    """Assemble a 2D tensor split over ``row_axes`` on dim 0 and ``col_axis`` on dim -1."""
    blocks = _gather_world(blk.detach(), comm)
    g = comm.grid
    n_rows = g.size(*row_axes)
    n_cols = g.size(col_axis) if col_axis else 1
    grid_rows = [[None] * n_cols for _ in range(n_rows)]
    for r, b in enumerate(blocks):
        c = g.coords(r)
        i = g.group_index(r, row_axes)
        j = c[col_axis] if col_axis else 0
        grid_rows[i][j] = b
    return torch.cat([torch.cat(row, -1) for row in grid_rows], 0)


def init_normal_(t: torch.Tensor, std: float, seed: int) -> torch.Tensor:
    """Fill ``t`` from N(0, std) with its own generator (grid-independent init)."""
    g = torch.Generator().manual_seed(seed)
    return t.copy_(torch.randn(t.shape, generator=g) * std)


__all__ = ["Linear3D", "shard_linear_weight", "gather_linear_weight", "shard_rows", "gather_blocks",
           "init_normal_"]
