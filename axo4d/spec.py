"""Model facts, defined once: the shapes and placements of every part of a model on a grid, the
collectives each part issues, FLOPs, parameter counts and divisibility rules.

The models (:mod:`axo4d.models`) build their layers from these records, and the performance
model (:mod:`perfmodel`) prices the same records, so the two cannot drift apart. A part is a
small frozen value with a few methods:

* ``placements()``: ``{param suffix: Placement}`` of its parameters;
* ``collectives(grid, rows, dt, recompute, per_block)``: every collective one micro-step issues
  (sizes follow :func:`perfmodel.collectives.counted_bytes`);
* ``gemm_flops(grid, rows)``: forward GEMM FLOPs on one rank;
* ``divisibility(grid)``: why it cannot be built on ``grid`` (empty when it can).

A new parallel layer adds one such record and the module built from it; the schedule, the
checkpoints and the performance model need no edit. This module imports no torch.

FLOPs (docs/design.md section 5, one formula for every architecture)::

    model FLOPs / step    = 6 * N_matmul * tokens + 12 * l * h * s * tokens
    with recomputation    = 8 * N_blocks * tokens + 6 * N_head * tokens + 16 * l * h * s * tokens

``N_matmul``: weights of every linear layer (LM head with the unpadded vocabulary); ``N_blocks``
the blocks' share, ``N_head`` the head's; ``h`` = heads x head size. For the GPT (MLP 4h) this is
exactly ``72*B*s*l*h^2*(1 + s/(6h) + V/(12*l*h))`` (96 and ``V/(16*l*h)`` with recomputation).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from axo4d.dist.grid import Grid
from axo4d.dist.placement import Block3D, Placement, Split

if TYPE_CHECKING:
    from axo4d.config import ModelConfig

ALL_GATHER, REDUCE_SCATTER, ALL_REDUCE = "all_gather", "reduce_scatter", "all_reduce"

FLOPS_FORMULA = "6*N_matmul*tokens + 12*l*h*s*tokens"
FLOPS_FORMULA_RECOMPUTE = "8*N_blocks*tokens + 6*N_head*tokens + 16*l*h*s*tokens"


@dataclass(frozen=True)
class Dtypes:
    """Bytes per element of what moves and what is stored.

    Defaults: bf16 activations and gathered weights; gradients reduced in fp32; norm and
    cross-entropy statistics in fp32; training state of 16 bytes per parameter (fp32 parameters
    as autocast keeps them, fp32 gradients, two fp32 Adam moments).
    """

    act: int = 2
    weight: int = 2
    grad: int = 4
    stat: int = 4
    param_state: int = 4
    grad_state: int = 4
    optim_state: int = 8
    scalar: int = 8

    @classmethod
    def for_compute(cls, dtype: str) -> "Dtypes":
        """Element sizes for ``train.dtype`` 'bf16' (autocast) or 'fp32' (activations and gathered
        weights move in fp32)."""
        if dtype == "bf16":
            return cls()
        if dtype == "fp32":
            return cls(act=4, weight=4)
        raise ValueError(f"unknown compute dtype {dtype!r}; valid: bf16, fp32")


@dataclass(frozen=True)
class Coll:
    """One collective of a step: per-call size, calls per micro-step (per block when
    ``per_block``), and what it can overlap with (``pool``): 'blocking' (nothing), 'fwd'
    (forward compute), 'bwd' (backward compute), 'dx' (the dW GEMM of ``layer``)."""

    layer: str
    phase: str
    axes: tuple[str, ...]
    kind: str
    nbytes: float
    calls: int
    pool: str
    per_block: bool = True


def _not_div(what: str, value: int, axis: str, g: int) -> str:
    return f"{what}={value} not divisible by G_{axis}={g}"


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

    def axes(self) -> tuple[str, str]:
        """(axis splitting input features, axis splitting output features)."""
        return ("y", "x") if self.transposed else ("x", "y")

    def placements(self) -> dict[str, Placement]:
        a_in, a_out = self.axes()
        out: dict[str, Placement] = {"weight": Block3D((self.n, self.k), in_axis=a_in, out_axis=a_out,
                                                       logical_rows=self.n_logical)}
        if self.bias:
            out["bias"] = Split((self.n,), axis=a_out)
        return out

    def weight_block(self, grid: Grid) -> float:
        """Elements of the gathered weight block ``N*K/(G_x*G_y)``."""
        return self.n * self.k / (grid.x * grid.y)

    def gemm_flops(self, grid: Grid, rows: float) -> float:
        """FLOPs of one local GEMM (forward, or dX, or dW)."""
        return 2.0 * rows * self.k * self.n / (grid.x * grid.y)

    def collectives(self, grid: Grid, rows: float, dt: Dtypes, recompute: bool, per_block: bool) -> list[Coll]:
        a_in, a_out = self.axes()
        g, wblk = grid.sizes, self.weight_block(grid)
        y_fwd = rows * self.n / g[a_out] * dt.act          # partial Y summed over the input axis
        dx_bwd = rows * self.k / g[a_in] * dt.act          # partial dX summed over the output axis
        c = lambda phase, axes, kind, nbytes, pool: Coll(self.name, phase, axes, kind, nbytes, 1, pool, per_block)
        out = [c("fwd", ("z",), ALL_GATHER, wblk * dt.weight, "fwd"),
               c("fwd", (a_in,), ALL_REDUCE, y_fwd, "blocking"),
               c("bwd", ("z",), ALL_GATHER, wblk * dt.weight, "bwd"),
               c("bwd", (a_out,), ALL_REDUCE, dx_bwd, "dx"),
               c("bwd", ("z",), REDUCE_SCATTER, wblk * dt.grad, "bwd")]
        if recompute:
            out += [c("recompute", ("z",), ALL_GATHER, wblk * dt.weight, "bwd"),
                    c("recompute", (a_in,), ALL_REDUCE, y_fwd, "blocking")]
        return out

    def divisibility(self, grid: Grid) -> list[str]:
        a_in, a_out = self.axes()
        out = [f"{self.name}: {what} {v} not divisible by G_{ax}={grid.size(ax)}"
               for what, v, ax in (("input features", self.k, a_in), ("output features", self.n, a_out))
               if v % grid.size(ax)]
        if not out:
            blk = self.n * self.k // (grid.size(a_in) * grid.size(a_out))
            if blk % grid.z:
                out.append(f"{self.name}: weight block of {blk} elements "
                           f"({self.n // grid.size(a_out)}, {self.k // grid.size(a_in)}) not divisible by G_z={grid.z}")
        return out

    @property
    def matmul_params(self) -> int:
        return (self.n_logical or self.n) * self.k


@dataclass(frozen=True)
class NormSpec:
    """LayerNorm (``rms=False``) or RMSNorm of the residual stream (features split over x): its
    statistics (sum and sum of squares; RMSNorm: sum of squares) are summed over x."""

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
        return [Coll(self.name, ph, ("x",), ALL_REDUCE, nbytes, 1, "blocking", per_block) for ph in phases]

    def divisibility(self, grid: Grid) -> list[str]:
        return []


@dataclass(frozen=True)
class AttentionSpec:
    """Attention, local to each rank's heads (heads over y, replicated over x): no collective."""

    name: str
    n_head: int
    n_kv_head: int
    head_dim: int
    seq_len: int

    def placements(self) -> dict[str, Placement]:
        return {}

    def gemm_flops(self, grid: Grid, rows: float) -> float:
        """Forward QK^T and AV on one rank (no causal saving): ``4*rows*s*h/G_y``."""
        return 4.0 * rows * self.seq_len * self.n_head * self.head_dim / grid.y

    def collectives(self, grid: Grid, rows: float, dt: Dtypes, recompute: bool, per_block: bool) -> list[Coll]:
        return []

    def divisibility(self, grid: Grid) -> list[str]:
        out = []
        if self.n_head % grid.y:
            out.append(_not_div("n_head", self.n_head, "y", grid.y))
        if self.n_kv_head != self.n_head and self.n_kv_head % grid.y:
            out.append(_not_div("n_kv_head", self.n_kv_head, "y", grid.y))
        return out


@dataclass(frozen=True)
class EmbeddingSpec:
    """A lookup table ``(rows, dim)``, features split over x (rows = vocabulary or positions)."""

    name: str
    rows: int
    dim: int
    init_std: float = 0.02

    def placements(self) -> dict[str, Placement]:
        return {"": Split((self.rows, self.dim), axis="x", weight_decay=True)}

    def gemm_flops(self, grid: Grid, rows: float) -> float:
        return 0.0

    def collectives(self, grid: Grid, rows: float, dt: Dtypes, recompute: bool, per_block: bool) -> list[Coll]:
        return []

    def divisibility(self, grid: Grid) -> list[str]:
        return []


@dataclass(frozen=True)
class CrossEntropySpec:
    """Vocabulary-parallel cross-entropy: the max, then sum-exp and target logit, over y."""

    name: str = "cross_entropy"

    def placements(self) -> dict[str, Placement]:
        return {}

    def gemm_flops(self, grid: Grid, rows: float) -> float:
        return 0.0

    def collectives(self, grid: Grid, rows: float, dt: Dtypes, recompute: bool, per_block: bool) -> list[Coll]:
        return [Coll(self.name, "fwd", ("y",), ALL_REDUCE, rows * dt.stat, 1, "blocking", per_block),
                Coll(self.name, "fwd", ("y",), ALL_REDUCE, 2 * rows * dt.stat, 1, "blocking", per_block)]

    def divisibility(self, grid: Grid) -> list[str]:
        return []


Part = "LinearSpec | NormSpec | AttentionSpec | EmbeddingSpec | CrossEntropySpec"


# ---- a whole model on a grid ---------------------------------------------------------------------
def padded_vocab(vocab_size: int, vocab_multiple: int, g_y: int) -> int:
    """Vocabulary rounded up to a multiple of ``vocab_multiple * G_y`` (the LM head's rows)."""
    m = vocab_multiple * g_y
    return -(-vocab_size // m) * m


@dataclass(frozen=True)
class ModelSpec:
    """Every part of a model on one grid: ``embeddings``, one ``block`` (repeated ``n_layer``
    times, parts in call order) and the ``head`` (final norm, LM head, loss)."""

    arch: str
    n_layer: int
    hidden: int
    seq_len: int
    vocab_size: int
    vocab: int
    """Padded vocabulary (rows of the LM head)."""
    grid: Grid
    embeddings: tuple
    block: tuple
    head: tuple
    checks: tuple[str, ...] = ()
    """Reasons from the model's own shape (grid-independent or model-wide)."""

    def part(self, name: str):
        """The part called ``name`` (in the embeddings, the block or the head)."""
        for p in self.embeddings + self.block + self.head:
            if p.name == name:
                return p
        raise KeyError(f"no part {name!r} in {self.arch}; parts: "
                       f"{', '.join(p.name for p in self.embeddings + self.block + self.head)}")

    def linears(self) -> tuple[LinearSpec, ...]:
        """The block's linear layers, in call order."""
        return tuple(p for p in self.block if isinstance(p, LinearSpec))

    def head_linear(self) -> LinearSpec:
        return next(p for p in self.head if isinstance(p, LinearSpec))

    def attention(self) -> AttentionSpec:
        return next(p for p in self.block if isinstance(p, AttentionSpec))

    # ---- parameters ----------------------------------------------------------------------------
    def placements(self) -> list[tuple[str, Placement, bool]]:
        """``(part name, placement, per_block)`` of every parameter (block ones once)."""
        out = []
        for parts, per_block in ((self.embeddings, False), (self.block, True), (self.head, False)):
            for p in parts:
                for pl in p.placements().values():
                    out.append((p.name, pl, per_block))
        return out

    def param_count(self) -> int:
        """Parameters of the full model (vocabulary padding not counted)."""
        total = 0
        for _, pl, per_block in self.placements():
            n = math.prod(pl.logical_shape)
            total += n * (self.n_layer if per_block else 1)
        return total

    def local_params(self) -> dict[str, float]:
        """Elements one rank holds: ``linear`` (z-sharded weight pieces) and ``other`` (norms,
        biases, embeddings: replicated over data and z). Fractional on grids that do not divide."""
        out = {"linear": 0.0, "other": 0.0}
        for _, pl, per_block in self.placements():
            n = math.prod(pl.full_shape) / self.grid.size(*pl.split) if pl.split else math.prod(pl.full_shape)
            out["linear" if isinstance(pl, Block3D) else "other"] += n * (self.n_layer if per_block else 1)
        return out

    def split_axes(self) -> tuple[tuple[str, ...], ...]:
        """Distinct ``split`` axes of the parameters, sorted (one norm partial sum each)."""
        return tuple(sorted({pl.split for _, pl, _ in self.placements() if pl.split}))

    def matmul_params(self) -> tuple[int, int]:
        """(weights of the blocks' linear layers, of the LM head) -- the FLOP formula's N."""
        return self.n_layer * sum(x.matmul_params for x in self.linears()), self.head_linear().matmul_params

    # ---- FLOPs -------------------------------------------------------------------------------------
    def flops_per_step(self, global_batch: int, recompute: bool = False) -> float:
        """Training FLOPs of one step (module docstring)."""
        tokens = global_batch * self.seq_len
        n_blocks, n_head = self.matmul_params()
        a = self.attention()
        attn = self.n_layer * a.n_head * a.head_dim * self.seq_len * tokens
        if recompute:
            return 8 * n_blocks * tokens + 6 * n_head * tokens + 16 * attn
        return 6 * (n_blocks + n_head) * tokens + 12 * attn

    @staticmethod
    def flops_formula(recompute: bool = False) -> str:
        return FLOPS_FORMULA_RECOMPUTE if recompute else FLOPS_FORMULA

    # ---- communication -------------------------------------------------------------------------
    def collectives(self, rows: float, dt: Dtypes, recompute: bool) -> list[Coll]:
        """Every tensor-parallel collective of one micro-step (block records once, per_block)."""
        out: list[Coll] = []
        for p in self.block:
            out += p.collectives(self.grid, rows, dt, recompute, True)
        for p in self.embeddings + self.head:
            out += p.collectives(self.grid, rows, dt, False, False)
        return out

    # ---- divisibility ----------------------------------------------------------------------------
    def divisibility_reasons(self, micro_batch: int | None = None) -> list[str]:
        """Why this model cannot be built on its grid with this micro-batch ([] when it can)."""
        g = self.grid
        out = list(self.checks)
        for ax in ("x", "y"):
            if self.hidden % g.size(ax):
                out.append(_not_div("n_embd", self.hidden, ax, g.size(ax)))
        for p in self.embeddings + self.block + self.head:
            out += [r for r in p.divisibility(g) if r not in out]
        if micro_batch is not None and micro_batch % g.size("data", "z"):
            out.append(f"micro-batch of {micro_batch} samples not divisible by G_data*G_z={g.size('data', 'z')}")
        return out


def model_spec(cfg: "ModelConfig", grid: Grid) -> ModelSpec:
    """The parts of ``cfg``'s model on ``grid`` (by ``cfg.arch``)."""
    arch = getattr(cfg, "arch", "gpt")
    builder = _ARCHS.get(arch)
    if builder is None:
        raise ValueError(f"unknown model.arch {arch!r}; valid: {', '.join(sorted(_ARCHS))}")
    return builder(cfg, grid)


def gpt_spec(cfg: "ModelConfig", grid: Grid) -> ModelSpec:
    """GPT-2 style: LayerNorm, fused QKV (rows per head), GELU MLP, learned positions, untied head."""
    h, f, l = cfg.n_embd, cfg.ffn_mult * cfg.n_embd, cfg.n_layer
    std, res_std = cfg.init_std, cfg.init_std / math.sqrt(2 * l)
    vocab = padded_vocab(cfg.vocab_size, cfg.vocab_multiple, grid.y)
    checks = ()
    if h % cfg.n_head:
        checks = (f"n_embd={h} not divisible by n_head={cfg.n_head}",)
    block = (NormSpec("ln1", h, cfg.bias),
             LinearSpec("attn.qkv", h, 3 * h, bias=cfg.bias, init_std=std),
             AttentionSpec("attn", cfg.n_head, cfg.n_head, h // cfg.n_head if cfg.n_head else 0, cfg.seq_len),
             LinearSpec("attn.proj", h, h, transposed=True, bias=cfg.bias, init_std=res_std),
             NormSpec("ln2", h, cfg.bias),
             LinearSpec("mlp.up", h, f, bias=cfg.bias, init_std=std),
             LinearSpec("mlp.down", f, h, transposed=True, bias=cfg.bias, init_std=res_std))
    head = (NormSpec("ln_f", h, cfg.bias),
            LinearSpec("lm_head", h, vocab, n_logical=cfg.vocab_size, init_std=std),
            CrossEntropySpec())
    emb = (EmbeddingSpec("wte", cfg.vocab_size, h, std), EmbeddingSpec("wpe", cfg.seq_len, h, std))
    return ModelSpec("gpt", l, h, cfg.seq_len, cfg.vocab_size, vocab, grid, emb, block, head, checks)


_ARCHS = {"gpt": gpt_spec}

__all__ = ["Dtypes", "Coll", "LinearSpec", "NormSpec", "AttentionSpec", "EmbeddingSpec", "CrossEntropySpec",
           "ModelSpec", "model_spec", "gpt_spec", "padded_vocab", "FLOPS_FORMULA", "FLOPS_FORMULA_RECOMPUTE"]
