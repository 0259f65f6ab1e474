"""Full (unsharded) tensors of a sharded model, and back: pure slicing by each
parameter's :class:`~axo4d.sharding.Sharding`.

Used for parity checks, exports to a single-file ``state_dict`` and
resharding a checkpoint onto another grid.
"""
from __future__ import annotations

import torch
from torch import nn

from axo4d.comm import Comm
from axo4d.layers import gather_linear_weight, shard_linear_weight, _gather_world
from axo4d.sharding import get_sharding


def shard_full_tensor(full: torch.Tensor, p: torch.Tensor, comm: Comm) -> torch.Tensor:
    """This rank's shard (shaped like ``p``) of the full tensor of parameter ``p``."""
    s = get_sharding(p)
    if tuple(full.shape) != tuple(s.full_shape):
        raise ValueError(f"full tensor of shape {tuple(full.shape)} does not match the parameter's "
                         f"full shape {tuple(s.full_shape)}")
    if s.layout == "linear3d":
        return shard_linear_weight(full, comm, s.in_axis, s.out_axis).view_as(p)
    if s.layout == "cols":
        axis = s.split[0]
        return full.chunk(comm.size(axis), -1)[comm.coord(axis)].clone().view_as(p)
    return full.clone().view_as(p)


def gather_full_tensor(t: torch.Tensor, p: torch.Tensor, comm: Comm) -> torch.Tensor:
    """The full tensor from every rank's shard ``t`` of parameter ``p`` (collective)."""
    s = get_sharding(p)
    if s.layout == "linear3d":
        return gather_linear_weight(t.detach().reshape(-1), comm, s.in_axis, s.out_axis, s.full_shape)
    if s.layout == "cols":
        axis = s.split[0]
        parts = _gather_world(t.detach().contiguous(), comm)
        g = comm.grid
        by_coord = {g.coords(r)[axis]: parts[r] for r in range(g.world_size)}
        return torch.cat([by_coord[i] for i in range(comm.size(axis))], -1)
    return t.detach().clone()


def full_state_dict(model: nn.Module, comm: Comm) -> dict[str, torch.Tensor]:
    """Every parameter unsharded, on CPU, keyed by name (identical on all ranks)."""
    return {n: gather_full_tensor(p.data, p, comm).cpu() for n, p in model.named_parameters()}


@torch.no_grad()
def load_full_state_dict(model: nn.Module, sd: dict[str, torch.Tensor], comm: Comm) -> None:
    """Load unsharded tensors (as from :func:`full_state_dict`) into a model on any grid."""
    names = dict(model.named_parameters())
    missing, unexpected = sorted(set(names) - set(sd)), sorted(set(sd) - set(names))
    if missing or unexpected:
        raise ValueError(f"state_dict does not match the model: missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]}")
    for n, p in names.items():
        p.copy_(shard_full_tensor(sd[n].to(p.dtype), p, comm))
