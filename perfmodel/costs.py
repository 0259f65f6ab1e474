"""Per-rank costs of a model on one grid that only the performance model needs: the data-parallel
reductions, bookkeeping scalars, elementwise traffic and operator counts (activation memory:
:mod:`axo4d.facts.memory`, which the library's start-up check shares).

The model's own facts (its parts, their shapes, placements, collectives, GEMM FLOPs, parameter
counts, divisibility) come from :mod:`axo4d.facts.spec`, the records the models are built from; here
they are only read. Everything is per rank and per micro-step over the rank's local rows
``b = B*s/(G_data*G_z)`` unless a function says otherwise.
"""

from __future__ import annotations

import math

from axo4d.facts.memory import shard_on
from axo4d.facts.moe_parts import router_of
from axo4d.facts.parts import AMAX_BYTES
from axo4d.facts.schedule_rules import bucket_limit, plan_buckets
from axo4d.facts.spec import ALL_GATHER, ALL_REDUCE, REDUCE_SCATTER, Coll, Dtypes, ModelSpec


def local_rows(spec: ModelSpec, global_batch: float) -> float:
    """Rows (tokens) of X on one rank: ``B*s/(G_data*G_z)``."""
    return global_batch * spec.seq_len / spec.grid.size("data", "z")


def _ordered(axes) -> tuple[str, ...]:
    """Axes as the perfmodel names groups: data (or its expert sub-axes) first (``('data', 'z')``)."""
    return tuple(sorted(axes, key=("data", "ep", "edp", "z", "x", "y").index))


def _comm_parts(axes: tuple[str, ...]) -> list[tuple[str, ...]]:
    """The groups an all-reduce over ``axes`` runs on (:meth:`axo4d.dist.comm.Comm.all_reduce`):
    ``axes`` itself, or, where expert sub-axes (``ep``, ``edp``) join others, the others then each
    sub-axis in turn."""
    sub = [a for a in axes if a in ("ep", "edp")]
    if not sub or len(sub) == len(axes):
        return [axes]
    rest = tuple(a for a in axes if a not in sub)
    return [rest] + [(a,) for a in sub]


def grad_groups(spec: ModelSpec) -> dict[tuple[str, ...], float]:
    """Local parameter elements per ``grad_sum`` axes (first-seen order): the data-parallel
    buckets' groups (weight pieces over ``data``, the replicated rest over ``(z, data)``)."""
    out: dict[tuple[str, ...], float] = {}
    for _, pl, per_block in spec.placements():
        n = math.prod(pl.full_shape) / (spec.grid.size(*pl.split) if pl.split else 1)
        axes = _ordered(pl.grad_sum)
        out[axes] = out.get(axes, 0.0) + n * (spec.n_layer if per_block else 1)
    return out


def param_items(spec: ModelSpec) -> list[tuple[int, tuple[str, ...], float]]:
    """``(index, grad_sum axes, local elements)`` of every parameter tensor in the model's order
    (embeddings, each block, head), as the schedule plans its buckets."""

    def of(part) -> list[tuple[tuple[str, ...], float]]:
        return [
            (tuple(pl.grad_sum), math.prod(pl.full_shape) / (spec.grid.size(*pl.split) if pl.split else 1))
            for pl in part.placements().values()
        ]

    block = [x for part in spec.block for x in of(part)]  # every block alike: computed once
    rows = [x for p in spec.embeddings for x in of(p)] + block * spec.n_layer + [x for p in spec.head for x in of(p)]
    return [(i, axes, n) for i, (axes, n) in enumerate(rows)]


def dp_buckets(spec: ModelSpec, bucket_mb: str | float) -> list[tuple[tuple[str, ...], list[int], float]]:
    """The data-parallel buckets of :func:`axo4d.nn.buckets.plan_buckets` on ``spec``'s grid:
    ``(axes as planned, parameter indices, elements)``, groups of one rank left out (planned on
    fp32 sizes, as the schedule plans them before any dtype change)."""
    items = param_items(spec)
    elems = {i: n for i, _, n in items}
    limit = bucket_limit(bucket_mb, spec, 4.0)
    planned = plan_buckets([(i, axes, n * 4.0) for i, axes, n in items], limit)
    return [(axes, keys, sum(elems[i] for i in keys)) for axes, keys in planned if spec.grid.size(*axes) > 1]


def dp_colls(spec: ModelSpec, dt: Dtypes, bucket_mb: str | float, shard: bool | None = None) -> list[Coll]:
    """Data-parallel gradient reductions: weight pieces over ``data``, the rest over ``(data, z)``,
    one call per bucket (:func:`dp_buckets`; buckets of one size share a record). With the
    sharded optimizer (``shard``; ``None``: 'auto') a reduce-scatter of the gradients in backward
    (each bucket zero-padded to a multiple of the group size) and an all-gather of the new
    weights (``dt.param_state`` bytes each), overlapped with the next forward: together the bytes
    of the all-reduce."""
    sharded = shard_on(spec, shard)
    counts: dict[tuple, int] = {}
    for axes, _, elems in dp_buckets(spec, bucket_mb):
        p = spec.grid.size(*axes)
        per = math.ceil(elems / p) * p if sharded else elems
        key = (_ordered(axes), per)
        counts[key] = counts.get(key, 0) + 1
    out = []
    for (axes, per), calls in counts.items():
        key = "linear" if axes == ("data",) else "other"
        if not sharded:
            out.append(Coll(f"grads_{key}", "bwd", axes, ALL_REDUCE, per * dt.grad, calls, "bwd", False))
            continue
        out.append(Coll(f"grads_{key}", "bwd", axes, REDUCE_SCATTER, per * dt.grad, calls, "bwd", False))
        out.append(Coll(f"weights_{key}", "step", axes, ALL_GATHER, per * dt.param_state, calls, "fwd", False))
    return out


def bookkeeping_colls(spec: ModelSpec, dt: Dtypes, shard: bool | None = None) -> list[Coll]:
    """Scalar all-reduces of a step: the global gradient norm (one fp64 sum of squares per
    distinct (split axes, shard axes) of the parameters: over the shard axes when the optimizer
    is sharded, then over the split axes) and the reported loss over (data, z) (with a mixture of
    experts' load-balancing loss beside it)."""
    sharded = shard_on(spec, shard)
    keys = set()
    for _, pl, _ in spec.placements():
        over = _ordered(pl.grad_sum) if sharded and spec.grid.size(*pl.grad_sum) > 1 else ()
        keys.add((tuple(pl.split), over))
    out = []
    for split, over in sorted(keys):
        if over:
            out.append(Coll("grad_norm", "step", over, ALL_REDUCE, dt.scalar, 1, "blocking", False))
        for part in _comm_parts(split) if split else []:
            out.append(Coll("grad_norm", "step", part, ALL_REDUCE, dt.scalar, 1, "blocking", False))
    moe = router_of(spec.block) is not None  # the load-balancing loss travels with the loss
    out.append(Coll("loss", "step", ("data", "z"), ALL_REDUCE, dt.scalar * (2 if moe else 1), 1, "blocking", False))
    n_fp8 = spec.n_layer * sum(x.fp8_weight_amaxes() for x in spec.linears()) + spec.head_linear().fp8_weight_amaxes()
    if n_fp8:  # the FP8 weights' amaxes, all layers in one vector (axo4d.nn.fp8.WeightScales)
        nb = n_fp8 * AMAX_BYTES
        out.append(Coll("fp8_weight_scales", "step", ("x", "y", "z"), ALL_REDUCE, nb, 1, "blocking", False))
    return out


def attention_flops(spec: ModelSpec, b: float) -> float:
    """Forward FLOPs of local attention on one rank (its heads: over x and y, or over y in the
    fallback of :meth:`axo4d.facts.parts.AttentionSpec.whole_heads`)."""
    return spec.attention().gemm_flops(spec.grid, b)


#: Elementwise passes (reads + writes of one element) per forward; backward ~2x.
#: Residual stream (split over x): two norms ~5 each, two residual adds 3 each,
#: the biases of the two transposed layers 2 each.
PASSES_X = 20
#: Feature-split over y: QKV output (bias, head split copy) 4 x 3h, attention output copy 2 x h,
#: MLP-up output (bias, activation) 4 x ffn: per row.
PASSES_Y_QKV, PASSES_Y_ATTN, PASSES_Y_FFN = 4, 2, 4
#: Attention scores (b x s per local head): QK^T write, scale/mask, softmax read+write, AV read.
PASSES_SCORES = 6
#: AdamW (foreach) per parameter: p, grad, two moments read and written, temporaries; norm, clip.
PASSES_OPTIM = 14
#: Operators launched per block (forward + backward) and for head, loss and bookkeeping.
OPS_BLOCK = 110
OPS_HEAD = 60
#: Operators per parameter tensor in the step (gradient norm, clipping, foreach optimizer share).
OPS_PER_PARAM = 4


def elementwise_bytes(spec: ModelSpec, b: float, dt: Dtypes) -> dict[str, float]:
    """Bytes of non-GEMM traffic per rank: ``blocks`` and ``head`` per micro-step (forward and
    backward), ``optimizer`` per step. What lies between the GEMMs is split over x and y
    (docs/design.md section 2.1); attention over its head axes."""
    g, h, s = spec.grid, spec.hidden, spec.seq_len
    a = spec.attention()
    tp, heads = g.x * g.y, g.size(*a.head_axes(g))
    qkv = spec.part("attn.qkv").n
    y_elems = PASSES_Y_QKV * qkv / heads + PASSES_Y_ATTN * h / heads + PASSES_Y_FFN * spec.ffn_width() / tp
    fwd = b * (PASSES_X * h / tp + y_elems + PASSES_SCORES * s * a.n_head / heads) * dt.act
    head = b * (5 * h / tp * dt.act + 12 * spec.vocab / tp * dt.stat)
    pc = spec.local_params()
    return {
        "blocks": 3 * spec.n_layer * fwd,
        "head": 3 * head,
        "optimizer": PASSES_OPTIM * (pc["linear"] + pc["other"]) * dt.param_state,
    }


def op_count(spec: ModelSpec) -> tuple[int, int]:
    """Operators launched per micro-step and per optimizer step (grid-independent estimate)."""
    per_block = sum(len(p.placements()) for p in spec.block)
    rest = sum(len(p.placements()) for p in spec.embeddings + spec.head)
    tensors = spec.n_layer * per_block + rest
    return spec.n_layer * OPS_BLOCK + OPS_HEAD, tensors * OPS_PER_PARAM
