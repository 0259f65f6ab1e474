"""How the implementation schedules its collectives, as the numbers (and the bucket rule) that the
schedule (:mod:`axo4d.nn.schedule`), the sharded optimizer (:mod:`axo4d.training.optim.sharded`),
the memory model (:mod:`axo4d.facts.memory`) and the performance model (:mod:`perfmodel.timeline`)
share. Defined here once; each of them imports them from here.

**Data-parallel buckets** (``parallel.dp_bucket_mb``). Gradients are summed over data (and, for
parameters replicated over z, over ``(z, data)``) in flat buckets, in parameter order, one
sequence per group (:func:`plan_buckets`: a bucket is closed once it holds at least its group's
limit). A bucket is reduced once all its gradients are final, so the first reduction starts when
the first bucket's parameters (the last ones of the model) are done in backward, and the last
bucket's reduction (the first parameters) is exposed after backward; with the sharded optimizer
the first bucket's weight all-gather is likewise exposed before the next forward. ``'auto'``
(:func:`bucket_limits`) sizes them from the model and the grid, per group:

    limit = clamp(block_bytes / BUCKETS_PER_BLOCK,  MIN_BUCKET_BYTES x group size,  MAX_BUCKET_BYTES)

``block_bytes``: one block's gradient bytes on a rank in that group. About
:data:`BUCKETS_PER_BLOCK` buckets a block: the first reduction starts a quarter of a block into
backward and one bucket (a quarter block) is left exposed at each end, not the whole gradient. The
floor grows with the group (Megatron-LM's rule of 1M elements per data-parallel rank): a ring
all-reduce pays ``2(p-1)`` latencies, so a bucket must carry more bytes as the group grows for
the latency to stay a small part of it; the cap is the former fixed size (PyTorch DDP's 25 MiB).
A number instead of ``'auto'`` is one limit in MiB for every group.
"""

from __future__ import annotations

import math
from typing import Callable, Hashable, Iterable, TypeVar

from axo4d.config import parse_bucket_mb

#: z all-gathers of weight blocks in flight at once (the overlapped schedule's prefetch depth)
MAX_INFLIGHT_GATHERS = 2
#: z reduce-scatters of weight gradients left in flight while newer layers run backward
RS_LAG = 2
#: data-parallel buckets in flight before the oldest is waited for (with bucket hooks or sharding)
DP_LAG = 2
#: all-gathers of updated weights in flight at once after a sharded optimizer step (per process group)
OPTIM_INFLIGHT_GATHERS = 2
#: 'auto' buckets: about this many per block (see the module docstring)
BUCKETS_PER_BLOCK = 4
#: 'auto' buckets: at least this many bytes per rank of the group
MIN_BUCKET_BYTES = 2**20
#: 'auto' buckets: at most this many bytes
MAX_BUCKET_BYTES = 25 * 2**20

K = TypeVar("K", bound=Hashable)
Axes = tuple[str, ...]


def auto_bucket_bytes(block_bytes: float, group_size: int) -> float:
    """The 'auto' limit of one group (module docstring)."""
    floor = MIN_BUCKET_BYTES * max(1, group_size)
    return float(min(MAX_BUCKET_BYTES, max(floor, block_bytes / BUCKETS_PER_BLOCK)))


def bucket_limit(setting: str | float, spec, elem_bytes: float = 4.0) -> Callable[[Axes], float]:
    """``grad_sum axes -> bytes`` for :func:`plan_buckets`: ``setting`` (``parallel.dp_bucket_mb``)
    in MiB for every group, or 'auto' from each group's gradient bytes in one block of ``spec``
    (an :class:`axo4d.facts.spec.ModelSpec`: the model on its grid; ``elem_bytes`` per element, as the
    buckets are planned) and the group's size (module docstring)."""
    mb = parse_bucket_mb(setting)
    if mb is not None:
        fixed = max(1.0, float(int(mb * 2**20)))
        return lambda axes: fixed
    grid, block = spec.grid, {}
    for part in spec.block:
        for pl in part.placements().values():
            n = math.prod(pl.full_shape) / (grid.size(*pl.split) if pl.split else 1)
            key = frozenset(pl.grad_sum)
            block[key] = block.get(key, 0.0) + n * elem_bytes
    return lambda axes: auto_bucket_bytes(block.get(frozenset(axes), 0.0), grid.size(*axes))


def largest_bucket_limit(setting: str | float, spec, elem_bytes: float = 4.0) -> float:
    """The largest limit over ``spec``'s gradient groups (the memory model's bucket size)."""
    limit = bucket_limit(setting, spec, elem_bytes)
    groups = {tuple(pl.grad_sum) for _, pl, _ in spec.placements()}
    return max((limit(axes) for axes in groups), default=float(MAX_BUCKET_BYTES))


def plan_buckets(items: Iterable[tuple[K, Axes, float]], limit: Callable[[Axes], float]) -> list[tuple[Axes, list[K]]]:
    """Buckets of ``(key, grad_sum axes, bytes)`` items in order: one sequence per axes (first-seen
    order of the axes), a bucket closed once it holds ``>= limit(axes)`` bytes; ``(axes, keys)``
    per bucket, the groups' sequences one after the other."""
    by_axes: dict[Axes, list[tuple[K, float]]] = {}
    for key, axes, nbytes in items:
        by_axes.setdefault(tuple(axes), []).append((key, nbytes))
    out: list[tuple[Axes, list[K]]] = []
    for axes, group in by_axes.items():
        cap = limit(axes)
        cur: list[K] = []
        total = 0.0
        for key, nbytes in group:
            cur.append(key)
            total += nbytes
            if total >= cap:
                out.append((axes, cur))
                cur, total = [], 0.0
        if cur:
            out.append((axes, cur))
    return out


__all__ = [
    "MAX_INFLIGHT_GATHERS",
    "RS_LAG",
    "DP_LAG",
    "OPTIM_INFLIGHT_GATHERS",
    "BUCKETS_PER_BLOCK",
    "MIN_BUCKET_BYTES",
    "MAX_BUCKET_BYTES",
    "parse_bucket_mb",
    "auto_bucket_bytes",
    "bucket_limit",
    "largest_bucket_limit",
    "plan_buckets",
]
