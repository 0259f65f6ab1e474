"""The data-parallel gradient buckets of a schedule (:mod:`axo4d.nn.schedule`): which parameters
are summed together over which axes, the slice of each sum a rank owns when the optimizer is
sharded, and the flat tensors a bucket's collective runs on. The planning rule is shared with the
performance model (:func:`axo4d.facts.schedule_rules.plan_buckets`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable

import torch
from torch import nn

from axo4d.dist.buffers import BufferPool
from axo4d.dist.comm import Comm
from axo4d.facts.placement import placement_of
from axo4d.facts.schedule_rules import plan_buckets as _plan


@dataclass
class Bucket:
    """Parameters whose gradients are summed over ``axes`` in one flat collective per dtype: an
    all-reduce, or with ``shard`` (the sharded optimizer) a reduce-scatter that leaves this rank
    the slice :meth:`owned_range` of the sum in ``owned`` (and frees the parameters' ``.grad``)."""

    axes: tuple[str, ...]
    params: list[nn.Parameter]
    size: int = 2  # ranks of the ``axes`` group (1: planned only for the bucket hooks)
    shard: bool = False
    ready: set = field(default_factory=set)
    parts: list = field(default_factory=list)  # (params, flat, handle) per dtype once issued
    owned: list = field(default_factory=list)  # sharded, once reduced: this rank's slice per dtype part

    def flat_parts(self) -> list[tuple[list[nn.Parameter], int]]:
        """Per dtype part (first-seen order): its parameters, in order, and the length of its flat
        gradient (padded with zeros to a multiple of ``size`` when sharded)."""
        by_dtype: dict[torch.dtype, list[nn.Parameter]] = {}
        for p in self.params:
            by_dtype.setdefault(p.dtype, []).append(p)
        m = self.size if self.shard else 1
        return [(plist, -(-sum(p.numel() for p in plist) // m) * m) for plist in by_dtype.values()]

    def owned_range(self, numel: int, position: int) -> tuple[int, int]:
        """``[lo, hi)`` of a part's (padded) flat gradient that the rank at ``position`` of the group
        holds after the reduce-scatter (everything when not sharded)."""
        if not self.shard:
            return 0, numel
        n = numel // self.size
        return position * n, (position + 1) * n


def group_position(comm: Comm, axes: tuple[str, ...]) -> int:
    """This rank's position in the process group of ``axes`` (groups are built over sorted global
    ranks, and a reduce-scatter or all-gather orders pieces by it)."""
    return sorted(comm.grid.group_ranks(comm.rank, axes)).index(comm.rank)


BucketSize = float | Callable[[tuple[str, ...]], float]
"""A bucket limit: MiB for every group, or ``grad_sum axes -> bytes``
(:func:`axo4d.facts.schedule_rules.bucket_limit`: ``parallel.dp_bucket_mb``, 'auto' included)."""


def plan_buckets(
    params: Iterable[nn.Parameter], comm: Comm, bucket_mb: BucketSize, shard: bool = False, local: bool = False
) -> list[Bucket]:
    """The data-parallel buckets: per ``grad_sum`` axes (first-seen order), parameters in order,
    a bucket closed once it holds its group's limit (``bucket_mb``; the rule shared with the
    performance model: :func:`axo4d.facts.schedule_rules.plan_buckets`). Axes of one rank need none,
    unless ``local`` (their buckets only mark when gradients are final, for the bucket hooks);
    ``shard``: reduce-scatter instead of all-reduce (the sharded optimizer over the bucket's axes)."""
    limit = bucket_mb if callable(bucket_mb) else (lambda axes, b=max(1, int(bucket_mb * 2**20)): b)
    plist = list(params)
    items = [(i, tuple(placement_of(p).grad_sum), p.numel() * p.element_size()) for i, p in enumerate(plist)]
    out: list[Bucket] = []
    for axes, keys in _plan(items, limit):
        size = comm.size(axes)
        if size == 1 and not local:
            continue
        out.append(Bucket(axes, [plist[i] for i in keys], size, shard and size > 1))
    return out


def flat_by_dtype(
    params: list[nn.Parameter], multiple: int = 1, pool: BufferPool | None = None
) -> list[tuple[list[nn.Parameter], torch.Tensor]]:
    """The gradients of ``params`` as one flat tensor per dtype (zeros for a missing gradient),
    zero-padded to a multiple of ``multiple`` elements (the parts of :meth:`Bucket.flat_parts`);
    written into buffers of ``pool`` when given (give them back once the collective is done)."""
    by_dtype: dict[torch.dtype, list[nn.Parameter]] = {}
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        by_dtype.setdefault(p.grad.dtype, []).append(p)
    out = []
    for plist in by_dtype.values():
        n = sum(p.numel() for p in plist)
        pad = -n % multiple
        grads = [p.grad.reshape(-1) for p in plist]
        if pool is None:
            out.append((plist, torch.cat(grads + ([plist[0].grad.new_zeros(pad)] if pad else []))))
            continue
        flat = pool.take(n + pad, plist[0].grad.dtype, plist[0].grad.device)
        torch.cat(grads, out=flat[:n])
        flat[n:].zero_()
        out.append((plist, flat))
    return out


def runs_of(flats: list[torch.Tensor], lo: int, hi: int) -> list[torch.Tensor]:
    """Elements ``[lo, hi)`` of the concatenation of the flat tensors ``flats`` as runs of those
    tensors themselves (views, in order), then zeros for the padding past their end (the padded
    flat of :meth:`Bucket.flat_parts`): a bucket's piece without building its flat."""
    runs, off = [], 0
    for f in flats:
        n = f.numel()
        a, z = max(lo - off, 0), min(hi - off, n)
        if a < z:
            runs.append(f[a:z])
        off += n
    if hi > max(lo, off):
        runs.append(flats[0].new_zeros(hi - max(lo, off)))
    return runs


def other_range(lo: int, hi: int) -> tuple[int, int]:
    """The other rank's ``[lo, hi)`` of a part sharded over two ranks, given this rank's."""
    return (hi, 2 * hi - lo) if lo == 0 else (0, lo)


def grads_as_views(plist: list[nn.Parameter], flat: torch.Tensor) -> None:
    """Each parameter's ``.grad`` becomes its run of ``flat`` (the reduced bucket)."""
    off = 0
    for p in plist:
        p.grad = flat[off : off + p.numel()].view_as(p)
        off += p.numel()


__all__ = [
    "Bucket",
    "BucketSize",
    "group_position",
    "plan_buckets",
    "flat_by_dtype",
    "grads_as_views",
    "runs_of",
    "other_range",
]
