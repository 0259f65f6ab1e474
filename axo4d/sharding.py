"""How a parameter is laid out on the grid: one typed value per parameter.

Every parameter of an axo4d model carries a :class:`Sharding` (attribute
``param.sharding``). The gradient synchroniser, the global gradient norm and
the checkpoint/gather code all read it, so the rules of DESIGN.md section 2
live in one place:

* ``grad_sum``: axes over which the gradient must still be summed after
  backward (the batch axes ``data``/``z`` that the parameter does not already
  reduce through its own reduce-scatter);
* ``split``: axes over which the parameter's elements are partitioned (the
  global norm sums squares over these only, counting replicas once);
* ``layout``: how to cut the full tensor into this rank's shard and to put it
  back (see :mod:`axo4d.layers` and :mod:`axo4d.model`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Sharding:
    """Placement of one parameter on the grid."""

    split: tuple[str, ...]
    """Axes whose ranks hold disjoint pieces of the parameter."""
    grad_sum: tuple[str, ...]
    """Axes over which the gradient is summed after backward (data-parallel reduction)."""
    layout: str
    """'linear3d' (flattened weight block split over z), 'cols' (last dim split
    over ``split[0]``) or 'replicated'."""
    in_axis: str = ""
    """For 'linear3d': the axis splitting the input features (x, or y if transposed)."""
    out_axis: str = ""
    """For 'linear3d': the axis splitting the output features (y, or x if transposed)."""
    weight_decay: bool = False
    """Whether AdamW decays this parameter (matrices yes; norms, biases no)."""
    full_shape: tuple[int, ...] = ()
    """Shape of the unsharded tensor."""


def set_sharding(p: torch.nn.Parameter, s: Sharding) -> torch.nn.Parameter:
    p.sharding = s  # type: ignore[attr-defined]
    return p


def get_sharding(p: torch.Tensor) -> Sharding:
    s = getattr(p, "sharding", None)
    if s is None:
        raise AttributeError(f"parameter of shape {tuple(p.shape)} has no sharding; "
                             "every axo4d parameter must declare one")
    return s
