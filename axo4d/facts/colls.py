"""The records the parts of a model describe their traffic with: one collective of a step
(:class:`Coll`), the element sizes a step moves and stores (:class:`Dtypes`), and the names of the
collective kinds. The parts themselves are in :mod:`axo4d.facts.parts`. This module imports no torch.
"""

from __future__ import annotations

from dataclasses import dataclass

ALL_GATHER, REDUCE_SCATTER, ALL_REDUCE = "all_gather", "reduce_scatter", "all_reduce"
ALL_TO_ALL = "all_to_all"
"""The expert group's exchange of routed rows (and of their counts): ``nbytes`` is the whole input
a rank passes in, the rows it keeps included (what :meth:`axo4d.dist.comm.Comm.all_to_all` counts)."""
COUNT_BYTES = 8
"""Bytes of one routed-row count (int64) in the counts' all-to-all before a dispatch."""
FP8_BYTES = 1
"""Bytes of an FP8 element (a weight piece gathered over z by an FP8 layer)."""
AMAX_BYTES = 4
"""Bytes of one amax (fp32) in the all-reduces that agree FP8 scales."""


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
    def for_compute(cls, dtype: str) -> Dtypes:
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
    (forward compute), 'bwd' (backward compute), 'dx' (the dW GEMM of ``layer``), 'chunks' (the
    GEMM of the layer's next row chunk: :meth:`axo4d.facts.parts.LinearSpec.fwd_chunks`)."""

    layer: str
    phase: str
    axes: tuple[str, ...]
    kind: str
    nbytes: float
    calls: int
    pool: str
    per_block: bool = True


def chunked(c: Coll, chunks: int, pool: str = "chunks") -> Coll:
    """``c`` as ``chunks`` calls of a ``chunks``-th of its bytes each (``pool`` 'chunks': behind the
    GEMMs of the other row chunks; 'dx': a backward's reduce-scatter of dX, behind the later chunks'
    dX GEMMs and the dW GEMM) when ``chunks`` > 1."""
    if chunks <= 1:
        return c
    return Coll(c.layer, c.phase, c.axes, c.kind, c.nbytes / chunks, c.calls * chunks, pool, c.per_block)
