"""When collectives are issued and waited for: one interface, an eager and an overlapped schedule.

A model is built with one :class:`Schedule`; every layer whose weight is split over z asks it for
its gathered weight block (:meth:`Schedule.weight`) and hands it its weight gradient
(:meth:`Schedule.weight_grad`); the model opens each forward with :meth:`Schedule.forward_pass`;
the trainer ends a step with :meth:`Schedule.finish` (every gradient final, summed over z and
data) and wraps accumulation micro-steps in :meth:`Schedule.no_sync`. The two implementations
issue the same collectives with the same inputs in the same order on every process group, so
results and byte counts are identical; only *when* differs.

**Eager** (:class:`Schedule`): gather when asked, reduce-scatter when handed, and the bucketed
data-parallel reduction in :meth:`finish`.

**Overlapped** (:class:`~axo4d.nn.overlap_schedule.OverlapSchedule`, docs/design.md section 3):

* *weight prefetch*: the schedule records the sequence of weight requests of a pass (forward,
  recompute and backward of one micro-step, or a forward without grad) and, from the second
  pass of the same kind on, issues the gather of request ``i+1`` (async) as soon as request
  ``i`` is served. Layer reuse (tied weights), activation checkpointing and any call order are
  whatever the recording saw. A gather that is not the one asked for, or whose weight changed
  since it was issued (version counter), is waited for and dropped (*stale*, counted); a pass
  that departs from its recording stops prefetching and is recorded anew.
* *background reduce-scatter*: a weight gradient's z reduce-scatter is left in flight and
  waited for when :data:`~axo4d.facts.schedule_rules.RS_LAG` newer ones are (or at the end of backward); its piece is
  accumulated into ``weight.grad`` as autograd would (set, then ``add_``). A weight used ``u``
  times in a forward is final after its ``u``-th piece.
* *data-parallel buckets*: a bucket is all-reduced async once all its gradients are final, in a
  fixed order per process group; other parameters report through
  ``register_post_accumulate_grad_hook``. Under :meth:`no_sync` nothing is reduced over data. At
  the end of a synchronised backward pass (an autograd engine callback) everything is waited
  for and written back, then the :meth:`on_gradients_ready` callbacks run.

Both schedules: with ``shard`` (the sharded optimizer, ``parallel.shard_optimizer``) a bucket is
reduce-scattered instead of all-reduced, leaving each rank the slice of the sum whose optimizer
state it owns (:meth:`Bucket.owned_range`; the optimizer all-gathers the new weights); the same
bytes as the all-reduce. :meth:`Schedule.on_bucket_reduced` hooks see each bucket once it is
final and reduced (host offload copies its gradients out then); ``local_buckets`` plans buckets
over groups of one rank too, so that the hooks fire on any grid.

Both schedules, *weight caching* (``cache_layers``, ``parallel.cache_weights``): the gathered
block of each cached layer is kept from its forward until its backward, which is served from it,
as is the recompute of a checkpointed block, so those z all-gathers disappear
(:mod:`axo4d.nn.weight_cache`).

Both schedules, *FP8 blocks*: a layer that runs FP8 GEMMs asks for its block with a
:class:`~axo4d.nn.fp8.WeightCast` instead of a dtype: each z piece is cast to FP8 before the
gather (its scale agreed over the weight's ranks, a few bytes), 1 byte an element is gathered,
and the block comes back as an :class:`~axo4d.nn.fp8.Fp8Tensor` (prefetched and cached alike).

Decisions depend only on program order, never on timing, so every rank issues collectives on
every group in the same order. Supported: ``loss.backward()`` (not ``torch.autograd.grad``).
"""

from __future__ import annotations

import contextlib
from collections import Counter
from typing import TYPE_CHECKING, Callable, Iterable, Iterator, Protocol

import torch
from torch import nn

from axo4d.dist.comm import Comm, Handle
from axo4d.dist.mappings import Done, gather_features, scatter_features
from axo4d.nn.buckets import (
    Bucket,
    BucketSize,
    flat_by_dtype,
    grads_as_views,
    group_position,
    other_range,
    plan_buckets,
    runs_of,
)
from axo4d.nn.weight_cache import WeightCache

if TYPE_CHECKING:
    from axo4d.nn.fp8 import Fp8Tensor, WeightCast

    How = torch.dtype | WeightCast  # what a block is gathered in


class ZLayer(Protocol):
    """What a schedule needs of a layer whose weight is split over z."""

    weight: nn.Parameter
    index: int
    block_shape: tuple[int, int]


def weight_piece(layer: ZLayer, how, comm: Comm, peers: list) -> tuple[torch.Tensor, object]:
    """What this rank sends of ``layer``'s block: its weight piece in dtype ``how``, or cast to FP8
    by ``how`` (a :class:`~axo4d.nn.fp8.WeightCast`; ``peers``: the schedule's layers, whose weight
    scales are agreed together) with its scale."""
    if isinstance(how, torch.dtype):
        return layer.weight.detach().to(how), None
    return how.piece(layer, comm, peers)


def weight_block(layer: ZLayer, how, gathered: torch.Tensor, meta) -> torch.Tensor | Fp8Tensor:
    """The gathered pieces as ``layer``'s ``(N/G_out, K/G_in)`` block (FP8 with its scale)."""
    if isinstance(how, torch.dtype):
        return gathered.view(layer.block_shape)
    return how.block(gathered, layer.block_shape, meta)


class Schedule:
    """The eager schedule: every collective issued when asked and waited for at once.

    ``cache_layers``: keep the gathered blocks of the last this many registered layers from
    forward for backward (:mod:`axo4d.nn.weight_cache`); 0 = none.
    """

    overlapped = False

    def __init__(
        self,
        comm: Comm,
        bucket_mb: BucketSize = 25.0,
        shard: bool = False,
        local_buckets: bool = False,
        cache_layers: int = 0,
    ) -> None:
        self.comm, self.bucket_mb = comm, bucket_mb
        self.cache = WeightCache(cache_layers)
        self.in_forward = False
        self.shard, self.local_buckets = shard, local_buckets  # see plan_buckets
        self.layers: list[ZLayer] = []
        self.buckets: list[Bucket] = []
        self.stats: Counter = Counter()
        self._callbacks: list[Callable[[], None]] = []
        self._bucket_hooks: list[Callable[[Bucket], None]] = []
        self._read_hooks: list[Callable[[ZLayer, How], None]] = []
        self._params: list[nn.Parameter] | None = None

    # ---- set-up --------------------------------------------------------------------------------
    def register(self, layer: ZLayer) -> int:
        """A layer announces itself at construction; returns its id in this schedule."""
        if self._params is not None:
            raise RuntimeError("register layers before attach(): the schedule is already attached")
        self.layers.append(layer)
        return len(self.layers) - 1

    def attach(self, params: Iterable[nn.Parameter]) -> None:
        """Plan the gradient buckets of the model's parameters (once, after construction)."""
        if self._params is not None:
            raise RuntimeError("this schedule is attached to a model already: build one schedule per model")
        self._params = list(params)
        self.buckets = plan_buckets(self._params, self.comm, self.bucket_mb, self.shard, self.local_buckets)
        self.cache.plan(len(self.layers), self.comm.size("z"))

    # ---- forward ----------------------------------------------------------------------------------
    @contextlib.contextmanager
    def forward_pass(self, training: bool) -> Iterator[None]:
        """Around a model's forward (``training``: a backward is expected)."""
        self.cache.open(training)
        self.in_forward = True
        try:
            yield
        finally:
            self.in_forward = False

    def weight(self, layer: ZLayer, dtype: How, backward: bool) -> torch.Tensor | Fp8Tensor:
        """``layer``'s gathered ``(N/G_out, K/G_in)`` weight block in ``dtype`` (or in FP8 by a
        :class:`~axo4d.nn.fp8.WeightCast`: an :class:`~axo4d.nn.fp8.Fp8Tensor`); a cached layer's
        recompute and backward get the block kept from its forward."""
        w = None if self.in_forward else self.cache.take(layer.index, layer.weight, dtype, backward)
        if w is None:
            src, meta = self._source(layer, dtype)
            w = weight_block(layer, dtype, self.comm.all_gather(src, "z"), meta)
            self.cache.keep(layer.index, layer.weight, w, self.in_forward and not backward, dtype)
        return w

    def partial_sum(self, t: torch.Tensor, axes: str | tuple[str, ...]) -> Handle:
        """All-reduce ``t`` over ``axes`` (a row chunk of a layer's output): eager, done on return."""
        return Handle(None, self.comm.all_reduce(t, axes), "")

    def partial_gather(self, t: torch.Tensor, axes: str | tuple[str, ...], out: torch.Tensor):
        """All-gather ``t``'s features over ``axes`` into ``out`` (a row chunk of a layer's input):
        eager, done on return; ``wait()`` gives ``out``."""
        return Done(gather_features(t, self.comm, axes, out=out))

    def partial_scatter(self, t: torch.Tensor, axes: str | tuple[str, ...]):
        """Reduce-scatter ``t`` over ``axes`` along its features (a row chunk of a layer's output):
        eager, done on return; ``wait()`` gives this rank's feature block."""
        return Done(scatter_features(t, self.comm, axes))

    def _source(self, layer: ZLayer, how: How) -> tuple[torch.Tensor, object]:
        """What this rank sends of ``layer``'s block, after the read hooks (:meth:`before_weight_read`)."""
        for fn in self._read_hooks:
            fn(layer, how)
        return weight_piece(layer, how, self.comm, self.layers)

    # ---- backward ---------------------------------------------------------------------------------
    def backward_step(self, layer: ZLayer) -> None:
        """Called as a layer's backward starts."""

    def defers_weight_grad(self, layer: ZLayer) -> bool:
        """Whether ``layer``'s dW GEMM is left for a later layer's window (:meth:`defer_weight_grad`)."""
        return False

    def defer_weight_grad(self, layer: ZLayer, dw: Callable[[], torch.Tensor]) -> None:
        """Keep ``dw()`` (``layer``'s weight gradient GEMM) for :meth:`behind_collective`."""
        raise RuntimeError("the eager schedule computes every weight gradient at once")

    def behind_collective(self) -> None:
        """A layer's backward has a collective in flight (its dX all-reduce): run the deferred dW
        GEMMs behind it."""

    def weight_grad(self, layer: ZLayer, dw: torch.Tensor) -> torch.Tensor | None:
        """This rank's piece of ``dw`` summed over z, for autograd to accumulate; ``None`` when
        the schedule reduces it in the background and accumulates it itself."""
        return self.comm.reduce_scatter(dw, "z").view_as(layer.weight)

    def finish(self) -> None:
        """Make every gradient final: the bucketed data-parallel reduction, then the callbacks."""
        for b in self.buckets:
            self._issue(b)
            self._land(b)
        for fn in self._callbacks:
            fn()

    def _issue(self, b: Bucket) -> None:
        """Start ``b``'s reduction: one flat all-reduce (or reduce-scatter) per dtype part."""
        b.parts = []
        if b.size == 1:
            return
        if b.shard and self.comm.is_pair(b.axes, b.params[0]):  # two gloo ranks: straight from the gradients
            self._issue_pair(b)
            return
        op = self.comm.reduce_scatter if b.shard else self.comm.all_reduce
        pool = self.comm.buffers if b.shard else None  # all-reduced: the gradients become views of the flat
        for plist, flat in flat_by_dtype(b.params, b.size if b.shard else 1, pool):
            for p in plist:  # the flat holds them now: no second copy while in flight
                p.grad = None
            b.parts.append((plist, flat, op(flat, b.axes, async_op=True)))

    def _issue_pair(self, b: Bucket) -> None:
        """:meth:`_issue` of a sharded bucket over two gloo ranks: each part's reduce-scatter sends
        the peer's half from the gradients themselves and adds this rank's half to what comes back
        (:meth:`Comm.reduce_scatter_runs`), with no flat built."""
        pos = group_position(self.comm, b.axes)
        for plist, numel in b.flat_parts():
            grads = [(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in plist]
            lo, hi = b.owned_range(numel, pos)
            h = self.comm.reduce_scatter_runs(runs_of(grads, lo, hi), runs_of(grads, *other_range(lo, hi)), b.axes)
            for p in plist:  # the exchange holds what it reads
                p.grad = None
            b.parts.append((plist, None, h))

    def _land(self, b: Bucket) -> None:
        """Wait for ``b``'s reduction and put the sum in place (the gradients become views of the
        flat sum; sharded: only the owned slice is kept), then call the bucket hooks."""
        b.owned = []
        for plist, flat, h in b.parts:
            out = h.wait()
            if b.shard:
                b.owned.append(out)
                if flat is not None:
                    self.comm.buffers.give(flat)
            else:
                grads_as_views(plist, flat)
        b.parts = []
        for fn in self._bucket_hooks:
            fn(b)

    def no_sync(self) -> contextlib.AbstractContextManager:
        """Accumulation micro-steps: nothing is reduced over data before :meth:`finish` anyway."""
        return contextlib.nullcontext()

    def on_gradients_ready(self, fn: Callable[[], None]) -> None:
        """Call ``fn()`` each time all gradients of a step are final (with ``shard``, a bucket's
        parameters have no ``.grad`` then: their sum is in the buckets' ``owned`` slices)."""
        self._callbacks.append(fn)

    # ---- what an optimizer sees of the buckets (the sharded optimizer, offload) -------------------
    def bucket_plan(self) -> tuple[Bucket, ...]:
        """The gradient buckets planned at :meth:`attach`, in order; their ``axes``, ``params``,
        ``size``, ``shard``, :meth:`~Bucket.flat_parts` and :meth:`~Bucket.owned_range` are fixed."""
        return tuple(self.buckets)

    def reduced_slice(self, b: Bucket, part: int) -> torch.Tensor | None:
        """Sharded bucket ``b``'s reduced slice of dtype part ``part`` owned by this rank, once this
        step's reduction landed (``None`` before, or after :meth:`release_gradients`)."""
        return b.owned[part] if b.owned else None

    def release_gradients(self) -> None:
        """Forget the reduced slices of the step (the optimizer's ``zero_grad``)."""
        for b in self.buckets:
            b.owned = []

    def before_weight_read(self, fn: Callable[[ZLayer, How], None]) -> None:
        """Call ``fn(layer, how)`` before ``layer``'s weight piece is read for its gather over z
        (also a prefetch ahead of the layer's own forward; ``how``: a dtype, or an FP8 cast that
        reads every layer's weight for the scales): the sharded optimizer waits there for the
        weight's all-gather over data (:meth:`axo4d.training.optim.sharded.ShardedAdamW.step`)."""
        self._read_hooks.append(fn)

    def on_bucket_reduced(self, fn: Callable[[Bucket], None]) -> None:
        """Call ``fn(bucket)`` each time a bucket's gradients are final and reduced, in a fixed
        order (the overlapped schedule: during backward,
        :data:`~axo4d.facts.schedule_rules.DP_LAG` buckets behind the newest issued one): read
        ``bucket.owned`` when it is sharded, else its parameters' ``.grad``."""
        self._bucket_hooks.append(fn)


__all__ = ["Schedule", "ZLayer", "Bucket", "BucketSize", "plan_buckets", "group_position"]
