"""The overlapped schedule (:class:`OverlapSchedule`: prefetched weight gathers, background
reduce-scatters, data-parallel buckets reduced during backward; what runs behind what is described
in :mod:`axo4d.nn.schedule` and docs/overlap.md) and :func:`make_schedule`, which picks it or the
eager :class:`~axo4d.nn.schedule.Schedule`."""

from __future__ import annotations

import contextlib
import weakref
from collections import Counter, deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterable, Iterator

import torch
from torch import nn

from axo4d.dist.comm import Comm, Handle
from axo4d.dist.mappings import gather_features, scatter_features
from axo4d.facts.schedule_rules import DP_LAG, MAX_INFLIGHT_GATHERS, RS_LAG
from axo4d.nn.buckets import Bucket, BucketSize
from axo4d.nn.schedule import Schedule, ZLayer, weight_block

if TYPE_CHECKING:
    from axo4d.nn.fp8 import Fp8Tensor, WeightCast

    How = torch.dtype | WeightCast  # what a block is gathered in


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
        w = weight_block(layer, dtype, w, meta)
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

    def partial_gather(self, t: torch.Tensor, axes: str | tuple[str, ...], out: torch.Tensor):
        """Overlapped: the all-gather left in flight (the caller computes an earlier chunk, then waits)."""
        self.stats["gather_chunks"] += 1
        return gather_features(t, self.comm, axes, async_op=True, out=out)

    def partial_scatter(self, t: torch.Tensor, axes: str | tuple[str, ...]):
        """Overlapped: the reduce-scatter left in flight (the caller computes the next chunk, then waits)."""
        self.stats["chunks"] += 1
        return scatter_features(t, self.comm, axes, async_op=True)

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
    (:class:`Schedule`, the run plan's ``cache_layers``: :class:`axo4d.facts.run.RunFacts`)."""
    return (OverlapSchedule if overlap else Schedule)(comm, bucket_mb, shard, local_buckets, cache_layers)


__all__ = ["OverlapSchedule", "make_schedule"]
