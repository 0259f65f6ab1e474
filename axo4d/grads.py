"""Gradient synchronisation across the grid and the global gradient norm.

The rules come from each parameter's :class:`~axo4d.sharding.Sharding`:
gradients are summed over ``grad_sum`` (the data-parallel reduction, bucketed),
and the global norm sums squares over ``split`` axes only, so replicated
parameters are counted once.
"""
from __future__ import annotations

import math
from collections import defaultdict
from typing import Iterable

import torch

from axo4d.comm import Comm
from axo4d.sharding import get_sharding


def _by_axes(params: Iterable[torch.nn.Parameter], attr: str) -> dict[tuple[str, ...], list]:
    out: dict[tuple[str, ...], list] = defaultdict(list)
    for p in params:
        out[tuple(getattr(get_sharding(p), attr))].append(p)
    return out


def reduce_gradients(params: Iterable[torch.nn.Parameter], comm: Comm, bucket_mb: float = 25.0) -> None:
    """Sum every gradient over its ``grad_sum`` axes, in flat buckets of ~``bucket_mb`` MiB.

    forward: -; this is the data-parallel reduction the trainer calls after backward.
    Parameters without a gradient get zeros (so every rank issues the same collectives).
    """
    limit = max(1, int(bucket_mb * 2**20))
    for axes, plist in _by_axes(params, "grad_sum").items():
        if comm.size(axes) == 1:
            continue
        bucket: list[torch.nn.Parameter] = []
        nbytes = 0
        for p in plist:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            bucket.append(p)
            nbytes += p.grad.numel() * p.grad.element_size()
            if nbytes >= limit:
                _flush(bucket, comm, axes)
                bucket, nbytes = [], 0
        if bucket:
            _flush(bucket, comm, axes)


def _flush(bucket: list[torch.nn.Parameter], comm: Comm, axes: tuple[str, ...]) -> None:
    by_dtype: dict[torch.dtype, list] = defaultdict(list)
    for p in bucket:
        by_dtype[p.grad.dtype].append(p)
    for plist in by_dtype.values():
        flat = torch.cat([p.grad.reshape(-1) for p in plist])
        comm.all_reduce(flat, axes)
        off = 0
        for p in plist:
            n = p.grad.numel()
            p.grad.copy_(flat[off:off + n].view_as(p.grad))
            off += n


def global_grad_norm(params: Iterable[torch.nn.Parameter], comm: Comm) -> float:
    """L2 norm of the full (unsharded) gradient, identical on every rank.

    Squares are summed locally, then over each parameter's ``split`` axes only.
    """
    params = list(params)
    device = params[0].device if params else torch.device("cpu")
    total = torch.zeros((), dtype=torch.float64, device=device)
    for axes, plist in sorted(_by_axes(params, "split").items()):
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
