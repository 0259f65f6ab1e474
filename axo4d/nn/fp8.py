"""Scaled FP8 GEMMs (docs/design.md section 13, docs/fp8.md): recipes, casts with dynamic
scales that the grid agrees on, the weight cast of the z gather, and the GEMM.

A cast of a high-precision tensor ``t`` to FP8 is ``t_fp8 = sat(t * s)`` with the scale
``s = fmax / amax`` (``fmax``: 448 for e4m3, 57344 for e5m2; ``amax`` computed from ``t`` itself,
clamped below at 1e-12; ``s`` computed in fp64, kept in fp32, for the rowwise recipe rounded down
to a power of two); ``sat`` clamps to ``[-fmax, fmax]``. ``torch._scaled_mm`` takes the FP8
operands and ``1/s`` of each and returns the compute dtype. Granularity: one scale per tensor
(``tensor``), per row (``row``) or per column (``col``) -- torchao's recipes ``tensorwise`` and
``rowwise`` (:data:`RECIPES`), whose numerics these casts and :func:`scaled_mm` reproduce exactly.

**Which scales the grid agrees on** (docs/fp8.md says why, and what it costs). Each rank scales
what it holds the way torchao scales what one data-parallel rank holds: its own rows (samples),
but the *whole* of every feature dimension and the whole weight. So the amax of an activation or
an output gradient is max all-reduced over the axis that splits its features (x or y: a scalar,
or one value per row; nothing over the batch axes data and z), and the amax of every FP8 layer's
weight -- of all layers at once, one vector -- over (x, y, z) once per weight update
(:class:`WeightScales`). Every FP8 operand is then bit for bit the one torchao's ``Float8Linear``
builds for the same samples, on every grid.

Which layers run FP8 in a run, and whether its device can, are in :mod:`axo4d.nn.fp8_plan`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from axo4d.dist.comm import Comm

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
EPS = 1e-12
"""amax is clamped below at this before the scale is taken (an all-zero tensor: scale fmax/EPS)."""
GEMM_MULTIPLE = 16
"""Every dimension of an FP8 GEMM must be a multiple of this (the GPU kernels' requirement)."""


@dataclass(frozen=True)
class Cast:
    """How one GEMM operand is cast: FP8 ``dtype``, one scale ``per`` 'tensor', 'row' or 'col'
    (column), scales rounded down to a power of two (``pow2``)."""

    dtype: torch.dtype
    per: str = "tensor"
    pow2: bool = False

    @property
    def fmax(self) -> float:
        return float(torch.finfo(self.dtype).max)


@dataclass(frozen=True)
class Recipe:
    """The six casts of a linear layer's three GEMMs: forward ``Y = X W^T`` (``x`` per row,
    ``w`` per row of W), ``dX = dY W`` (``dy``, ``w_dx`` per column of W), ``dW = dY^T X``
    (``dy_dw``, ``x_dw`` per column of each)."""

    name: str
    x: Cast
    w: Cast
    dy: Cast
    w_dx: Cast
    dy_dw: Cast
    x_dw: Cast

    @property
    def fp8_weight_in_backward(self) -> bool:
        """Whether the backward's weight cast is the forward's (the forward block serves it)."""
        return self.w_dx == self.w


_T4, _T5 = Cast(E4M3), Cast(E5M2)
_R, _C = Cast(E4M3, "row", True), Cast(E4M3, "col", True)
RECIPES: dict[str, Recipe] = {
    # torchao's "tensorwise": one scale per tensor, output gradients in e5m2 (range)
    "tensorwise": Recipe("tensorwise", _T4, _T4, _T5, _T4, _T5, _T4),
    # torchao's "rowwise": one scale per row of the left operand and per column of the right,
    # every operand e4m3 (the finer scales leave e4m3 enough range), power-of-two scales
    "rowwise": Recipe("rowwise", _R, _R, _R, _C, _C, _C),
}


@dataclass
class Fp8Tensor:
    """FP8 ``data`` and its fp32 ``scale`` (``data = sat(hp * scale)``): shape ``()`` (per
    tensor), ``(R, 1)`` (per row) or ``(1, C)`` (per column)."""

    data: torch.Tensor
    scale: torch.Tensor

    def t(self) -> Fp8Tensor:
        return Fp8Tensor(self.data.t(), self.scale.t() if self.scale.dim() == 2 else self.scale)

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size() + self.scale.numel() * 4


class Fp8Stats:
    """Counts of a run's scales, accumulated on the device (no sync) and read once a step:
    ``scales`` computed, ``nonfinite`` (an inf or NaN in the tensor: its FP8 copy is garbage) and
    ``saturated`` (amax below :data:`EPS`: the scale sits at its clamp, the tensor is zero or
    underflows FP8 -- the LM head's padded vocabulary rows under 'rowwise' always do)."""

    def __init__(self) -> None:
        self._n = 0  # scales computed (known on the host)
        self._acc: torch.Tensor | None = None  # (non-finite, saturated) on the device

    def count(self, amax: torch.Tensor) -> None:
        self._n += amax.numel()
        n = torch.stack([(~torch.isfinite(amax)).sum(), (amax < EPS).sum()])
        self._acc = n if self._acc is None else self._acc + n

    def take(self) -> dict[str, int]:
        """This rank's counts since the last ``take`` (one device sync), then zero."""
        bad, sat = (0, 0) if self._acc is None else (int(x) for x in self._acc.tolist())
        out = {"fp8_scales": self._n, "fp8_nonfinite_scales": bad, "fp8_saturated_scales": sat}
        self._n, self._acc = 0, None
        return out


# ---- casts ---------------------------------------------------------------------------------------
def amax_of(t: torch.Tensor, per: str) -> torch.Tensor:
    """Local ``max |t|`` of a 2-D tensor as a 1-D fp32 vector: one value, one per row, or one per column."""
    a = t.abs()
    if per == "tensor":
        return a.amax().float().reshape(1)
    return a.amax(1 if per == "row" else 0).float()


def scale_of(amax: torch.Tensor, c: Cast) -> torch.Tensor:
    """``fmax / max(amax, EPS)`` in fp64, kept in fp32 (rounded down to a power of two if ``c.pow2``)."""
    s = (c.fmax / amax.double().clamp(min=EPS)).float()
    return torch.exp2(torch.floor(torch.log2(s))) if c.pow2 else s


def shaped(scale: torch.Tensor, per: str) -> torch.Tensor:
    """A 1-D scale vector in the broadcasting shape of its granularity: ``()``, ``(R, 1)``, ``(1, C)``."""
    if per == "tensor":
        return scale.reshape(())
    return scale.reshape(-1, 1) if per == "row" else scale.reshape(1, -1)


def quantize(t: torch.Tensor, scale: torch.Tensor, c: Cast) -> torch.Tensor:
    """``sat(t * scale)`` in ``c.dtype`` (``scale`` broadcast against ``t``)."""
    return (t.float() * scale).clamp(-c.fmax, c.fmax).to(c.dtype)


def agree(amax: torch.Tensor, comm: Comm | None, groups: Sequence[tuple[str, ...]]) -> torch.Tensor:
    """The max of ``amax`` over each group in turn (in place; groups of one rank cost nothing)."""
    if comm is not None:
        for g in groups:
            comm.all_reduce(amax, g, op="max")
    return amax


def cast(
    t: torch.Tensor,
    c: Cast,
    comm: Comm | None = None,
    row_groups: Sequence[tuple[str, ...]] = (),
    col_groups: Sequence[tuple[str, ...]] = (),
    stats: Fp8Stats | None = None,
) -> Fp8Tensor:
    """``t`` (2-D) cast by ``c`` with the scale of the unsharded tensor: ``row_groups`` are the
    groups splitting ``t``'s rows, ``col_groups`` its columns; a per-tensor amax is agreed over
    both, a per-row one over the column groups, a per-column one over the row groups."""
    groups = {"tensor": (*row_groups, *col_groups), "row": col_groups, "col": row_groups}[c.per]
    am = agree(amax_of(t, c.per), comm, groups)
    if stats is not None:
        stats.count(am)
    s = shaped(scale_of(am, c), c.per)
    return Fp8Tensor(quantize(t, s, c), s)


# ---- the weight block: z pieces cast before the gather ---------------------------------------------
class WeightScales:
    """The scales of the FP8 layers' weights, those of each unsharded weight ``(N, K)``: when the
    weights changed, every rank puts the amax of its z piece of *every* FP8 layer into one vector
    (one value per layer, or per row and per column: rowwise) and a single max all-reduce over
    (x, y, z) makes them the weights' (:meth:`axo4d.facts.parts.LinearSpec.fp8_weight_amaxes`); the
    z pieces are then cast with scales every rank of a block agrees on, before the gather.

    "Changed" is an explicit counter, :attr:`updates`, never the tensors' versions (which writes
    through ``.data`` -- the sharded optimizer's gathers, offload, checkpoint loads -- leave as they
    are): the optimizer advances it after each update (:meth:`advance`, a step post-hook of
    :func:`axo4d.training.optim.build.make_optimizer`), a checkpoint load sets it (:meth:`restore`)."""

    def __init__(self) -> None:
        self.updates = 0
        """Weight updates so far (optimizer steps taken, or the step of a loaded checkpoint)."""
        self._kept: dict[int, tuple[int, dict[str, torch.Tensor]]] = {}  # index -> (updates, per -> amax)

    def advance(self) -> None:
        """The optimizer wrote new weights: every amax is recomputed at its next use."""
        self.updates += 1

    def restore(self, updates: int) -> None:
        """The weights were replaced (checkpoint of step ``updates``; 0: ``--init-from``): forget every amax."""
        self.updates = updates
        self._kept.clear()

    def amaxes(self, layer, comm: Comm, peers: Sequence, stats: Fp8Stats | None) -> dict[str, torch.Tensor]:
        """``layer``'s weight amaxes ({'tensor': (1,)} or {'row': (N,), 'col': (K,)}), computed
        for every FP8 layer of ``peers`` (the schedule's layers, in order) when ``layer``'s changed."""
        got = self._kept.get(layer.index)
        if got is not None and got[0] == self.updates:
            return got[1]
        fp8 = [p for p in peers if getattr(p, "fp8", None) is not None]
        parts = [_piece_amaxes(p, comm) for p in fp8]
        flat = torch.cat([v for d in parts for v in d.values()])
        agree(flat, comm, (("x", "y", "z"),))
        if stats is not None:
            stats.count(flat)
        off = 0
        for p, d in zip(fp8, parts):
            out = {}
            for k, v in d.items():
                out[k] = flat[off : off + v.numel()]
                off += v.numel()
            self._kept[p.index] = (self.updates, out)
        return self._kept[layer.index][1]


def _piece_layout(layer, comm: Comm) -> tuple[torch.Tensor, int, int, int]:
    """This rank's z piece of ``layer``'s block as whole block rows ``r0:r1`` (zeros outside the
    piece): ``(rows, r0, lo, n)`` with the piece at ``rows.reshape(-1)[lo : lo + n]``."""
    w = layer.weight.detach().reshape(-1)
    cols = layer.block_shape[1]
    n = w.numel()
    start = comm.coord("z") * n  # flat offset of this piece in the block
    r0, r1 = start // cols, (start + n - 1) // cols + 1
    lo = start - r0 * cols
    if lo == 0 and n == (r1 - r0) * cols:
        return w.view(r1 - r0, cols), r0, 0, n
    pad = w.new_zeros((r1 - r0) * cols)  # zeros leave every amax as it is
    pad[lo : lo + n] = w
    return pad.view(r1 - r0, cols), r0, lo, n


def _piece_amaxes(layer, comm: Comm) -> dict[str, torch.Tensor]:
    """The amaxes of this rank's piece in the whole weight's coordinates (zeros elsewhere)."""
    rows, r0, _, _ = _piece_layout(layer, comm)
    if layer.fp8.w.per == "tensor":
        return {"tensor": amax_of(rows, "tensor")}
    (bn, bk), (n, k) = layer.block_shape, (layer.out_features, layer.in_features)
    ro, ci = comm.coord(layer.out_axis) * bn, comm.coord(layer.in_axis) * bk
    row, col = rows.new_zeros(n, dtype=torch.float32), rows.new_zeros(k, dtype=torch.float32)
    row[ro + r0 : ro + r0 + rows.shape[0]] = amax_of(rows, "row")
    col[ci : ci + bk] = amax_of(rows, "col")
    return {"row": row, "col": col}


@dataclass(frozen=True)
class WeightCast:
    """The FP8 cast of a layer's weight block ``(N/G_out, K/G_in)`` whose flat z pieces are cast
    before the all-gather with the scale of the whole weight (:class:`WeightScales`). The schedule
    (:meth:`axo4d.nn.schedule.Schedule.weight`) gathers :meth:`piece` (1 byte an element) and turns
    the result into the FP8 block with :meth:`block`: no round trip through bf16."""

    cast: Cast
    scales: WeightScales = field(compare=False, hash=False)
    stats: Fp8Stats | None = field(default=None, compare=False, hash=False)

    def piece(self, layer, comm: Comm, peers: Sequence) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's z piece of ``layer``'s weight (the fp32 master) in FP8, as ``uint8`` for the
        gather, and the block's scale; ``peers``: every layer of the schedule (for :class:`WeightScales`)."""
        am = self.scales.amaxes(layer, comm, peers, self.stats)
        c, per = self.cast, self.cast.per
        (bn, bk), rows, r0, lo, n = layer.block_shape, *_piece_layout(layer, comm)
        if per == "tensor":
            s = shaped(scale_of(am["tensor"], c), "tensor")
            return quantize(layer.weight.detach().reshape(-1), s, c).view(torch.uint8), s
        off = comm.coord(layer.out_axis) * bn if per == "row" else comm.coord(layer.in_axis) * bk
        s = shaped(scale_of(am[per][off : off + (bn if per == "row" else bk)], c), per)
        q = quantize(rows, s[r0 : r0 + rows.shape[0]] if per == "row" else s, c).reshape(-1)[lo : lo + n]
        return q.view(torch.uint8), s

    def block(self, gathered: torch.Tensor, block_shape: tuple[int, int], scale: torch.Tensor) -> Fp8Tensor:
        """The gathered ``uint8`` pieces as the FP8 block and its scale."""
        return Fp8Tensor(gathered.view(self.cast.dtype).view(block_shape), scale)


# ---- the GEMM ---------------------------------------------------------------------------------------
def _row_major(t: torch.Tensor) -> bool:
    return t.stride(1) == 1 and t.stride(0) >= max(1, t.shape[1])


def check_gemm_shape(m: int, k: int, n: int, what: str = "FP8 GEMM") -> None:
    """Every dimension a multiple of :data:`GEMM_MULTIPLE` (ValueError naming them otherwise)."""
    bad = [f"{name}={v}" for name, v in (("M", m), ("K", k), ("N", n)) if v % GEMM_MULTIPLE]
    if bad:
        raise ValueError(
            f"{what} ({m}x{k} @ {k}x{n}): {', '.join(bad)} not a multiple of {GEMM_MULTIPLE}, "
            "which FP8 GEMMs need; change the shape or grid, or leave this layer in bf16"
        )


def scaled_mm(a: Fp8Tensor, b: Fp8Tensor, out_dtype: torch.dtype, fast_accum: bool) -> torch.Tensor:
    """``a (M, K) @ b (K, N)`` dequantised by the scales, in ``out_dtype``.

    As the GPU kernels take them: ``a`` row-major, ``b`` column-major (copied into those layouts
    when they are not: FP8 copies, 1 byte an element), every dimension a multiple of 16. Per-row
    ``a`` with per-column ``b`` ("rowwise") runs with a bf16 output, cast to ``out_dtype``; without
    fast accumulation (the dX and dW GEMMs) it runs as an unscaled GEMM whose bf16 output is
    scaled afterwards -- torchao's conventions, reproduced so that its ``Float8Linear`` is a
    bit-for-bit reference (with power-of-two scales the two orders round alike)."""
    (m, k), n = a.shape, b.shape[1]
    check_gemm_shape(m, k, n)
    ad = a.data if _row_major(a.data) else a.data.contiguous()
    bd = b.data if _row_major(b.data.t()) else b.data.t().contiguous().t()
    ia, ib = a.scale.reciprocal(), b.scale.reciprocal()
    if a.scale.dim() < 2:
        return torch._scaled_mm(ad, bd, scale_a=ia, scale_b=ib, out_dtype=out_dtype, use_fast_accum=fast_accum)
    if fast_accum:
        y = torch._scaled_mm(ad, bd, scale_a=ia, scale_b=ib, out_dtype=torch.bfloat16, use_fast_accum=True)
    else:
        one = ia.new_ones(())
        y = torch._scaled_mm(ad, bd, scale_a=one, scale_b=one, out_dtype=torch.bfloat16, use_fast_accum=False)
        y *= ia * ib
    return y if out_dtype == torch.bfloat16 else y.to(out_dtype)


__all__ = [
    "E4M3",
    "E5M2",
    "Cast",
    "Recipe",
    "RECIPES",
    "Fp8Tensor",
    "Fp8Stats",
    "WeightCast",
    "WeightScales",
    "cast",
    "agree",
    "amax_of",
    "scale_of",
    "quantize",
    "scaled_mm",
    "check_gemm_shape",
]
