"""Which layer of each pair is transposed on a grid (docs/design.md section 15.1).

A block's linear layers come in pairs, in call order: a layer that widens the residual stream's
``C`` features into an inner activation (QKV, MLP up or gate|up) and one that narrows it back
(attention's projection, MLP down). The families build each pair non-transposed then transposed;
either orientation computes the same product, but not with the same bytes: with the split layout
a layer moves its output's features over its input axis and its input's over its output axis, so
on a grid with x alone the non-transposed first layer moves the inner (wide) activation and the
transposed-first pair moves only C-wide ones (Megatron's pattern).

:func:`orient` gives a spec each pair's cheaper orientation (today's on ties), and the LM head its
own (:func:`head_turns`: on x alone with a vocabulary wider than ``C`` -- ``2C`` with a tied table --
the head as built would move its V-wide logits); :func:`parts_bytes` is the count they compare.
The spec is the one record the layers, the memory model, the byte prediction and the performance
model read, so they all follow. Pure: no torch.
"""

from __future__ import annotations

import dataclasses

from axo4d.facts.colls import ALL_REDUCE, Dtypes
from axo4d.facts.grid import Grid
from axo4d.facts.parts import LinearSpec, layer_pairs
from axo4d.facts.spec import ModelSpec

#: tensor-axis traffic only: activations of one element each (a pair's relative cost)
_UNIT = Dtypes(act=1, weight=1, grad=1)
#: every kind of value one element (:func:`tensor_bytes` counts elements)
_ELEMENTS = Dtypes(act=1, weight=1, grad=1, stat=1, param_state=1)


def parts_bytes(parts: list, grid: Grid) -> float:
    """Elements one rank sends over the tensor axes for one row through ``parts`` (linear layers, a
    tied embedding; forward and backward: each collective's ``(G-1)/G`` of its size, as a ring does;
    groups of one send nothing)."""
    total = 0.0
    for p in parts:
        for c in p.collectives(grid, 1.0, _UNIT, recompute=False, per_block=True):
            if c.axes in (("x",), ("y",)) and c.phase in ("fwd", "bwd"):
                g = grid.size(*c.axes)
                total += c.nbytes * c.calls * (g - 1) / g
    return total


def layer_bytes(lin: LinearSpec, grid: Grid) -> float:
    """:func:`parts_bytes` of one layer."""
    return parts_bytes([lin], grid)


def pair_bytes(first: LinearSpec, second: LinearSpec, grid: Grid) -> float:
    """:func:`parts_bytes` of the pair."""
    return parts_bytes([first, second], grid)


def tensor_bytes(spec: ModelSpec, rows: float) -> float:
    """Elements one rank sends over the tensor axes (groups over x, y, or both) in one micro-step of
    ``rows`` rows on the rank, forward and backward, every part of the model (the activations per
    row, and what does not scale with rows, such as a norm's parameter gradients, once): each
    collective's ring share of its size (``(G-1)/G``, twice that for an all-reduce). The count
    :func:`axo4d.facts.run.derive.run_grid` compares between a grid and the same ranks with x and y
    exchanged."""
    grid, total = spec.grid, 0.0
    for c in spec.collectives(rows, _ELEMENTS, recompute=False):
        if c.phase not in ("fwd", "bwd") or not set(c.axes) <= {"x", "y"}:
            continue
        g = grid.size(*c.axes)
        share = (g - 1) / g * (2 if c.kind == ALL_REDUCE else 1)
        total += c.nbytes * c.calls * (spec.n_layer if c.per_block else 1) * share
    return total


def flipped(first: LinearSpec, second: LinearSpec) -> tuple[LinearSpec, LinearSpec]:
    """The pair the other way round (each layer's ``transposed`` negated)."""
    return (
        dataclasses.replace(first, transposed=not first.transposed),
        dataclasses.replace(second, transposed=not second.transposed),
    )


def narrow(first: LinearSpec, second: LinearSpec, grid: Grid) -> bool:
    """Whether the pair should run the other way round on ``grid``: it sends fewer bytes and the
    residual stream keeps its feature order. That order (x outer, y inner) is the narrowing layer's
    output's, fixed by its orientation; the embeddings, norms, LM head and loss read it as (x, y), so
    a pair turns only on a grid where one tensor axis has one rank (x alone: the C-wide layout). On
    x*y grids with G_x > G_y > 1 the start-up exchanges the roles of x and y instead
    (:func:`axo4d.facts.run.derive.run_grid`): every pair turned and the stream's order with them."""
    if min(grid.x, grid.y) > 1:
        return False
    return pair_bytes(*flipped(first, second), grid) < pair_bytes(first, second, grid)


def _head_parts(spec: ModelSpec) -> list:
    """The LM head and an embedding tied to it (which reads the head's weight and placement)."""
    head = spec.head_linear()
    return [head, *(e for e in spec.embeddings if getattr(e, "head", None) is head)]


def _turned_head(spec: ModelSpec) -> ModelSpec:
    """``spec`` with the LM head turned (a tied table pointing at the turned head)."""
    head = spec.head_linear()
    turned = dataclasses.replace(head, transposed=not head.transposed)
    emb = tuple(dataclasses.replace(e, head=turned) if getattr(e, "head", None) is head else e for e in spec.embeddings)
    return dataclasses.replace(spec, embeddings=emb, head=tuple(turned if p is head else p for p in spec.head))


def head_turns(spec: ModelSpec) -> bool:
    """Whether the LM head should run transposed on ``spec``'s grid: one tensor axis has ranks (the
    stream's order is :func:`narrow`'s) and it sends fewer bytes, a tied embedding table counted
    with it. On x alone the head as built reduce-scatters its V-wide logits over x in forward and
    gathers their gradient in backward (``2V`` a row); turned, it gathers its C-wide input and
    reduce-scatters that input's gradient (``2C``), and a tied table, now split by vocabulary over x,
    reduce-scatters its looked-up rows over x and gathers their gradient (``2C`` more). Its logits
    are still this rank's vocabulary block ``index(x, y)`` (y has one rank)."""
    grid = spec.grid
    if min(grid.x, grid.y) > 1:
        return False
    return parts_bytes(_head_parts(_turned_head(spec)), grid) < parts_bytes(_head_parts(spec), grid)


def orient(spec: ModelSpec) -> ModelSpec:
    """``spec`` with each pair of its block in the orientation :func:`narrow` picks for its grid.
    Experts (``mlp.experts.*``) keep the families' orientation: their module (axo4d/nn/experts.py)
    and its tests are written for it."""
    turn: dict[str, LinearSpec] = {}
    for a, b in layer_pairs(spec.block):
        if ".experts." in a.name or not narrow(a, b, spec.grid):
            continue
        fa, fb = flipped(a, b)
        turn[a.name], turn[b.name] = fa, fb
    out = _turned_head(spec) if head_turns(spec) else spec
    if not turn:
        return out
    block = tuple(turn.get(p.name, p) if isinstance(p, LinearSpec) else p for p in spec.block)
    return dataclasses.replace(out, block=block)


__all__ = [
    "layer_pairs",
    "parts_bytes",
    "layer_bytes",
    "pair_bytes",
    "tensor_bytes",
    "flipped",
    "narrow",
    "head_turns",
    "orient",
]
