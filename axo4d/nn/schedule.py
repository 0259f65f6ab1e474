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

**Overlapped** (:class:`OverlapSchedule`, docs/design.md section 3):

* *weight prefetch*: the schedule records the sequence of weight requests of a pass (forward,
  recompute and backward of one micro-step, or a forward without grad) and, from the second
  pass of the same kind on, issues the gather of request ``i+1`` (async) as soon as request
  ``i`` is served. Layer reuse (tied weights), activation checkpointing and any call order are
  whatever the recording saw. A gather that is not the one asked for, or whose weight changed
  since it was issued (version counter), is waited for and dropped (*stale*, counted); a pass
  that departs from its recording stops prefetching and is recorded anew.
* *background reduce-scatter*: a weight gradient's z reduce-scatter is left in flight and
  waited for when :data:`~axo4d.schedule_facts.RS_LAG` newer ones are (or at the end of backward); its piece is
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
import weakref
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Iterable, Iterator, Protocol

import torch
from torch import nn

from axo4d.dist.comm import Comm, Handle
from axo4d.dist.placement import placement_of
from axo4d.nn.weight_cache import WeightCache
from axo4d.schedule_facts import DP_LAG, MAX_INFLIGHT_GATHERS, RS_LAG
from axo4d.schedule_facts import plan_buckets as _plan

if TYPE_CHECKING:
    from axo4d.nn.fp8 import Fp8Tensor, WeightCast

    How = torch.dtype | WeightCast  # what a block is gathered in


class ZLayer(Protocol):
    """What a schedule needs of a layer whose weight is split over z."""

    weight: nn.Parameter
    index: int
    block_shape: tuple[int, int]


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
(:func:`axo4d.schedule_facts.bucket_limit`: ``parallel.dp_bucket_mb``, 'auto' included)."""


def plan_buckets(
    params: Iterable[nn.Parameter], comm: Comm, bucket_mb: BucketSize, shard: bool = False, local: bool = False
) -> list[Bucket]:
    """The data-parallel buckets: per ``grad_sum`` axes (first-seen order), parameters in order,
    a bucket closed once it holds its group's limit (``bucket_mb``; the rule shared with the
    performance model: :func:`axo4d.schedule_facts.plan_buckets`). Axes of one rank need none,
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


def _piece(layer: ZLayer, how, comm: Comm, peers: list) -> tuple[torch.Tensor, object]:
    """What this rank sends of ``layer``'s block: its weight piece in dtype ``how``, or cast to FP8
    by ``how`` (a :class:`~axo4d.nn.fp8.WeightCast`; ``peers``: the schedule's layers, whose weight
    scales are agreed together) with its scale."""
    if isinstance(how, torch.dtype):
        return layer.weight.detach().to(how), None
    return how.piece(layer, comm, peers)


def _block(layer: ZLayer, how, gathered: torch.Tensor, meta) -> torch.Tensor | Fp8Tensor:
    """The gathered pieces as ``layer``'s ``(N/G_out, K/G_in)`` block (FP8 with its scale)."""
    if isinstance(how, torch.dtype):
        return gathered.view(layer.block_shape)
    return how.block(gathered, layer.block_shape, meta)


def _flat_by_dtype(params: list[nn.Parameter], multiple: int = 1) -> list[tuple[list[nn.Parameter], torch.Tensor]]:
    """The gradients of ``params`` as one flat tensor per dtype (zeros for a missing gradient),
    zero-padded to a multiple of ``multiple`` elements (the parts of :meth:`Bucket.flat_parts`)."""
    by_dtype: dict[torch.dtype, list[nn.Parameter]] = {}
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        by_dtype.setdefault(p.grad.dtype, []).append(p)
    out = []
    for plist in by_dtype.values():
        n = sum(p.numel() for p in plist)
        pad = -n % multiple
        grads = [p.grad.reshape(-1) for p in plist] + ([plist[0].grad.new_zeros(pad)] if pad else [])
        out.append((plist, torch.cat(grads)))
    return out


def _grads_as_views(plist: list[nn.Parameter], flat: torch.Tensor) -> None:
    """Each parameter's ``.grad`` becomes its run of ``flat`` (the reduced bucket)."""
    off = 0
    for p in plist:
        p.grad = flat[off : off + p.numel()].view_as(p)
        off += p.numel()


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
            w = _block(layer, dtype, self.comm.all_gather(src, "z"), meta)
            self.cache.keep(layer.index, layer.weight, w, self.in_forward and not backward, dtype)
        return w

    def partial_sum(self, t: torch.Tensor, axes: str | tuple[str, ...]) -> Handle:
        """All-reduce ``t`` over ``axes`` (a row chunk of a layer's output): eager, done on return."""
        return Handle(None, self.comm.all_reduce(t, axes), "")

    def _source(self, layer: ZLayer, how: How) -> tuple[torch.Tensor, object]:
        """What this rank sends of ``layer``'s block, after the read hooks (:meth:`before_weight_read`)."""
        for fn in self._read_hooks:
            fn(layer, how)
        return _piece(layer, how, self.comm, self.layers)

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
        op = self.comm.reduce_scatter if b.shard else self.comm.all_reduce
        for plist, flat in _flat_by_dtype(b.params, b.size if b.shard else 1):
            for p in plist:  # the flat holds them now: no second copy while in flight
                p.grad = None
            b.parts.append((plist, flat, op(flat, b.axes, async_op=True)))

    def _land(self, b: Bucket) -> None:
        """Wait for ``b``'s reduction and put the sum in place (the gradients become views of the
        flat sum; sharded: only the owned slice is kept), then call the bucket hooks."""
        b.owned = []
        for plist, flat, h in b.parts:
            out = h.wait()
            if b.shard:
                b.owned.append(out)
            else:
                _grads_as_views(plist, flat)
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
        order (the overlapped schedule: during backward, :data:`~axo4d.schedule_facts.DP_LAG` buckets behind the newest
        issued one): read ``bucket.owned`` when it is sharded, else its parameters' ``.grad``."""
        self._bucket_hooks.append(fn)


@dataclass
class _Gather:
    handle: Handle
    src: torch.Tensor  # the input, kept alive while in flight
    request: tuple[int, str, How]
    version: int  # the weight's version counter at issue
    dtype: How
    meta: object = None  # an FP8 piece's scale


def _weak_hook(method: Callable[[torch.Tensor], None]) -> Callable[[torch.Tensor], None]:
    """``method`` as a tensor hook that holds its object weakly. A hook that holds the schedule,
    which holds the parameters, is a cycle through torch's C++ hook registry that Python's
    garbage collector cannot see: the model's weights and gradients would outlive it."""
    ref = weakref.WeakMethod(method)

    def hook(t: torch.Tensor) -> None:
        m = ref()
        if m is not None:
            m(t)

    return hook


class OverlapSchedule(Schedule):
    """Prefetched weight gathers, background reduce-scatters and data-parallel buckets."""

    overlapped = True

    def __init__(
        self,
        comm: Comm,
        bucket_mb: BucketSize = 25.0,
        shard: bool = False,
        local_buckets: bool = False,
        cache_layers: int = 0,
    ) -> None:
        super().__init__(comm, bucket_mb, shard, local_buckets, cache_layers)
        self._gathers: dict[int, _Gather] = {}  # request position -> gather in flight
        self._traces: dict[str, list[tuple[int, str, How]]] = {}
        self._kind: str | None = None  # the open pass: 'train', 'infer' or None
        self._rec: list[tuple[int, str, How]] = []
        self._follow = False  # the pass still matches its recording
        self.in_forward = False
        self._uses: Counter = Counter()  # forward uses of each layer in this pass
        self._fwd_uses: Counter = Counter()  # the same for every layer (z of one rank included)
        self._dw: list[tuple[ZLayer, Callable[[], torch.Tensor]]] = []  # deferred dW GEMMs
        self._deferred: set[int] = set()  # their weights: not final yet, whatever autograd's hook says
        self.sync = True
        self._queued = False
        self._rs: deque = deque()
        self._background: set[int] = set()
        self._bucket_of: dict[int, Bucket] = {}
        self._seqs: list[list[Bucket]] = []
        self._next: list[int] = []
        self._issued: list[Bucket] = []
        self._landed = 0  # how many of _issued were waited for

    def attach(self, params: Iterable[nn.Parameter]) -> None:
        super().attach(params)
        if self.comm.size("z") > 1:
            self._background = {id(m.weight) for m in self.layers}
        self._bucket_of = {id(p): b for b in self.buckets for p in b.params}
        seqs: dict[int, list[Bucket]] = {}
        for b in self.buckets:  # one fixed issue order per process group
            seqs.setdefault(id(self.comm.group(b.axes)), []).append(b)
        self._seqs = [list(reversed(s)) for s in seqs.values()]
        self._next = [0] * len(self._seqs)
        hook = _weak_hook(self._on_accumulated)  # a parameter must not keep its schedule alive
        for p in self._params or []:
            if id(p) not in self._background:
                p.register_post_accumulate_grad_hook(hook)

    # ---- passes -------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def forward_pass(self, training: bool) -> Iterator[None]:
        self._end_pass()
        if self._queued:  # the last backward pass did not complete (it raised)
            self._abandon_gradients()
        self._kind = "train" if training and torch.is_grad_enabled() else "infer"
        self.cache.open(training)
        self._rec, self._uses, self._fwd_uses = [], Counter(), Counter()
        self._follow = self._kind in self._traces
        self.in_forward = True
        try:
            yield
        finally:
            self.in_forward = False
            if self._kind == "infer":
                self._end_pass()

    def _end_pass(self) -> None:
        """Close the open pass: keep its recording if it differs from the stored one."""
        self._drain_gathers()
        if self._kind is not None and self._traces.get(self._kind) != self._rec:
            if self._kind in self._traces:
                self.stats["retraced"] += 1
            self._traces[self._kind] = list(self._rec)
        self._kind = None

    # ---- weight gathers -------------------------------------------------------------------------------
    def weight(self, layer: ZLayer, dtype: How, backward: bool) -> torch.Tensor | Fp8Tensor:
        if self.in_forward and self._kind == "train":
            self._fwd_uses[layer.index] += 1
        if self.comm.size("z") == 1:
            return super().weight(layer, dtype, backward)
        kept = None if self.in_forward else self.cache.take(layer.index, layer.weight, dtype, backward)
        if kept is not None:  # no gather: not recorded, nothing to prefetch
            return kept
        phase = "bwd" if backward else ("fwd" if self.in_forward else "rec")
        req, pos = (layer.index, phase, dtype), len(self._rec)
        self._rec.append(req)
        if phase == "fwd" and self._kind == "train":
            self._uses[layer.index] += 1
        trace = self._traces.get(self._kind or "") if self._follow else None
        if trace is not None and (pos >= len(trace) or trace[pos] != req):
            self._follow, trace = False, None  # departed from the recording: no more prefetch
            self._drain_gathers()
        got, w, meta = self._gathers.pop(pos, None), None, None
        if got is not None:
            w, meta = got.handle.wait(), got.meta
            if got.version != layer.weight._version or got.dtype != dtype:
                w = None
                self.stats["stale"] += 1
            else:
                self.stats["hits"] += 1
        if w is None:
            self.stats["sync"] += 1
            src, meta = self._source(layer, dtype)
            w = self.comm.all_gather(src, "z")
        if trace is not None and pos + 1 < len(trace) and pos + 1 not in self._gathers:
            self._prefetch(pos + 1, trace[pos + 1])
        w = _block(layer, dtype, w, meta)
        self.cache.keep(layer.index, layer.weight, w, phase == "fwd", dtype)
        return w

    def _prefetch(self, pos: int, req: tuple[int, str, How]) -> None:
        dtype = req[2]
        while len(self._gathers) >= MAX_INFLIGHT_GATHERS:
            self._gathers.pop(next(iter(self._gathers))).handle.wait()
            self.stats["stale"] += 1
        layer = self.layers[req[0]]
        src, meta = self._source(layer, dtype)
        h = self.comm.all_gather(src, "z", async_op=True)
        self._gathers[pos] = _Gather(h, src, req, layer.weight._version, dtype, meta)
        self.stats["prefetched"] += 1

    def _drain_gathers(self) -> None:
        """Wait for and drop every in-flight gather (none unless a prediction missed)."""
        while self._gathers:
            self._gathers.pop(next(iter(self._gathers))).handle.wait()
            self.stats["stale"] += 1

    # ---- gradients --------------------------------------------------------------------------------------
    def backward_step(self, layer: ZLayer) -> None:
        self._ensure_callback()
        self._drain_rs(RS_LAG)

    def weight_grad(self, layer: ZLayer, dw: torch.Tensor) -> torch.Tensor | None:
        if id(layer.weight) not in self._background:
            return super().weight_grad(layer, dw)
        self._rs.append((layer, self.comm.reduce_scatter(dw, "z", async_op=True)))
        return None

    def partial_sum(self, t: torch.Tensor, axes: str | tuple[str, ...]) -> Handle:
        """Overlapped: left in flight (the caller computes the next chunk, then waits)."""
        self.stats["chunks"] += 1
        return self.comm.all_reduce(t, axes, async_op=True)

    def defers_weight_grad(self, layer: ZLayer) -> bool:
        """A layer with no dX all-reduce of its own (its output axis of one rank) whose input axis is
        not of one rank (so the layers it alternates with, transposed the other way, have one),
        used once in the forward: its dW GEMM waits for the next layer whose dX all-reduce is in
        flight."""
        out_axis, in_axis = getattr(layer, "out_axis", None), getattr(layer, "in_axis", None)
        if out_axis is None or self.comm.size(out_axis) > 1 or self.comm.size(in_axis) == 1:
            return False
        return self._fwd_uses[layer.index] == 1

    def defer_weight_grad(self, layer: ZLayer, dw: Callable[[], torch.Tensor]) -> None:
        self._ensure_callback()
        self._dw.append((layer, dw))
        self._deferred.add(id(layer.weight))

    def behind_collective(self) -> None:
        """Run the deferred dW GEMMs; each gradient goes where autograd would have put it: its z
        reduce-scatter into the background, or accumulated into ``.grad`` (set, then ``add_``)."""
        while self._dw:
            layer, fn = self._dw.pop(0)
            self.stats["deferred_dw"] += 1
            self._deferred.discard(id(layer.weight))
            piece = self.weight_grad(layer, fn())
            if piece is not None:
                p = layer.weight
                if p.grad is None:
                    p.grad = piece
                else:
                    p.grad.add_(piece)
                self._final(p)

    def _drain_rs(self, keep: int) -> None:
        while len(self._rs) > keep:
            layer, h = self._rs.popleft()
            p = layer.weight
            piece = h.wait().view_as(p)
            if p.grad is None:
                p.grad = piece
            else:
                p.grad.add_(piece)
            self._uses[layer.index] -= 1
            if self._uses[layer.index] <= 0:  # the last use's piece: the gradient is whole
                self._final(p)

    def _on_accumulated(self, p: torch.Tensor) -> None:
        self._ensure_callback()
        if id(p) in self._deferred:  # autograd got no gradient for it (deferred): the hook fires regardless
            return
        self._final(p)

    def _ensure_callback(self) -> None:
        if not self._queued:
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
            self._queued = True

    def _final(self, p: torch.Tensor) -> None:
        """``p``'s gradient has all of this pass's contributions: maybe complete a bucket."""
        b = self._bucket_of.get(id(p))
        if not self.sync or b is None:
            return
        b.ready.add(id(p))
        self._issue_complete()

    def _issue_complete(self) -> None:
        for s, seq in enumerate(self._seqs):
            while self._next[s] < len(seq) and len(seq[self._next[s]].ready) == len(seq[self._next[s]].params):
                b = seq[self._next[s]]
                self._issue(b)
                self._issued.append(b)
                self._next[s] += 1
        # wait for a bucket once DP_LAG newer ones are in flight when it pays: bucket hooks (offload)
        # want its gradients early, and a sharded bucket's flat sum shrinks to its owned slice
        while (self._bucket_hooks or self.shard) and len(self._issued) - self._landed > DP_LAG:
            self._land(self._issued[self._landed])
            self._landed += 1

    def _abandon_gradients(self) -> None:
        """Forget the state of a backward pass that raised (its gradients are not usable)."""
        self._queued = False
        self._rs.clear()
        self._dw.clear()
        self._deferred.clear()
        for b in self.buckets:
            b.ready.clear()
            b.parts.clear()
            b.owned.clear()
        self._issued.clear()
        self._landed = 0
        self._next = [0] * len(self._seqs)

    def _end_of_backward(self) -> None:
        self._queued = False
        self.behind_collective()  # dW GEMMs no later all-reduce ran behind
        self._drain_rs(0)
        if self.sync:
            self._complete_sync()
        self._end_pass()

    def _complete_sync(self) -> None:
        """Issue what is left (parameters without a gradient count as zeros), wait, write back."""
        for b in self.buckets:
            b.ready.update(id(p) for p in b.params)
        self._issue_complete()
        for b in self._issued[self._landed :]:
            self._land(b)
        for b in self._issued:
            b.ready.clear()
        self._issued.clear()
        self._landed = 0
        self._next = [0] * len(self._seqs)
        for fn in self._callbacks:
            fn()

    # ---- public -------------------------------------------------------------------------------------------
    def finish(self) -> None:
        """Make sure nothing is in flight (a no-op after a completed synchronised backward)."""
        self._drain_gathers()
        self.behind_collective()
        self._drain_rs(0)
        if self._issued:
            self._complete_sync()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        prev, self.sync = self.sync, False
        try:
            yield
        finally:
            self.sync = prev


def make_schedule(
    comm: Comm,
    overlap: bool,
    bucket_mb: BucketSize = 25.0,
    shard: bool = False,
    local_buckets: bool = False,
    cache_layers: int = 0,
) -> Schedule:
    """The overlapped schedule when ``overlap`` (``parallel.overlap``), else the eager one;
    ``shard`` and ``local_buckets`` as in :func:`plan_buckets`; ``cache_layers``: weight caching
    (:class:`Schedule`, :func:`axo4d.nn.weight_cache.cache_layer_count`)."""
    return (OverlapSchedule if overlap else Schedule)(comm, bucket_mb, shard, local_buckets, cache_layers)


__all__ = [
    "Schedule",
    "OverlapSchedule",
    "Bucket",
    "plan_buckets",
    "group_position",
    "make_schedule",
]
