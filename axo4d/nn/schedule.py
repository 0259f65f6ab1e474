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
  waited for when :data:`RS_LAG` newer ones are (or at the end of backward); its piece is
  accumulated into ``weight.grad`` as autograd would (set, then ``add_``). A weight used ``u``
  times in a forward is final after its ``u``-th piece.
* *data-parallel buckets*: a bucket is all-reduced async once all its gradients are final, in a
  fixed order per process group; other parameters report through
  ``register_post_accumulate_grad_hook``. Under :meth:`no_sync` nothing is reduced over data. At
  the end of a synchronised backward pass (an autograd engine callback) everything is waited
  for and written back, then the :meth:`on_gradients_ready` callbacks run.

Decisions depend only on program order, never on timing, so every rank issues collectives on
every group in the same order. Supported: ``loss.backward()`` (not ``torch.autograd.grad``).
"""
from __future__ import annotations

import contextlib
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Iterable, Iterator, Protocol

import torch
from torch import nn

from axo4d.dist.comm import Comm, Handle
from axo4d.dist.placement import placement_of

if TYPE_CHECKING:
    pass

#: gathers in flight at once; reduce-scatters left in flight while a newer layer runs
MAX_INFLIGHT_GATHERS = 2
RS_LAG = 2


class ZLayer(Protocol):
    """What a schedule needs of a layer whose weight is split over z."""

    weight: nn.Parameter
    index: int
    block_shape: tuple[int, int]


@dataclass
class Bucket:
    """Parameters whose gradients are summed over ``axes`` in one flat all-reduce (per dtype)."""

    axes: tuple[str, ...]
    params: list[nn.Parameter]
    ready: set = field(default_factory=set)
    parts: list = field(default_factory=list)     # (params, flat, handle) per dtype once issued


def plan_buckets(params: Iterable[nn.Parameter], comm: Comm, bucket_mb: float) -> list[Bucket]:
    """The data-parallel buckets: per ``grad_sum`` axes (first-seen order), parameters in order,
    a bucket closed once it holds >= ``bucket_mb`` MiB; axes of one rank need none."""
    limit = max(1, int(bucket_mb * 2**20))
    by_axes: dict[tuple[str, ...], list[nn.Parameter]] = {}
    for p in params:
        by_axes.setdefault(tuple(placement_of(p).grad_sum), []).append(p)
    out: list[Bucket] = []
    for axes, plist in by_axes.items():
        if comm.size(axes) == 1:
            continue
        cur: list[nn.Parameter] = []
        nbytes = 0
        for p in plist:
            cur.append(p)
            nbytes += p.numel() * p.element_size()
            if nbytes >= limit:
                out.append(Bucket(axes, cur))
                cur, nbytes = [], 0
        if cur:
            out.append(Bucket(axes, cur))
    return out


def _flat_by_dtype(params: list[nn.Parameter]) -> list[tuple[list[nn.Parameter], torch.Tensor]]:
    """The gradients of ``params`` as one flat tensor per dtype (zeros for a missing gradient)."""
    by_dtype: dict[torch.dtype, list[nn.Parameter]] = {}
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        by_dtype.setdefault(p.grad.dtype, []).append(p)
    return [(plist, torch.cat([p.grad.reshape(-1) for p in plist])) for plist in by_dtype.values()]


def _write_back(plist: list[nn.Parameter], flat: torch.Tensor) -> None:
    off = 0
    for p in plist:
        n = p.grad.numel()
        p.grad.copy_(flat[off:off + n].view_as(p.grad))
        off += n


class Schedule:
    """The eager schedule: every collective issued when asked and waited for at once."""

    overlapped = False

    def __init__(self, comm: Comm, bucket_mb: float = 25.0) -> None:
        self.comm, self.bucket_mb = comm, bucket_mb
        self.layers: list[ZLayer] = []
        self.buckets: list[Bucket] = []
        self.stats: Counter = Counter()
        self._callbacks: list[Callable[[], None]] = []
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
        self.buckets = plan_buckets(self._params, self.comm, self.bucket_mb)

    # ---- forward ----------------------------------------------------------------------------------
    @contextlib.contextmanager
    def forward_pass(self, training: bool) -> Iterator[None]:
        """Around a model's forward (``training``: a backward is expected)."""
        yield

    def weight(self, layer: ZLayer, dtype: torch.dtype, backward: bool) -> torch.Tensor:
        """``layer``'s gathered ``(N/G_out, K/G_in)`` weight block in ``dtype``."""
        return self.comm.all_gather(layer.weight.to(dtype), "z").view(layer.block_shape)

    # ---- backward ---------------------------------------------------------------------------------
    def backward_step(self, layer: ZLayer) -> None:
        """Called as a layer's backward starts."""

    def weight_grad(self, layer: ZLayer, dw: torch.Tensor) -> torch.Tensor | None:
        """This rank's piece of ``dw`` summed over z, for autograd to accumulate; ``None`` when
        the schedule reduces it in the background and accumulates it itself."""
        return self.comm.reduce_scatter(dw, "z").view_as(layer.weight)

    def finish(self) -> None:
        """Make every gradient final: the bucketed data-parallel reduction, then the callbacks."""
        for b in self.buckets:
            for plist, flat in _flat_by_dtype(b.params):
                self.comm.all_reduce(flat, b.axes)
                _write_back(plist, flat)
        for fn in self._callbacks:
            fn()

    def no_sync(self) -> contextlib.AbstractContextManager:
        """Accumulation micro-steps: nothing is reduced over data before :meth:`finish` anyway."""
        return contextlib.nullcontext()

    def on_gradients_ready(self, fn: Callable[[], None]) -> None:
        """Call ``fn()`` each time all gradients of a step are final."""
        self._callbacks.append(fn)


@dataclass
class _Gather:
    handle: Handle
    src: torch.Tensor            # the input, kept alive while in flight
    request: tuple[int, str]
    version: int                 # the weight's version counter at issue
    dtype: torch.dtype


class OverlapSchedule(Schedule):
    """Prefetched weight gathers, background reduce-scatters and data-parallel buckets."""

    overlapped = True

    def __init__(self, comm: Comm, bucket_mb: float = 25.0) -> None:
        super().__init__(comm, bucket_mb)
        self._gathers: dict[int, _Gather] = {}           # request position -> gather in flight
        self._traces: dict[str, list[tuple[int, str]]] = {}
        self._kind: str | None = None                    # the open pass: 'train', 'infer' or None
        self._rec: list[tuple[int, str]] = []
        self._follow = False                             # the pass still matches its recording
        self.in_forward = False
        self._uses: Counter = Counter()                  # forward uses of each layer in this pass
        self.sync = True
        self._queued = False
        self._rs: deque = deque()
        self._background: set[int] = set()
        self._bucket_of: dict[int, Bucket] = {}
        self._seqs: list[list[Bucket]] = []
        self._next: list[int] = []
        self._issued: list[Bucket] = []

    def attach(self, params: Iterable[nn.Parameter]) -> None:
        super().attach(params)
        if self.comm.size("z") > 1:
            self._background = {id(m.weight) for m in self.layers}
        self._bucket_of = {id(p): b for b in self.buckets for p in b.params}
        seqs: dict[int, list[Bucket]] = {}
        for b in self.buckets:                      # one fixed issue order per process group
            seqs.setdefault(id(self.comm.group(b.axes)), []).append(b)
        self._seqs = [list(reversed(s)) for s in seqs.values()]
        self._next = [0] * len(self._seqs)
        for p in self._params or []:
            if id(p) not in self._background:
                p.register_post_accumulate_grad_hook(self._on_accumulated)

    # ---- passes -------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def forward_pass(self, training: bool) -> Iterator[None]:
        self._end_pass()
        if self._queued:                 # the last backward pass did not complete (it raised)
            self._abandon_gradients()
        self._kind = "train" if training and torch.is_grad_enabled() else "infer"
        self._rec, self._uses = [], Counter()
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
    def weight(self, layer: ZLayer, dtype: torch.dtype, backward: bool) -> torch.Tensor:
        if self.comm.size("z") == 1:
            return super().weight(layer, dtype, backward)
        phase = "bwd" if backward else ("fwd" if self.in_forward else "rec")
        req, pos = (layer.index, phase), len(self._rec)
        self._rec.append(req)
        if phase == "fwd" and self._kind == "train":
            self._uses[layer.index] += 1
        trace = self._traces.get(self._kind or "") if self._follow else None
        if trace is not None and (pos >= len(trace) or trace[pos] != req):
            self._follow, trace = False, None        # departed from the recording: no more prefetch
            self._drain_gathers()
        got, w = self._gathers.pop(pos, None), None
        if got is not None:
            w = got.handle.wait()
            if got.version != layer.weight._version or got.dtype != dtype:
                w = None
                self.stats["stale"] += 1
            else:
                self.stats["hits"] += 1
        if w is None:
            self.stats["sync"] += 1
            w = self.comm.all_gather(layer.weight.to(dtype), "z")
        if trace is not None and pos + 1 < len(trace) and pos + 1 not in self._gathers:
            self._prefetch(pos + 1, trace[pos + 1], dtype)
        return w.view(layer.block_shape)

    def _prefetch(self, pos: int, req: tuple[int, str], dtype: torch.dtype) -> None:
        while len(self._gathers) >= MAX_INFLIGHT_GATHERS:
            self._gathers.pop(next(iter(self._gathers))).handle.wait()
            self.stats["stale"] += 1
        w = self.layers[req[0]].weight
        src = w.detach().to(dtype)
        self._gathers[pos] = _Gather(self.comm.all_gather(src, "z", async_op=True), src, req, w._version, dtype)
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
            if self._uses[layer.index] <= 0:         # the last use's piece: the gradient is whole
                self._final(p)

    def _on_accumulated(self, p: torch.Tensor) -> None:
        self._ensure_callback()
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
                b.parts = [(plist, flat, self.comm.all_reduce(flat, b.axes, async_op=True))
                           for plist, flat in _flat_by_dtype(b.params)]
                self._issued.append(b)
                self._next[s] += 1

    def _abandon_gradients(self) -> None:
        """Forget the state of a backward pass that raised (its gradients are not usable)."""
        self._queued = False
        self._rs.clear()
        for b in self.buckets:
            b.ready.clear()
            b.parts.clear()
        self._issued.clear()
        self._next = [0] * len(self._seqs)

    def _end_of_backward(self) -> None:
        self._queued = False
        self._drain_rs(0)
        if self.sync:
            self._complete_sync()
        self._end_pass()

    def _complete_sync(self) -> None:
        """Issue what is left (parameters without a gradient count as zeros), wait, write back."""
        for b in self.buckets:
            b.ready.update(id(p) for p in b.params)
        self._issue_complete()
        for b in self._issued:
            for plist, flat, h in b.parts:
                h.wait()
                _write_back(plist, flat)
            b.parts.clear()
            b.ready.clear()
        self._issued.clear()
        self._next = [0] * len(self._seqs)
        for fn in self._callbacks:
            fn()

    # ---- public -------------------------------------------------------------------------------------------
    def finish(self) -> None:
        """Make sure nothing is in flight (a no-op after a completed synchronised backward)."""
        self._drain_gathers()
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


def make_schedule(comm: Comm, overlap: bool, bucket_mb: float = 25.0) -> Schedule:
    """The overlapped schedule when ``overlap`` (``parallel.overlap``), else the eager one."""
    return (OverlapSchedule if overlap else Schedule)(comm, bucket_mb)


__all__ = ["Schedule", "OverlapSchedule", "Bucket", "plan_buckets", "make_schedule", "MAX_INFLIGHT_GATHERS",
           "RS_LAG"]
