"""The global gradient norm, clipping, and the data-parallel reduction of loose parameters.

The rules come from each parameter's :class:`~axo4d.dist.placement.Placement`: the global norm
sums squares over its ``split`` axes only, so replicated parameters are counted once.
"""
from __future__ import annotations

import math
from collections import defaultdict
from typing import Iterable

import torch

from axo4d.dist.comm import Comm
from axo4d.dist.placement import placement_of
from axo4d.nn.schedule import Schedule


def reduce_gradients(params: Iterable[torch.nn.Parameter], comm: Comm, bucket_mb: float = 25.0) -> None:
    """Sum every gradient over its ``grad_sum`` axes now, in the eager schedule's buckets (for
    layers used outside a model; a model's schedule does this in ``finish``)."""
    s = Schedule(comm, bucket_mb)
    s.attach(params)
    s.finish()


def global_grad_norm(params: Iterable[torch.nn.Parameter], comm: Comm) -> float:
    """L2 norm of the full (unsharded) gradient, identical on every rank.

    Squares are summed locally, then over each parameter's ``split`` axes only.
    """
    params = list(params)
    device = params[0].device if params else torch.device("cpu")
    by_split: dict[tuple[str, ...], list] = defaultdict(list)
    for p in params:
        by_split[tuple(placement_of(p).split)].append(p)
    total = torch.zeros((), dtype=torch.float64, device=device)
    for axes, plist in sorted(by_split.items()):
        sq = torch.zeros(1, dtype=torch.float64, device=device)
        for p in plist:
            if p.grad is not None:
                sq += p.grad.detach().double().pow(2).sum()
        if axes:
            comm.all_reduce(sq, axes)
        total += sq[0]
    return math.sqrt(float(total))


def clip_gradients(params: Iterable[torch.nn.Parameter], max_norm: float, norm: float) -> float:
    """Scale gradients so the global norm is at most ``max_norm``; returns the factor."""
    if max_norm <= 0 or not math.isfinite(norm) or norm <= max_norm:
        return 1.0
    coef = max_norm / (norm + 1e-6)
    for p in params:
        if p.grad is not None:
            p.grad.mul_(coef)
    return coef
