"""The process groups ``perfmodel profile`` measures: one per (stride, size) shape of the world.

A shape's groups are the y-groups of :func:`shape_grid`, built with the same rank arithmetic as
training (:class:`axo4d.facts.grid.Grid`), so a shape's stride means what it means to the model.
"""

from __future__ import annotations

from typing import Any

from axo4d.facts.grid import Grid, divisors


def group_shapes(world: int) -> list[tuple[int, int]]:
    """(stride, size) pairs whose groups partition ``world`` ranks: ``s*p | world``, ``p >= 2``."""
    return [(s, p) for s in divisors(world) for p in divisors(world // s) if p >= 2]


def shape_grid(world: int, stride: int, size: int) -> Grid:
    """A grid whose y-groups have ``stride`` and ``size`` (x below them, data above)."""
    return Grid(data=world // (stride * size), x=stride, y=size)


_GROUPS: dict[tuple[int, int, int, int], Any] = {}


def shape_groups(world: int, rank: int, shapes: list[tuple[int, int]] | None = None) -> dict[tuple[int, int], Any]:
    """This rank's process group of every (stride, size) shape, or of ``shapes`` (every rank
    creates the same groups, each once per process)."""
    import torch.distributed as dist

    out = {}
    for stride, size in shapes if shapes is not None else group_shapes(world):
        key = (world, rank, stride, size)
        if key not in _GROUPS:
            for ranks in shape_grid(world, stride, size).all_groups(("y",)):
                g = dist.new_group(list(ranks))
                if rank in ranks:
                    _GROUPS[key] = g
        out[(stride, size)] = _GROUPS[key]
    return out


__all__ = ["group_shapes", "shape_grid", "shape_groups"]
