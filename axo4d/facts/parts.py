"""The parts of a model, each a small frozen value: a 3D linear layer, a norm, attention, an
embedding (plain or tied to the LM head), the vocabulary-parallel loss.

A part has a few methods (the records of its traffic, :class:`~axo4d.facts.colls.Coll` and
:class:`~axo4d.facts.colls.Dtypes`, are in :mod:`axo4d.facts.colls`):

* ``placements()``: ``{param suffix: Placement}`` of its parameters;
* ``collectives(grid, rows, dt, recompute, per_block)``: every collective one micro-step issues
  (sizes follow :func:`perfmodel.collectives.counted_bytes`);
* ``gemm_flops(grid, rows)``: forward GEMM FLOPs on one rank;
* ``divisibility(grid)``: why it cannot be built on ``grid`` (empty when it can).

A new parallel layer adds one such record here and the module built from it; the schedule, the
checkpoints and the performance model need no edit. Whole models are assembled from parts in
:mod:`axo4d.facts.spec`. This module imports no torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from axo4d.facts.colls import ALL_GATHER, ALL_REDUCE, AMAX_BYTES, FP8_BYTES, REDUCE_SCATTER, Coll, Dtypes, chunked
from axo4d.facts.grid import Grid
from axo4d.facts.placement import Block3D, Placement, Split


def not_divisible(what: str, value: int, axis: str, g: int) -> str:
    return f"{what}={value} not divisible by G_{axis}={g}"


#: row chunks of a linear layer's forward whose output is all-reduced (:meth:`LinearSpec.fwd_chunks`)
FWD_CHUNKS = 4
#: fewest output elements of a forward chunk (1 MiB in fp32: above it, bytes cost more than latency
#: on the links axo4d runs on, 1 Gbit/s Ethernet to NVLink)
MIN_CHUNK_ELEMENTS = 2**18


# ---- parts ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class LinearSpec:
    """A 3D-parallel linear layer ``Y = X W^T``, ``W: (n, k)`` (docs/design.md section 2)."""

    name: str
    k: int
    n: int
    transposed: bool = False
    bias: bool = False
    n_logical: int = 0
    """Output rows holding real values (the LM head's unpadded vocabulary); 0 = all."""
    init_std: float = 0.02
    fp8: str = ""
    """The FP8 recipe of its GEMMs ('tensorwise', 'rowwise'; '' = the compute dtype): its weight
    block is gathered over z in FP8 and its casts agree their scales in small max all-reduces
    (:meth:`fp8_amaxes`, :meth:`fp8_weight_amaxes`; :mod:`axo4d.facts.fp8_rule` marks the layers,
    :mod:`axo4d.nn.fp8` casts)."""
    active: float = 1.0
    """Fraction of the tokens that pass through this layer on average (an expert of a
    mixture-of-experts layer: ``k/E``): its share in the FLOP formula's ``N_matmul``."""

    def axes(self) -> tuple[str, str]:
        """(axis splitting input features, axis splitting output features)."""
        return ("y", "x") if self.transposed else ("x", "y")

    def placements(self) -> dict[str, Placement]:
        a_in, a_out = self.axes()
        out: dict[str, Placement] = {
            "weight": Block3D((self.n, self.k), in_axis=a_in, out_axis=a_out, logical_rows=self.n_logical)
        }
        if self.bias:
            out["bias"] = Split((self.n,), axis=a_out)
        return out

    def weight_block(self, grid: Grid) -> float:
        """Elements of the gathered weight block ``N*K/(G_x*G_y)``."""
        return self.n * self.k / (grid.x * grid.y)

    def gemm_flops(self, grid: Grid, rows: float) -> float:
        """FLOPs of one local GEMM (forward, or dX, or dW)."""
        return 2.0 * rows * self.k * self.n / (grid.x * grid.y)

    def fwd_chunks(self, in_ranks: int, rows: float, width: float, out_ranks: int = 1, in_width: float = 0.0) -> int:
        """Row chunks of the forward GEMM (both schedules chunk alike: the same calls, the same sums;
        the overlapped one leaves each chunk's collectives in flight): each chunk's input features
        all-gathered over the output axis while an earlier chunk computes, each chunk's output
        reduce-scattered over the input axis while the next one computes. :data:`FWD_CHUNKS` when
        the input axis has ranks (``in_ranks`` > 1) and the output (``rows`` x ``width`` = N/G_out)
        allows chunks of at least :data:`MIN_CHUNK_ELEMENTS`; else, when only the output axis has
        ranks (``out_ranks`` > 1), the same rule on the gathered input (``rows`` x ``in_width`` =
        K/G_in); fewer where a chunk would be smaller (a smaller collective would cost its latency,
        not its bytes); one for an FP8 layer."""
        if self.fp8:
            return 1
        if in_ranks > 1:
            return int(max(1, min(FWD_CHUNKS, rows * width // MIN_CHUNK_ELEMENTS)))
        if out_ranks > 1:
            return int(max(1, min(FWD_CHUNKS, rows * in_width // MIN_CHUNK_ELEMENTS)))
        return 1

    def bwd_chunks(self, in_ranks: int, out_ranks: int, rows: float) -> int:
        """Row chunks of the backward's dX GEMM: :meth:`fwd_chunks`' rule with the axes' roles
        turned -- each chunk's dY features all-gathered over the input axis before its GEMM, its dX
        reduce-scattered over the output axis behind the next chunks and the dW GEMM (which takes the
        whole gathered dY)."""
        return self.fwd_chunks(out_ranks, rows, self.k / in_ranks, in_ranks, self.n / out_ranks)

    def collectives(
        self, grid: Grid, rows: float, dt: Dtypes, recompute: bool, per_block: bool, cached: bool = False
    ) -> list[Coll]:
        """``cached``: the gathered block is kept from forward (``parallel.cache_weights``), so
        backward and recompute gather nothing (an FP8 'rowwise' backward, whose block is cast per
        column, still gathers its own)."""
        a_in, a_out = self.axes()
        g, wblk = grid.sizes, self.weight_block(grid)
        cached = cached and grid.z > 1  # nothing is kept where nothing is gathered
        # section 15: X's feature blocks gathered over the output axis, Y's reduce-scattered over the
        # input axis; backward: dY gathered over the input axis, dX reduce-scattered over the output axis
        y_fwd = rows * self.n / g[a_out] * dt.act  # partial Y (N/out wide) reduce-scattered, in row chunks
        ch = self.fwd_chunks(g[a_in], rows, self.n / g[a_out], g[a_out], self.k / g[a_in])
        ch_ag, ch_rs = (ch if g[a_out] > 1 else 1), (ch if g[a_in] > 1 else 1)  # groups of one: one call
        chb = self.bwd_chunks(g[a_in], g[a_out], rows)
        chb_ag, chb_rs = (chb if g[a_in] > 1 else 1), (chb if g[a_out] > 1 else 1)
        x_blk = rows * self.k / g[a_in] * dt.act  # X (K/in wide): gathered in forward, dX reduce-scattered
        c = lambda phase, axes, kind, nbytes, pool: Coll(self.name, phase, axes, kind, nbytes, 1, pool, per_block)
        amax = self.fp8_amaxes(grid, rows)
        wbytes = wblk * (FP8_BYTES if self.fp8 else dt.weight)
        # the backward's block: the forward's when the cast is the same and it is kept (cached, or G_z = 1)
        bwd_block = not (cached or grid.z == 1) or self.fp8 == "rowwise" or not self.fp8
        fp8 = lambda phase, what: [c(phase, ax, ALL_REDUCE, nb, "blocking") for ax, nb in amax.get(what, [])]
        out = [
            chunked(c("fwd", (a_out,), ALL_GATHER, x_blk, "blocking"), ch_ag),
            *fp8("fwd", "x"),
            c("fwd", ("z",), ALL_GATHER, wbytes, "fwd"),
            chunked(c("fwd", (a_in,), REDUCE_SCATTER, y_fwd, "blocking"), ch_rs),
            chunked(c("bwd", (a_in,), ALL_GATHER, y_fwd, "blocking"), chb_ag),
            *fp8("bwd", "dy"),
            *([c("bwd", ("z",), ALL_GATHER, wbytes, "bwd")] if bwd_block else []),
            chunked(c("bwd", (a_out,), REDUCE_SCATTER, x_blk, "dx"), chb_rs, "dx"),
            c("bwd", ("z",), REDUCE_SCATTER, wblk * dt.grad, "bwd"),
        ]
        if recompute:
            out += [
                chunked(c("recompute", (a_out,), ALL_GATHER, x_blk, "blocking"), ch_ag),
                *fp8("recompute", "x"),
                *([] if cached else [c("recompute", ("z",), ALL_GATHER, wbytes, "bwd")]),
                chunked(c("recompute", (a_in,), REDUCE_SCATTER, y_fwd, "blocking"), ch_rs),
            ]
        if cached and not self.fp8:
            out = [x for x in out if not (x.kind == ALL_GATHER and x.phase != "fwd" and x.axes == ("z",))]
        return out

    def fp8_amaxes(self, grid: Grid, rows: float) -> dict[str, list[tuple[tuple[str, ...], float]]]:
        """The max all-reduces that agree an FP8 layer's activation scales over its feature axes
        (docs/fp8.md), ``(axes, bytes)`` per cast: 'x' (forward input, over the input axis), 'dy'
        (output gradient, over the output axis); a scalar, or one value per row ('rowwise'). The
        batch axes agree nothing (each rank scales its own samples); the weights' scales are one
        all-reduce a step for the whole model (:meth:`fp8_weight_amaxes`). Empty without FP8."""
        if not self.fp8:
            return {}
        a_in, a_out = self.axes()
        n = 1 if self.fp8 == "tensorwise" else rows
        return {"x": [((a_in,), n * AMAX_BYTES)], "dy": [((a_out,), n * AMAX_BYTES)]}

    def fp8_weight_amaxes(self) -> int:
        """Values this layer adds to the step's all-reduce of weight amaxes over (x, y, z)
        (:class:`axo4d.nn.fp8.WeightScales`): 1 ('tensorwise'), or one per row and column of the
        whole weight ('rowwise'); 0 without FP8."""
        return 0 if not self.fp8 else 1 if self.fp8 == "tensorwise" else self.n + self.k

    def divisibility(self, grid: Grid) -> list[str]:
        a_in, a_out = self.axes()
        g = grid.x * grid.y  # the activations on both sides are split over x and y (section 15)
        out = [
            f"{self.name}: {what} {v} not divisible by G_x*G_y={g} (activations split over x and y)"
            for what, v in (("input features", self.k), ("output features", self.n))
            if v % g
        ]
        if not out:
            blk = self.n * self.k // (grid.size(a_in) * grid.size(a_out))
            if blk % grid.z:
                out.append(
                    f"{self.name}: weight block of {blk} elements "
                    f"({self.n // grid.size(a_out)}, {self.k // grid.size(a_in)}) not divisible by G_z={grid.z}"
                )
        return out

    @property
    def matmul_params(self) -> float:
        """Weights times :attr:`active`: the parameters one token multiplies with."""
        n = (self.n_logical or self.n) * self.k
        return n if self.active == 1 else n * self.active


@dataclass(frozen=True)
class NormSpec:
    """LayerNorm (``rms=False``) or RMSNorm of the residual stream (features split over x and y,
    section 15): its statistics (sum and sum of squares; RMSNorm: sum of squares) are summed over
    (x, y); each rank applies its y block of its parameters (split over x), whose gradients' y blocks
    are all-gathered over y in backward."""

    name: str
    dim: int
    bias: bool = True
    rms: bool = False

    def placements(self) -> dict[str, Placement]:
        out: dict[str, Placement] = {"weight": Split((self.dim,), axis="x")}
        if self.bias:
            out["bias"] = Split((self.dim,), axis="x")
        return out

    def stats(self) -> int:
        return 1 if self.rms else 2

    def gemm_flops(self, grid: Grid, rows: float) -> float:
        return 0.0

    def collectives(self, grid: Grid, rows: float, dt: Dtypes, recompute: bool, per_block: bool) -> list[Coll]:
        nbytes = self.stats() * rows * dt.stat
        phases = ("fwd", "bwd") + (("recompute",) if recompute else ())
        out = [Coll(self.name, ph, ("x", "y"), ALL_REDUCE, nbytes, 1, "blocking", per_block) for ph in phases]
        params = 2 if self.bias and not self.rms else 1  # each parameter's gradient gathered over y
        gw = self.dim / grid.x * dt.param_state
        return out + [Coll(self.name, "bwd", ("y",), ALL_GATHER, gw, params, "blocking", per_block)]

    def divisibility(self, grid: Grid) -> list[str]:
        return []


@dataclass(frozen=True)
class AttentionSpec:
    """Attention, local to each rank's heads (heads over x and y, section 15; over y only in the
    fallback of :meth:`whole_heads`, with two all-gathers over x): no collective --
    unless z splits the sequence (``seq_split``, ``parallel.z_split``; :mod:`axo4d.nn.seqsplit`):
    then K and V are all-gathered over z in forward (and recompute), and their gradients
    reduce-scattered over z in backward, each call blocking."""

    name: str
    n_head: int
    n_kv_head: int
    head_dim: int
    seq_len: int
    seq_split: bool = False
    """z splits every sample's sequence (two chunks per z rank) instead of the batch."""

    def placements(self) -> dict[str, Placement]:
        return {}

    def gemm_flops(self, grid: Grid, rows: float) -> float:
        """Forward QK^T and AV on one rank (no causal saving): ``4*rows*s*h/G_y``; with the
        sequence split each local chunk ``c`` of ``L = s/(2 G_z)`` queries meets ``(c+1) L`` keys,
        ``(2 G_z + 1) s / (4 G_z)`` keys per query on average."""
        keys = self.seq_len * ((2 * grid.z + 1) / (4 * grid.z) if self.splits(grid) else 1.0)
        return 4.0 * rows * keys * self.n_head * self.head_dim / grid.size(*self.head_axes(grid))

    def splits(self, grid: Grid) -> bool:
        return self.seq_split and grid.z > 1

    def whole_heads(self, grid: Grid) -> bool:
        """Whether each rank of x*y attends with its own whole kv groups (``n_head`` and ``n_kv_head``
        divisible by G_x*G_y). Otherwise (e.g. 8 kv heads on x*y = 16) the fallback: QKV's output is
        all-gathered over x (its backward takes this rank's block), attention runs on the y slice's
        heads, the same on every x rank, and its output's x block goes on (backward: all-gathered)."""
        g = grid.x * grid.y
        return self.n_head % g == 0 and self.n_kv_head % g == 0

    def head_axes(self, grid: Grid) -> tuple[str, ...]:
        """The axes splitting the heads: (x, y), or (y,) in the fallback (:meth:`whole_heads`)."""
        return ("x", "y") if self.whole_heads(grid) else ("y",)

    def qkv_width(self) -> int:
        return (self.n_head + 2 * self.n_kv_head) * self.head_dim

    def kv_bytes(self, grid: Grid, rows: float, dt: Dtypes) -> float:
        """Bytes of one of K, V on one rank (its ``rows`` tokens, its ``H_kv/(G_x*G_y)`` heads, or
        ``H_kv/G_y`` in the fallback)."""
        return rows * self.n_kv_head / grid.size(*self.head_axes(grid)) * self.head_dim * dt.act

    def collectives(self, grid: Grid, rows: float, dt: Dtypes, recompute: bool, per_block: bool) -> list[Coll]:
        out = []
        if not self.whole_heads(grid):  # the fallback: QKV gathered over x, the output's gradient too
            qkv = rows * self.qkv_width() / grid.y * dt.act
            o = rows * self.n_head * self.head_dim / grid.y * dt.act
            for ph in ("fwd", "recompute") if recompute else ("fwd",):
                out.append(Coll(self.name + ".heads", ph, ("x",), ALL_GATHER, qkv, 1, "blocking", per_block))
            out.append(Coll(self.name + ".heads", "bwd", ("x",), ALL_GATHER, o, 1, "blocking", per_block))
        if not self.splits(grid):
            return out
        full = self.kv_bytes(grid, rows, dt) * grid.z  # the gathered K (or V), and its full gradient
        for ph in ("fwd", "recompute") if recompute else ("fwd",):
            out.append(Coll(self.name + ".kv", ph, ("z",), ALL_GATHER, full, 2, "blocking", per_block))
        out.append(Coll(self.name + ".kv", "bwd", ("z",), REDUCE_SCATTER, full, 2, "blocking", per_block))
        return out

    def divisibility(self, grid: Grid) -> list[str]:
        out = []
        if self.splits(grid) and self.seq_len % (2 * grid.z):
            out.append(
                f"seq_len={self.seq_len} not divisible by 2*G_z={2 * grid.z} (sequence split: two chunks per z rank)"
            )
        if self.n_head % grid.y:  # whole heads per y slice (and per x*y block unless :meth:`whole_heads` fails)
            out.append(not_divisible("n_head", self.n_head, "y", grid.y))
        if self.n_kv_head != self.n_head and self.n_kv_head % grid.y:
            out.append(not_divisible("n_kv_head", self.n_kv_head, "y", grid.y))
        return out


@dataclass(frozen=True)
class EmbeddingSpec:
    """A lookup table ``(rows, dim)``, features split over x (rows = vocabulary or positions). The
    model slices its y block of the looked-up rows (the residual stream is split over x and y,
    section 15); the backward all-gathers the gradient's y blocks (``slices``: the table whose
    lookup is sliced -- the GPT slices the sum of its two lookups once)."""

    name: str
    rows: int
    dim: int
    init_std: float = 0.02
    slices: bool = True
    """Whether the y slice (and its backward all-gather over y) is counted with this table."""

    def placements(self) -> dict[str, Placement]:
        return {"": Split((self.rows, self.dim), axis="x", weight_decay=True)}

    def gemm_flops(self, grid: Grid, rows: float) -> float:
        return 0.0

    def collectives(self, grid: Grid, rows: float, dt: Dtypes, recompute: bool, per_block: bool) -> list[Coll]:
        if not self.slices:
            return []
        return [Coll(self.name, "bwd", ("y",), ALL_GATHER, rows * self.dim / grid.x * dt.act, 1, "blocking", per_block)]

    def divisibility(self, grid: Grid) -> list[str]:
        return []


@dataclass(frozen=True)
class TiedEmbeddingSpec:
    """Token embedding read from the LM head's weight (tied): the head's block gathered over z
    (in the parameter dtype), rows looked up on each rank's vocabulary slice (the head's output
    axis: y as built, x where the head is turned), reduce-scattered over that axis along the
    features; backward: the output gradient all-gathered over it, the block gradient
    reduce-scattered over z. Its parameters are the head's."""

    name: str
    head: LinearSpec

    def placements(self) -> dict[str, Placement]:
        return {}

    def gemm_flops(self, grid: Grid, rows: float) -> float:
        return 0.0

    def collectives(self, grid: Grid, rows: float, dt: Dtypes, recompute: bool, per_block: bool) -> list[Coll]:
        wblk = self.head.weight_block(grid)
        a_in, a_out = self.head.axes()
        c = lambda phase, axes, kind, nbytes, pool: Coll(self.name, phase, axes, kind, nbytes, 1, pool, per_block)
        looked_up = rows * self.head.k / grid.size(a_in)  # (rows, C/in), partial over the vocabulary axis
        return [
            c("fwd", ("z",), ALL_GATHER, wblk * dt.param_state, "fwd"),
            c("fwd", (a_out,), REDUCE_SCATTER, looked_up * dt.param_state, "blocking"),
            c("bwd", (a_out,), ALL_GATHER, looked_up * dt.act, "blocking"),
            c("bwd", ("z",), REDUCE_SCATTER, wblk * dt.grad, "bwd"),
        ]

    def divisibility(self, grid: Grid) -> list[str]:
        return []


@dataclass(frozen=True)
class CrossEntropySpec:
    """Vocabulary-parallel cross-entropy: the max, then sum-exp and target logit, over (x, y)
    (the LM head leaves each rank ``V/(x*y)`` of the vocabulary, section 15)."""

    name: str = "cross_entropy"

    def placements(self) -> dict[str, Placement]:
        return {}

    def gemm_flops(self, grid: Grid, rows: float) -> float:
        return 0.0

    def collectives(self, grid: Grid, rows: float, dt: Dtypes, recompute: bool, per_block: bool) -> list[Coll]:
        return [
            Coll(self.name, "fwd", ("x", "y"), ALL_REDUCE, rows * dt.stat, 1, "blocking", per_block),
            Coll(self.name, "fwd", ("x", "y"), ALL_REDUCE, 2 * rows * dt.stat, 1, "blocking", per_block),
        ]

    def divisibility(self, grid: Grid) -> list[str]:
        return []


Part = "LinearSpec | NormSpec | AttentionSpec | EmbeddingSpec | CrossEntropySpec"


def layer_pairs(block: tuple) -> list[tuple[LinearSpec, LinearSpec]]:
    """The block's linear layers two by two in call order (first: widens, second: narrows back)."""
    lins = [p for p in block if isinstance(p, LinearSpec)]
    if len(lins) % 2:
        raise ValueError(f"a block's linear layers come in pairs; got {len(lins)}: {[x.name for x in lins]}")
    return list(zip(lins[0::2], lins[1::2]))
