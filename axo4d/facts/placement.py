"""How a parameter lies on the grid: one typed value per parameter, with the operations each
layout needs.

Every axo4d parameter carries a :class:`Placement` (``param.placement``, see :func:`place`).
Initialisation, checkpoints, gradient reduction, the global norm, Hugging Face import/export and
the performance model all ask it, and nothing else interprets a layout:

==================  ===========================================================================
``local_shape``     the shape of a rank's piece (``local_numel``: its element count)
``shard``           a rank's piece of the full tensor (pure slicing, no communication)
``assemble``        the full tensor from every rank's piece
``chunks``          the rectangles of the full tensor a rank's piece holds (checkpoints, lazy
                    reads of safetensors files): each a contiguous run of the flat piece
``grad_sum``        axes over which the gradient is still summed after backward
``split``           axes over which the elements are partitioned (the global norm sums squares
                    over these only, so replicas count once)
==================  ===========================================================================

Kinds: :class:`Replicated`, :class:`Split` (one dimension over one axis), :class:`Block3D`
(Agarwal's weight block ``W[out-slice, in-slice]``, flattened and split again over z) and
:class:`ExpertBlock3D` (a Block3D held by one position of every expert group).
``logical_rows`` marks trailing rows of dimension 0 as padding (the LM head's padded
vocabulary): they are zero, and neither saved nor loaded.

This module imports no torch at load time (the performance model uses it on machines without).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Sequence

from axo4d.config.errors import GridError
from axo4d.facts.grid import Grid

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class Chunk:
    """A rectangle of the full tensor held contiguously in a rank's flat piece."""

    offsets: tuple[int, ...]
    """Position of the rectangle in the full tensor."""
    sizes: tuple[int, ...]
    """Its extent per dimension."""
    start: int
    """Where its row-major elements begin in the rank's flattened piece."""

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)


@dataclass(frozen=True)
class Placement:
    """Base of the placement kinds (not used directly)."""

    full_shape: tuple[int, ...]
    """Shape of the unsharded tensor (padding rows included)."""
    grad_sum: tuple[str, ...] = ("z", "data")
    """Axes over which the gradient is summed after backward (the data-parallel reduction)."""
    weight_decay: bool = False
    """Whether AdamW decays this parameter (matrices yes; norms, biases no)."""
    logical_rows: int = 0
    """Rows of dimension 0 holding real values (0 = all); the rest is padding."""

    # ---- what every kind defines ------------------------------------------------------------
    @property
    def split(self) -> tuple[str, ...]:
        """Axes whose ranks hold disjoint pieces."""
        raise NotImplementedError

    def local_shape(self, grid: Grid) -> tuple[int, ...]:
        raise NotImplementedError

    def shard(self, full: torch.Tensor, grid: Grid, rank: int) -> torch.Tensor:
        """``rank``'s piece (a new contiguous tensor) of the full tensor."""
        raise NotImplementedError

    def assemble(self, pieces: Sequence[torch.Tensor], grid: Grid) -> torch.Tensor:
        """The full tensor from ``pieces[r]``, the piece of every rank ``r`` of ``grid``."""
        raise NotImplementedError

    def _chunks(self, grid: Grid, rank: int) -> list[Chunk]:
        raise NotImplementedError

    # ---- shared -------------------------------------------------------------------------------
    def local_numel(self, grid: Grid) -> int:
        return math.prod(self.local_shape(grid))

    @property
    def logical_shape(self) -> tuple[int, ...]:
        """The full shape without padding rows (what checkpoints and exports hold)."""
        if not self.logical_rows:
            return tuple(self.full_shape)
        return (self.logical_rows, *self.full_shape[1:])

    def chunks(self, grid: Grid, rank: int) -> list[Chunk]:
        """Rectangles of the *logical* tensor that ``rank``'s piece holds (padding rows dropped)."""
        out = self._chunks(grid, rank)
        if not self.logical_rows or self.logical_rows == self.full_shape[0]:
            return out
        clipped = []
        for ch in out:  # trailing rows of a chunk are its last elements
            r0 = ch.offsets[0]
            if r0 < self.logical_rows:
                n = min(ch.sizes[0], self.logical_rows - r0)
                clipped.append(replace(ch, sizes=(n, *ch.sizes[1:])))
        return clipped

    def with_(self, **kw: Any) -> Placement:
        return replace(self, **kw)


@dataclass(frozen=True)
class Replicated(Placement):
    """Every rank holds the whole tensor."""

    @property
    def split(self) -> tuple[str, ...]:
        return ()

    def local_shape(self, grid: Grid) -> tuple[int, ...]:
        return tuple(self.full_shape)

    def shard(self, full: torch.Tensor, grid: Grid, rank: int) -> torch.Tensor:
        return full.clone()

    def assemble(self, pieces: Sequence[torch.Tensor], grid: Grid) -> torch.Tensor:
        return pieces[0].clone()

    def _chunks(self, grid: Grid, rank: int) -> list[Chunk]:
        return [Chunk((0,) * len(self.full_shape), tuple(self.full_shape), 0)]


@dataclass(frozen=True)
class Split(Placement):
    """Dimension ``dim`` split into equal blocks over ``axis`` (replicated over the other axes)."""

    axis: str = "x"
    """The grid axis that splits the tensor."""
    dim: int = -1
    """The tensor dimension it splits."""

    @property
    def split(self) -> tuple[str, ...]:
        return (self.axis,)

    def _d(self) -> int:
        return self.dim % len(self.full_shape)

    def local_shape(self, grid: Grid) -> tuple[int, ...]:
        d, g = self._d(), grid.size(self.axis)
        if self.full_shape[d] % g:
            raise GridError(f"dimension {d} of size {self.full_shape[d]} not divisible by G_{self.axis}={g}")
        return tuple(n // g if i == d else n for i, n in enumerate(self.full_shape))

    def shard(self, full: torch.Tensor, grid: Grid, rank: int) -> torch.Tensor:
        return full.chunk(grid.size(self.axis), self._d())[grid.coords(rank)[self.axis]].clone()

    def assemble(self, pieces: Sequence[torch.Tensor], grid: Grid) -> torch.Tensor:
        import torch

        by_coord = {grid.coords(r)[self.axis]: pieces[r] for r in range(grid.world_size)}
        return torch.cat([by_coord[i] for i in range(grid.size(self.axis))], self._d())

    def _chunks(self, grid: Grid, rank: int) -> list[Chunk]:
        d, local = self._d(), self.local_shape(grid)
        off = tuple(grid.coords(rank)[self.axis] * local[d] if i == d else 0 for i in range(len(local)))
        return [Chunk(off, local, 0)]


@dataclass(frozen=True)
class Block3D(Placement):
    """A linear layer's weight ``(N, K)`` by Agarwal's algorithm: the block
    ``W[out-slice over out_axis, in-slice over in_axis]`` flattened and split into ``G_z`` equal
    runs, one per z-rank. The gradient's batch sum over z comes from the layer's reduce-scatter,
    so only ``data`` remains to be summed."""

    grad_sum: tuple[str, ...] = ("data",)
    weight_decay: bool = True
    in_axis: str = "x"
    """Axis splitting the input features (K): x, or y for a transposed layer."""
    out_axis: str = "y"
    """Axis splitting the output features (N): y, or x for a transposed layer."""

    @property
    def split(self) -> tuple[str, ...]:
        return ("x", "y", "z")

    def block_shape(self, grid: Grid) -> tuple[int, int]:
        """``(N/G_out, K/G_in)``: the gathered block a rank multiplies with."""
        n, k = self.full_shape
        return n // grid.size(self.out_axis), k // grid.size(self.in_axis)

    def local_shape(self, grid: Grid) -> tuple[int, ...]:
        bn, bk = self.block_shape(grid)
        return (bn * bk // grid.z,)

    def shard(self, full: torch.Tensor, grid: Grid, rank: int) -> torch.Tensor:
        c = grid.coords(rank)
        blk = full.chunk(grid.size(self.out_axis), 0)[c[self.out_axis]]
        blk = blk.chunk(grid.size(self.in_axis), 1)[c[self.in_axis]]
        return blk.reshape(-1).chunk(grid.z)[c["z"]].clone()

    def assemble(self, pieces: Sequence[torch.Tensor], grid: Grid) -> torch.Tensor:
        import torch

        n, k = self.full_shape
        bn, bk = self.block_shape(grid)
        out = torch.empty(n, k, dtype=pieces[0].dtype, device=pieces[0].device)
        for i in range(grid.size(self.out_axis)):
            for j in range(grid.size(self.in_axis)):
                flat = torch.cat(
                    [
                        pieces[grid.rank(**{self.out_axis: i, self.in_axis: j, "z": z})].reshape(-1)
                        for z in range(grid.z)
                    ]
                )
                out[i * bn : (i + 1) * bn, j * bk : (j + 1) * bk] = flat.view(bn, bk)
        return out

    def _chunks(self, grid: Grid, rank: int) -> list[Chunk]:
        """The z piece is a run of the block's row-major elements: at most a partial first row,
        a run of whole rows and a partial last row."""
        c = grid.coords(rank)
        bn, bk = self.block_shape(grid)
        r_base, c_base = c[self.out_axis] * bn, c[self.in_axis] * bk
        piece = bn * bk // grid.z
        a = c["z"] * piece
        b, pos, out = a + piece, a, []
        while pos < b:
            r, col = divmod(pos, bk)
            if col == 0 and b - pos >= bk:  # a run of whole block rows
                nr = (b - pos) // bk
                out.append(Chunk((r_base + r, c_base), (nr, bk), pos - a))
                pos += nr * bk
            else:  # a partial row
                w = min(bk - col, b - pos)
                out.append(Chunk((r_base + r, c_base + col), (1, w), pos - a))
                pos += w
        return out


@dataclass(frozen=True)
class ExpertBlock3D(Block3D):
    """An expert's :class:`Block3D` weight under expert parallelism (``G_ep = grid.expert``): held
    only by the ranks at position ``expert // (n_experts / G_ep)`` of their expert group (the
    ``ep`` sub-axis of data, :mod:`axo4d.facts.grid`), a copy on each of the ``edp`` ranks, whose
    gradients are summed over exactly those (``grad_sum = ('edp',)``); its elements are split over
    x, y, z and ``ep`` (the global norm counts each once). Other ranks hold no piece (no chunk)."""

    grad_sum: tuple[str, ...] = ("edp",)
    expert: int = 0
    """The expert's index in its layer."""
    n_experts: int = 1
    """Experts in its layer."""

    @property
    def split(self) -> tuple[str, ...]:
        return ("x", "y", "z", "ep")

    def owner(self, grid: Grid) -> int:
        """The position in an expert group (``ep`` index) of the ranks holding this expert."""
        return self.expert // (self.n_experts // grid.expert)

    def holds(self, grid: Grid, rank: int) -> bool:
        return grid.group_index(rank, ("ep",)) == self.owner(grid)

    def assemble(self, pieces: Sequence[torch.Tensor], grid: Grid) -> torch.Tensor:
        """As :meth:`Block3D.assemble`, from the holders of the first expert group (``pieces`` of
        the other ranks are not read)."""
        d = self.owner(grid)
        sub = {r: pieces[grid.rank(**{**grid.coords(r), "data": d})] for r in range(grid.world_size)}
        return super().assemble([sub[r] for r in range(grid.world_size)], grid)

    def _chunks(self, grid: Grid, rank: int) -> list[Chunk]:
        return super()._chunks(grid, rank) if self.holds(grid, rank) else []


# ---- parameters carry their placement ------------------------------------------------------------
def place(p: torch.nn.Parameter, placement: Placement, init: Init | None = None) -> torch.nn.Parameter:
    """Attach ``placement`` (and how to initialise the full tensor) to parameter ``p``."""
    p.placement = placement  # type: ignore[attr-defined]
    p.init = init  # type: ignore[attr-defined]
    return p


def placement_of(p: torch.Tensor) -> Placement:
    pl = getattr(p, "placement", None)
    if pl is None:
        raise AttributeError(
            f"parameter of shape {tuple(p.shape)} has no placement; "
            "every axo4d parameter must declare one (axo4d.facts.placement.place)"
        )
    return pl


@dataclass(frozen=True)
class Init:
    """How the full (logical) tensor of a parameter is initialised: ``Normal(std)`` draws from its
    own seed (so initial weights do not depend on the grid), ``constant`` fills."""

    std: float = 0.0
    """Standard deviation of a normal draw (used when ``constant`` is None)."""
    constant: float | None = None
    """Fill value instead of a draw."""


def normal(std: float) -> Init:
    return Init(std=std)


def constant(value: float) -> Init:
    return Init(constant=value)


def chunk_view(local: torch.Tensor, ch: Chunk) -> torch.Tensor:
    """The part of ``local`` (a contiguous piece) that holds chunk ``ch``, shaped like it."""
    return local.view(-1)[ch.start : ch.start + ch.numel].view(ch.sizes)


__all__ = [
    "Chunk",
    "Placement",
    "Replicated",
    "Split",
    "Block3D",
    "ExpertBlock3D",
    "place",
    "placement_of",
    "Init",
    "normal",
    "constant",
    "chunk_view",
]
