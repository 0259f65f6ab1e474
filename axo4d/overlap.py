"""Overlap of communication with compute (DESIGN.md section 3), owned by the model.

:class:`Overlap` knows a model's :class:`~axo4d.layers.Linear3D` layers in call order
and the buckets of its data-parallel gradient reduction. It changes *when* collectives
are issued and waited for, never which: the same calls of the same sizes as without
overlap, so byte and call counters are unchanged and results are bit-identical.

**Weight prefetch.** Every z all-gather of a weight block goes through :meth:`Overlap.gather`.
Once a layer has its block it issues (async) the gather the model will ask for next:

* forward: the next layer's; after the last layer, its own backward gather (when grad is
  enabled in training mode, i.e. a backward is expected);
* backward: the previous layer's; with activation checkpointing, when the previous layer
  lies in another checkpointed block, the first layer of that block (its recompute);
* recompute (a checkpointed block re-running its forward inside backward): the next layer of
  the block; after the block's last layer, that layer's backward gather.

A request finds its gather in flight (a *hit*), or gathers synchronously (the model's first
layer, or after a mismatch). An in-flight gather that is not the one asked for, or whose
weight changed since it was issued (version counter), is waited for and dropped (*stale*;
counted, never silently used). At most two gathers are in flight.

**Background gradient reduction.** With G_z > 1 a Linear3D's backward hands its dW to
:meth:`reduce_scatter_background` and returns no weight gradient; the reduce-scatter is waited
for when two newer ones are in flight (or at the end of backward) and its piece accumulated into
``weight.grad`` exactly as autograd would (set, then ``add_``). Other parameters report through
``register_post_accumulate_grad_hook``. A data-parallel bucket (the same buckets as
:func:`axo4d.grads.reduce_gradients`) is all-reduced async once all its gradients are final,
in a fixed order per process group. Under :meth:`no_sync` (gradient accumulation) nothing is
reduced over data. At the end of a synchronised backward pass (an autograd engine callback) all
reductions are waited for, the gradients written back, and the ``on_gradients_ready``
callbacks run: once ``loss.backward()`` returns, every gradient is final.

Every issue and wait happens at a program point (layer order, autograd order, fixed lags),
never on timing, so all ranks issue collectives on every group in the same order.
Supported: ``loss.backward()`` (not ``torch.autograd.grad``) on one model at a time.
"""
from __future__ import annotations

import contextlib
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch
from torch import nn

from axo4d.comm import Comm, Handle
from axo4d.layers import Linear3D
from axo4d.sharding import get_sharding

#: gathers in flight at once; reduce-scatters left in flight while a newer layer runs
MAX_INFLIGHT_GATHERS = 2
RS_LAG = 2


@dataclass
class _Gather:
    handle: Handle
    src: torch.Tensor            # the input, kept alive while in flight
    version: int                 # the weight's version counter at issue
    dtype: torch.dtype


@dataclass
class Bucket:
    """Parameters whose gradients are summed over ``axes`` in one flat all-reduce (per dtype)."""
    axes: tuple[str, ...]
    params: list[nn.Parameter]
    ready: set = field(default_factory=set)
    parts: list = field(default_factory=list)     # (params, flat, handle) per dtype once issued


def plan_buckets(params: list[nn.Parameter], comm: Comm, bucket_mb: float) -> list[Bucket]:
    """The buckets of :func:`axo4d.grads.reduce_gradients`: per ``grad_sum`` axes (first-seen
    order), parameters in order, a bucket closed once it holds >= ``bucket_mb`` MiB."""
    limit = max(1, int(bucket_mb * 2**20))
    by_axes: dict[tuple[str, ...], list[nn.Parameter]] = {}
    for p in params:
        by_axes.setdefault(tuple(get_sharding(p).grad_sum), []).append(p)
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


class Overlap:
    """Prefetch and background-reduction scheduler of one model (see the module docstring)."""

    def __init__(self, model: nn.Module, comm: Comm, *, checkpointing: bool = False,
                 bucket_mb: float = 25.0) -> None:
        self.comm, self.checkpointing = comm, checkpointing
        self.layers: list[Linear3D] = []
        self.block: list[int | None] = []           # checkpointed block of each layer (None: none)
        for name, m in model.named_modules():
            if isinstance(m, Linear3D):
                m.overlap, m.index = self, len(self.layers)
                self.layers.append(m)
                parts = name.split(".")
                self.block.append(int(parts[1]) if parts[0] == "blocks" and len(parts) > 1 else None)
        self.first_of_block = {}
        for i, b in enumerate(self.block):
            self.first_of_block.setdefault(b, i)
        self.stats: Counter = Counter()
        self._gathers: dict[tuple[int, str], _Gather] = {}
        self.in_forward = self._recompute = self._expect_backward = False
        # gradients
        self.sync = True
        self._callbacks: list[Callable[[], None]] = []
        self._queued = False
        self._rs: deque = deque()
        self._background = {id(m.weight) for m in self.layers} if comm.size("z") > 1 else set()
        self.buckets = plan_buckets(list(model.parameters()), comm, bucket_mb)
        self._bucket_of = {id(p): b for b in self.buckets for p in b.params}
        seqs: dict[int, list[Bucket]] = {}
        for b in self.buckets:                      # one fixed issue order per process group
            seqs.setdefault(id(comm.group(b.axes)), []).append(b)
        self._seqs = [list(reversed(s)) for s in seqs.values()]
        self._next = [0] * len(self._seqs)
        self._issued: list[Bucket] = []
        for p in model.parameters():
            if id(p) not in self._background:
                p.register_post_accumulate_grad_hook(self._on_accumulated)

    # ---- forward / recompute / backward phases -----------------------------------------
    def begin_forward(self, training: bool) -> None:
        """Called by the model as its forward starts (``training``: a backward is expected)."""
        self._drain_gathers()
        if self._queued:                 # the last backward pass did not complete (it raised)
            self._abandon_gradients()
        self.in_forward = True
        self._expect_backward = training and torch.is_grad_enabled()
        self._recompute = self.checkpointing and self._expect_backward

    def end_forward(self) -> None:
        self.in_forward = False

    def _next_request(self, i: int, phase: str) -> tuple[int, str] | None:
        """The gather the model asks for after layer ``i``'s ``phase`` gather."""
        n, blk = len(self.layers), self.block
        if phase == "fwd":
            if i + 1 < n:
                return i + 1, "fwd"
            return (i, "bwd") if self._expect_backward else None
        if phase == "rec":
            return (i + 1, "rec") if i + 1 < n and blk[i + 1] == blk[i] else (i, "bwd")
        if i == 0:
            return None
        j = i - 1
        if self._recompute and blk[j] is not None and blk[j] != blk[i]:
            return self.first_of_block[blk[j]], "rec"
        return j, "bwd"

    # ---- weight gathers -----------------------------------------------------------------
    def gather(self, lin: Linear3D, dtype: torch.dtype, backward: bool) -> torch.Tensor:
        """``lin``'s gathered ``(N/G_out, K/G_in)`` block in ``dtype``; prefetches the next one."""
        phase = "bwd" if backward else ("fwd" if self.in_forward else "rec")
        key = (lin.index, phase)
        got = self._gathers.pop(key, None)
        w = None
        if got is not None:
            w = got.handle.wait()
            if got.version != lin.weight._version or got.dtype != dtype:
                w = None
                self.stats["stale"] += 1
            else:
                self.stats["hits"] += 1
        if w is None:
            self.stats["sync"] += 1
            w = self.comm.all_gather(lin.weight.to(dtype), "z")
        nxt = self._next_request(lin.index, phase)
        if nxt is not None and nxt not in self._gathers:
            self._prefetch(nxt, dtype)
        return w.view(lin.block_shape)

    def _prefetch(self, key: tuple[int, str], dtype: torch.dtype) -> None:
        while len(self._gathers) >= MAX_INFLIGHT_GATHERS:
            old = next(iter(self._gathers))
            self._gathers.pop(old).handle.wait()
            self.stats["stale"] += 1
        w = self.layers[key[0]].weight
        src = w.detach().to(dtype)
        self._gathers[key] = _Gather(self.comm.all_gather(src, "z", async_op=True), src, w._version, dtype)
        self.stats["prefetched"] += 1

    def _drain_gathers(self) -> None:
        """Wait for and drop every in-flight gather (none unless a prediction missed)."""
        while self._gathers:
            self._gathers.pop(next(iter(self._gathers))).handle.wait()
            self.stats["stale"] += 1

    # ---- gradients --------------------------------------------------------------------------
    def enter_backward(self) -> None:
        """Called as each Linear3D backward starts: end-of-pass callback, reduce-scatter lag."""
        self._ensure_callback()
        self._drain_rs(RS_LAG)

    def reduce_scatter_background(self, lin: Linear3D, dw: torch.Tensor) -> None:
        """Issue the z reduce-scatter of ``lin``'s weight gradient; accumulated when waited for."""
        self._rs.append((lin.weight, self.comm.reduce_scatter(dw, "z", async_op=True)))

    def _drain_rs(self, keep: int) -> None:
        while len(self._rs) > keep:
            p, h = self._rs.popleft()
            piece = h.wait().view_as(p)
            if p.grad is None:
                p.grad = piece
            else:
                p.grad.add_(piece)
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
                self._issue(seq[self._next[s]])
                self._next[s] += 1

    def _issue(self, b: Bucket) -> None:
        by_dtype: dict[torch.dtype, list] = {}
        for p in b.params:
            by_dtype.setdefault(p.grad.dtype, []).append(p)
        for plist in by_dtype.values():
            flat = torch.cat([p.grad.reshape(-1) for p in plist])
            b.parts.append((plist, flat, self.comm.all_reduce(flat, b.axes, async_op=True)))
        self._issued.append(b)

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

    def _complete_sync(self) -> None:
        """Issue what is left (parameters without a gradient count as zeros), wait, write back."""
        for b in self.buckets:
            for p in b.params:
                if id(p) not in b.ready:
                    if p.grad is None:
                        p.grad = torch.zeros_like(p)
                    b.ready.add(id(p))
        self._issue_complete()
        for b in self._issued:
            for plist, flat, h in b.parts:
                h.wait()
                off = 0
                for p in plist:
                    n = p.grad.numel()
                    p.grad.copy_(flat[off:off + n].view_as(p.grad))
                    off += n
            b.parts.clear()
            b.ready.clear()
        self._issued.clear()
        self._next = [0] * len(self._seqs)
        for fn in self._callbacks:
            fn()

    # ---- public API ---------------------------------------------------------------------------
    def finish(self) -> None:
        """Make sure nothing is in flight (a no-op after a completed backward pass)."""
        self._drain_gathers()
        self._drain_rs(0)
        if self._issued:
            self._complete_sync()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate gradients without the data-parallel reduction."""
        prev, self.sync = self.sync, False
        try:
            yield
        finally:
            self.sync = prev

    def on_gradients_ready(self, fn: Callable[[], None]) -> None:
        """Call ``fn()`` each time all gradients are final (end of a synchronised backward)."""
        self._callbacks.append(fn)
