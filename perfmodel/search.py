"""Search dimensions beyond the grid's shape: the rank order, and reporting near-ties as ties.

**Rank order.** ``parallel.order`` (fastest axis first) decides each group's stride, hence which
groups stay inside a node and which bandwidth they get (docs/design.md section 1). Two orders
that differ only in where axes of size one go are the same layout; :func:`distinct_orders` lists
one order per distinct layout of the grid's non-trivial axes, the default first. Every grid is
also tried in its :func:`traffic_order` (busiest axis fastest), and the best grids in every order.

**Ties.** A model that claims a relative error ``u`` on step time (the machine file's
``uncertainty``) cannot tell apart two grids whose predictions differ by less than that:
:func:`mark_ties` flags every feasible grid within ``u`` of the best one.
"""

from __future__ import annotations

import itertools
from dataclasses import replace
from typing import Any, Iterable

from axo4d.facts.grid import AXES, Grid

DEFAULT_ORDER = ("x", "y", "z", "data")


def distinct_orders(grid: Grid) -> list[tuple[str, ...]]:
    """Every rank order giving ``grid`` a different layout (the axes of size > 1 in a different
    sequence), the grid's own order first."""
    seen, out = set(), []
    for order in itertools.chain([tuple(grid.order)], itertools.permutations(AXES)):
        key = tuple(a for a in order if grid.size(a) > 1)
        if key not in seen:
            seen.add(key)
            out.append(tuple(order))
    return out


def traffic_order(grid: Grid, comm_s: dict[str, float]) -> tuple[str, ...]:
    """The order that keeps the busiest groups inside a node: the axes of size > 1 by their
    communication time (alone, from an estimate in any order), largest first."""
    big = sorted((a for a in AXES if grid.size(a) > 1), key=lambda a: -comm_s.get(a, 0.0))
    return tuple(big) + tuple(a for a in AXES if a not in big)


def with_order(grid: Grid, order: Iterable[str]) -> Grid:
    """``grid`` with another rank order."""
    return Grid(data=grid.data, x=grid.x, y=grid.y, z=grid.z, order=tuple(order))


def mark_ties(ests: list[Any], uncertainty: float | None = None) -> list[Any]:
    """Flag (``tie=True``) the feasible estimates within the relative ``uncertainty`` (default:
    each estimate's own, the machine's) of the fastest feasible one; returns the same list."""
    feas = [e for e in ests if e.feasible]
    if not feas:
        return ests
    best = min(e.step_time_s for e in feas)
    out = []
    for e in ests:
        u = uncertainty if uncertainty is not None else e.uncertainty
        out.append(replace(e, tie=e.feasible and e.step_time_s <= best * (1 + u)))
    ests[:] = out
    return ests


__all__ = ["distinct_orders", "traffic_order", "with_order", "mark_ties", "DEFAULT_ORDER"]
