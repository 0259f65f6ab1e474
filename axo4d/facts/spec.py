"""Model facts, defined once: the shapes and placements of every part of a model on a grid, the
collectives each part issues, FLOPs, parameter counts and divisibility rules.

The models (:mod:`axo4d.models`) build their layers from these records, and the performance
model (:mod:`perfmodel`) prices the same records, so the two cannot drift apart. The parts
(a 3D linear layer, a norm, attention, embeddings, the loss) are defined in :mod:`axo4d.facts.parts`
(their traffic records in :mod:`axo4d.facts.colls`) and re-exported here; each architecture's entry
in the registry (:mod:`axo4d.facts.archs`) assembles them into a :class:`ModelSpec`
(:func:`axo4d.facts.archs.model_spec`).
A new parallel layer adds one part and the module built from it; the schedule, the checkpoints
and the performance model need no edit. This module imports no torch.

FLOPs (docs/design.md section 5, one formula for every architecture)::

    model FLOPs / step    = 6 * N_matmul * tokens + 12 * l * h * s * tokens
    with recomputation    = 8 * N_blocks * tokens + 6 * N_head * tokens + 16 * l * h * s * tokens

``N_matmul``: weights of every linear layer (LM head with the unpadded vocabulary); ``N_blocks``
the blocks' share, ``N_head`` the head's; ``h`` = heads x head size. For the GPT (MLP 4h) this is
exactly ``72*B*s*l*h^2*(1 + s/(6h) + V/(12*l*h))`` (96 and ``V/(16*l*h)`` with recomputation).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from axo4d.facts.colls import ALL_GATHER, ALL_REDUCE, REDUCE_SCATTER, Coll, Dtypes
from axo4d.facts.grid import Grid
from axo4d.facts.parts import (
    AttentionSpec,
    CrossEntropySpec,
    EmbeddingSpec,
    LinearSpec,
    NormSpec,
    Part,
    TiedEmbeddingSpec,
    layer_pairs,
)
from axo4d.facts.placement import Block3D, Placement

if TYPE_CHECKING:
    from axo4d.config import ModelConfig

FLOPS_FORMULA = "6*N_matmul*tokens + 12*l*h*s*tokens"
FLOPS_FORMULA_RECOMPUTE = "8*N_blocks*tokens + 6*N_head*tokens + 16*l*h*s*tokens"


# ---- a whole model on a grid ---------------------------------------------------------------------
def padded_vocab(vocab_size: int, vocab_multiple: int, g_tp: int) -> int:
    """Vocabulary rounded up to a multiple of ``vocab_multiple * G_x * G_y`` (``g_tp``: the LM head's
    output is split over x and y, section 15)."""
    m = max(1, vocab_multiple) * g_tp  # vocab_multiple < 1 is reported by the model's checks
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
        raise KeyError(
            f"no part {name!r} in {self.arch}; parts: "
            f"{', '.join(p.name for p in self.embeddings + self.block + self.head)}"
        )

    def linears(self) -> tuple[LinearSpec, ...]:
        """The block's linear layers, in call order."""
        return tuple(p for p in self.block if isinstance(p, LinearSpec))

    def head_linear(self) -> LinearSpec:
        return next(p for p in self.head if isinstance(p, LinearSpec))

    def all_linears(self) -> tuple[LinearSpec, ...]:
        """The block's linear layers and the LM head."""
        return self.linears() + (self.head_linear(),)

    def ffn_width(self) -> int:
        """Output features of the MLP's first layer (the second pair's widening one, whichever way
        it is transposed): its hidden activation's width (gate and up together where one layer holds both)."""
        pairs = layer_pairs(self.block)
        return pairs[1][0].n if len(pairs) > 1 else 4 * self.hidden

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
    def collectives(self, rows: float, dt: Dtypes, recompute: bool, cached_blocks: int = 0) -> list[Coll]:
        """Every tensor-parallel collective of one micro-step (block records once, per_block).

        ``cached_blocks``: the last that many blocks and the LM head keep their gathered weight
        blocks for backward (``parallel.cache_weights``, :func:`cached_blocks`): the block records
        are the cached ones, plus the backward/recompute gathers of the other blocks (calls =
        their number, not per block)."""
        out: list[Coll] = []
        for p in self.block:
            if not isinstance(p, LinearSpec) or not cached_blocks:
                out += p.collectives(self.grid, rows, dt, recompute, True)
                continue
            kept = p.collectives(self.grid, rows, dt, recompute, True, cached=True)
            out += kept
            if cached_blocks < self.n_layer:
                out += [
                    dataclasses.replace(c, calls=c.calls * (self.n_layer - cached_blocks), per_block=False)
                    for c in p.collectives(self.grid, rows, dt, recompute, True)
                    if c not in kept
                ]
        for p in self.embeddings + self.head:
            cached = isinstance(p, LinearSpec) and cached_blocks > 0
            out += (
                p.collectives(self.grid, rows, dt, False, False, cached=True)
                if cached
                else p.collectives(self.grid, rows, dt, False, False)
            )
        return out

    # ---- divisibility ----------------------------------------------------------------------------
    def divisibility_reasons(self, micro_batch: int | None = None) -> list[str]:
        """Why this model cannot be built on its grid with this micro-batch ([] when it can)."""
        g = self.grid
        out = list(self.checks)
        if self.hidden % (g.x * g.y):  # the residual stream is split over x and y (section 15)
            out.append(f"n_embd={self.hidden} not divisible by G_x*G_y={g.x * g.y}")
        for p in self.embeddings + self.block + self.head:
            out += [r for r in p.divisibility(g) if r not in out]
        if self.attention().splits(g):  # z splits the sequence: the batch only over data
            if micro_batch is not None and micro_batch % g.size("data"):
                out.append(
                    f"micro-batch of {micro_batch} samples not divisible by G_data={g.size('data')} (sequence split)"
                )
        elif micro_batch is not None and micro_batch % g.size("data", "z"):
            out.append(f"micro-batch of {micro_batch} samples not divisible by G_data*G_z={g.size('data', 'z')}")
        return out

    def with_sequence_split(self, on: bool = True) -> ModelSpec:
        """This spec with z splitting every sample's sequence (``parallel.z_split='sequence'``):
        attention gathers K/V over z and the micro-batch need only divide by G_data."""
        block = tuple(dataclasses.replace(p, seq_split=on) if isinstance(p, AttentionSpec) else p for p in self.block)
        return dataclasses.replace(self, block=block)


def cached_blocks(setting: str, n_layer: int) -> int:
    """Blocks whose gathered weights are kept for backward, from ``parallel.cache_weights``:
    'off' -> 0, 'all' -> ``n_layer``, a number ``N`` -> the last ``N`` (at most ``n_layer``); the LM
    head is kept too whenever ``N > 0``. ('auto' is resolved from the memory model by the command
    line before a model is built.)"""
    s = str(setting).strip().lower()
    if s in ("off", "false", "0", "none", ""):
        return 0
    if s in ("all", "on", "true"):
        return n_layer
    if s.isdigit():
        return min(int(s), n_layer)
    if s == "auto":
        raise ValueError(
            "parallel.cache_weights='auto' is resolved from the memory model by python -m "
            "axo4d.train (perfmodel.grid_auto); here give off, all or a number of blocks"
        )
    raise ValueError(
        f"parallel.cache_weights={setting!r}; valid: off, all, auto, or a number of blocks (the last N of {n_layer})"
    )


def shape_checks(cfg: ModelConfig) -> list[str]:
    """Reasons from the model's own numbers (no grid)."""
    out = [
        f"{k}={getattr(cfg, k)} must be >= 1"
        for k in ("n_layer", "n_embd", "n_head", "vocab_size", "seq_len", "vocab_multiple")
        if getattr(cfg, k) < 1
    ]
    out += [
        f"{k}={getattr(cfg, k)} must be >= 0 (0 = derived)"
        for k in ("n_kv_head", "head_dim", "ffn_hidden")
        if getattr(cfg, k, 0) < 0
    ]
    if not getattr(cfg, "ffn_hidden", 0) and cfg.ffn_mult < 1:
        out.append(f"ffn_mult={cfg.ffn_mult} must be >= 1 (or set model.ffn_hidden)")
    if not out and not cfg.head_dim and cfg.n_embd % cfg.n_head:
        out.append(f"n_embd={cfg.n_embd} not divisible by n_head={cfg.n_head} (or set model.head_dim)")
    return out


__all__ = [
    "ALL_GATHER",
    "REDUCE_SCATTER",
    "ALL_REDUCE",
    "Part",
    "Dtypes",
    "Coll",
    "LinearSpec",
    "NormSpec",
    "AttentionSpec",
    "EmbeddingSpec",
    "TiedEmbeddingSpec",
    "CrossEntropySpec",
    "ModelSpec",
    "shape_checks",
    "cached_blocks",
    "padded_vocab",
    "FLOPS_FORMULA",
    "FLOPS_FORMULA_RECOMPUTE",
]
