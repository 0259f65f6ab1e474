"""Lookup tables whose features are split over x (replicated over y, z and data)."""
from __future__ import annotations

import torch
from torch import nn

from axo4d.dist.grid import Grid
from axo4d.dist.placement import normal, place
from axo4d.spec import EmbeddingSpec


def embedding_table(spec: EmbeddingSpec, grid: Grid) -> nn.Parameter:
    """The ``(rows, dim/G_x)`` piece of a table, carrying its placement and init."""
    pl = spec.placements()[""]
    return place(nn.Parameter(torch.empty(pl.local_shape(grid))), pl, normal(spec.init_std))
