"""AdamW over the parts of the parameters this rank owns: the sharded optimizer over data (ZeRO-1,
Megatron's distributed optimizer) and host offload (docs/design.md section 9).

The model's schedule plans the gradient buckets (:func:`axo4d.nn.buckets.plan_buckets`). With
``parallel.shard_optimizer`` a bucket is reduce-scattered over its axes (``data``; ``z, data`` for
replicated parameters) instead of all-reduced, so each rank of the group holds the sum of one
``1/G`` slice of the bucket (:meth:`~axo4d.nn.buckets.Bucket.owned_range`). A :class:`Segment`
is the run of one parameter's flat local piece inside this rank's slice (the whole piece when
the bucket is not sharded, or the parameter is in none). :class:`ShardedAdamW` keeps the fp32
master weights and both Adam moments of its segments only, and per step:

1. :meth:`~ShardedAdamW.grad_norm`: squares of the owned gradient slices, summed over the bucket's
   axes, then over the parameter's ``split`` axes (replicas counted once): the global norm;
2. :meth:`~ShardedAdamW.step`: clipping, ``torch.optim.AdamW`` over the segments (elementwise, so
   a segment gets the values AdamW over the whole piece gives it: losses equal the unsharded
   optimizer's), the new weights written into the parameters and all-gathered over each sharded
   bucket's axes (reduce-scatter + all-gather: the bytes of the all-reduce it replaces). With
   ``defer`` (the overlapped schedule) the all-gathers are left in flight and overlap the next
   forward (:class:`_Gathers`): issued per bucket in the order the forward reads the parameters
   (the buckets' order, per process group, at most :data:`OPTIM_INFLIGHT_GATHERS` in flight), each
   waited for at the first read of one of its parameters -- a module's forward (a pre-hook) or the
   schedule's read of a weight piece for its z gather (:meth:`Schedule.before_weight_read`, which a
   prefetch does ahead of the layer). The same gathers of the same values: the same results bit
   for bit. Whatever reads the parameters outside a forward calls :meth:`~ShardedAdamW.settle`
   first (the trainer's :meth:`~axo4d.training.trainer.Trainer.settle`, checkpoints).

A segment's master is a view of its parameter when the parameter is fp32 and the state stays
on the device; otherwise its own fp32 tensor, on the device or, offloaded (``train.offload``),
in pinned host memory where a CPU AdamW updates it (:class:`axo4d.training.optim.offload.HostState`);
the device then keeps the weights in the compute dtype only.

Checkpoints describe the state by the segments' rectangles of the full logical tensors
(:func:`run_chunks`: a placement's chunks cut to the segment's run), under the same DCP keys as
``torch.optim.AdamW``'s state (``optim/<name>/exp_avg`` ...; the masters are ``model/<name>``), so
every element is written once, by its owner, and a checkpoint loads on any grid with or without
the sharded optimizer (:mod:`axo4d.training.checkpointing.shards`).
"""

from __future__ import annotations

import math
from collections import defaultdict, deque
from typing import Callable

import torch
from torch import nn

from axo4d.config import TrainConfig
from axo4d.dist.comm import Comm
from axo4d.facts.placement import Chunk, chunk_view, placement_of
from axo4d.facts.run import shard_optimizer_on  # noqa: F401 (its home before the run plan)
from axo4d.facts.schedule_rules import OPTIM_INFLIGHT_GATHERS
from axo4d.nn.buckets import Bucket, group_position, other_range, runs_of
from axo4d.nn.grads import clip_coefficient, sum_of_squares
from axo4d.training.optim.offload import HostState
from axo4d.training.optim.owned import Segment, adamw, init_state, plan_segments


def _decay(s: Segment) -> bool:
    return placement_of(s.param).weight_decay


class ShardedAdamW:
    """AdamW over this rank's :class:`Segment` s of ``model`` (module docstring).

    ``offload``: 'none', 'optimizer' (every segment's state in host memory) or 'auto' (on the
    device while the state bytes stay within ``device_state_bytes``, the first parameters first:
    their gradients are final last, so the offloaded ones can be copied out during backward).
    ``weights_dtype``: keep the parameters in this dtype on the device (the masters stay fp32).
    """

    def __init__(
        self,
        model: nn.Module,
        comm: Comm,
        t: TrainConfig,
        device: torch.device,
        *,
        offload: str = "none",
        device_state_bytes: float = math.inf,
        weights_dtype: torch.dtype = torch.float32,
    ) -> None:
        self.model, self.comm, self.t, self.device = model, comm, t, device
        self.schedule = model.schedule
        self.segs = plan_segments(model, self.schedule, comm)
        own = weights_dtype != torch.float32 or any(p.dtype != torch.float32 for p in model.parameters())
        budget = device_state_bytes
        for s in self.segs:
            need = s.numel * (8 + (4 if own else 0))  # moments, and a master of its own
            s.host = offload == "optimizer" or (offload == "auto" and need > budget)
            budget -= 0 if s.host else need
        dev = [s for s in self.segs if not s.host]
        for s in dev:
            s.master = s.weights().float().clone() if own else s.weights()
        self.host = (
            HostState([s for s in self.segs if s.host], t, device, comm.rank, _decay, weights_dtype)
            if any(s.host for s in self.segs)
            else None
        )
        if weights_dtype != torch.float32:
            for p in model.parameters():
                p.data = p.data.to(weights_dtype)
        self.dev = adamw([s.master for s in dev], [_decay(s) for s in dev], t)
        init_state(self.dev)
        self._dev, self._own = dev, own
        # the norm's partial sums, one per (split axes, shard axes): from every parameter, so that
        # every rank issues the same all-reduces even where it owns nothing of a kind
        sharded = {id(p): b.axes for b in self.schedule.bucket_plan() if b.shard for p in b.params}
        self._norm_keys = sorted({(tuple(placement_of(p).split), sharded.get(id(p), ())) for p in model.parameters()})
        if self.host is not None:
            self.schedule.on_bucket_reduced(self.host.fetch)
        self._by_part: dict[tuple[int, int], list[Segment]] = defaultdict(list)
        for s in self.segs:
            if s.shard_axes:
                self._by_part[(id(s.bucket), s.part)].append(s)
        self._gathers = _Gathers(comm, self.schedule.bucket_plan())
        self._post_hooks: list[Callable[[ShardedAdamW, tuple, dict], None]] = []
        self._install_waits()

    # ---- a step ----------------------------------------------------------------------------------------
    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop every gradient (the parameters' and the buckets' owned slices)."""
        for p in self.model.parameters():
            p.grad = None
        self.schedule.release_gradients()

    def grad_norm(self) -> float:
        """The global gradient norm, identical on every rank: squares of the owned slices summed
        over the bucket's axes (sharded), then over the parameter's ``split`` axes."""
        by_key: dict[tuple, list[Segment]] = {k: [] for k in self._norm_keys}
        for s in self.segs:
            by_key[(tuple(placement_of(s.param).split), s.shard_axes)].append(s)
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        for (split, shard), segs in sorted(by_key.items()):
            sq = sum_of_squares([s.grad().detach() for s in segs], self.device)
            if shard:
                self.comm.all_reduce(sq, shard)
            if split:
                self.comm.all_reduce(sq, split)
            total += sq[0]
        return math.sqrt(float(total))

    @torch.no_grad()
    def step(self, lr: float, coef: float = 1.0, defer: bool = False) -> None:
        """Clip the gradients by ``coef``, update every segment, bring every parameter up to date:
        at once, or with ``defer`` as the next forward reads them (module docstring)."""
        self.settle()
        if self.dev is not None:
            for g in self.dev.param_groups:
                g["lr"] = lr
            for s in self._dev:
                g = s.grad()
                if coef != 1.0:
                    g.mul_(coef)
                s.master.grad = g if g.dtype == torch.float32 else g.float()
            self.dev.step()
            for s in self._dev:
                s.master.grad = None
                if self._own:
                    s.weights().copy_(s.master)
        if self.host is not None:
            self.host.update(lr, coef, list(self.schedule.bucket_plan()) + [None])
        self._gathers.start(self._owned_slice)
        if not defer:
            self._gathers.settle()
        for hook in self._post_hooks:
            hook(self, (lr, coef), {"defer": defer})

    def register_step_post_hook(self, hook: Callable[[ShardedAdamW, tuple, dict], None]) -> None:
        """Call ``hook(optimizer, args, kwargs)`` after every :meth:`step` (not after :meth:`skip`:
        the weights did not change), as ``torch.optim.Optimizer.register_step_post_hook`` does."""
        self._post_hooks.append(hook)

    #: the norm is read on the host before the update (no queued step; :class:`axo4d.training.optim.build.PlainAdamW`)
    queues_step = False

    def update(self, lr: float, norm: float, defer: bool = False) -> None:
        """The step of the run-optimizer interface: clip to ``train.grad_clip`` against the global
        ``norm`` (:meth:`grad_norm`), then :meth:`step`."""
        self.step(lr, clip_coefficient(self.t.grad_clip, norm), defer=defer)

    def skip(self) -> None:
        """A step not taken (non-finite gradients): nothing changes."""
        self.settle()
        if self.host is not None:
            self.host.drop_pending()

    @torch.no_grad()
    def gather(self) -> None:
        """All-gather the new weights of every sharded bucket over its axes into the parameters and
        wait (in bucket order; at most :data:`OPTIM_INFLIGHT_GATHERS` gathered flats alive at once)."""
        self._gathers.start(self._owned_slice)
        self._gathers.settle()

    @property
    def gather_stats(self) -> dict[str, int]:
        """Weight all-gathers so far: ``issued``, and written ``at_use`` (at a first read in a
        forward: overlapped) or ``settled`` (waited for at once, or by :meth:`settle`)."""
        return dict(self._gathers.stats)

    def settle(self) -> None:
        """Wait for the all-gathers a deferred :meth:`step` left in flight: every parameter is
        then current (call before reading parameters outside a forward)."""
        self._gathers.settle()

    def _owned_slice(self, b: Bucket, j: int, mine: torch.Tensor) -> None:
        """Write this rank's new weights of part ``j`` of bucket ``b`` into the flat ``mine``."""
        segs = self._by_part.get((id(b), j), [])
        if sum(s.numel for s in segs) < mine.numel():  # padding no parameter covers (segments never overlap)
            mine.zero_()
        for s in segs:
            mine[s.at : s.at + s.numel].copy_(s.weights())

    def _install_waits(self) -> None:
        """Wait at first use: a pre-hook on every module holding parameters (and on every module
        that reads its descendants' parameters itself, ``reads_descendants``: the grouped experts,
        :class:`~axo4d.nn.experts.GroupedExperts`, waiting for all of them), and the schedule's read
        of a weight piece (an FP8 cast reads every weight for its scales: all of them)."""
        g = self._gathers

        def module_hook(m: nn.Module, args: object) -> None:
            if g.pending:
                for p in m.parameters(recurse=getattr(m, "reads_descendants", False)):
                    g.use(p)

        def read_hook(layer, how) -> None:
            if g.pending:
                if isinstance(how, torch.dtype):
                    g.use(layer.weight)
                else:
                    g.settle()

        for m in self.model.modules():
            if getattr(m, "reads_descendants", False) or any(True for _ in m.parameters(recurse=False)):
                m.register_forward_pre_hook(module_hook)
        self.schedule.before_weight_read(read_hook)

    # ---- state: memory and checkpoints ---------------------------------------------------------------------
    def state_bytes(self) -> dict[str, int]:
        """Bytes of optimizer state this rank holds: ``device`` (moments, and masters of their own)
        and ``host`` (offloaded masters, moments and gradient copies)."""
        dev = 0
        if self.dev is not None:
            dev = sum(v.nbytes for st in self.dev.state.values() for v in st.values() if torch.is_tensor(v))
            dev += sum(s.master.nbytes for s in self._dev) if self._own else 0
        return {"device": dev, "host": self.host.nbytes() if self.host is not None else 0}

    def _state_of(self, s: Segment) -> dict:
        return (self.host.opt if s.host else self.dev).state[s.master]

    def checkpoint_state(self) -> tuple[dict[str, list[tuple[Chunk, torch.Tensor]]], dict[str, torch.Tensor]]:
        """This rank's state as DCP sees it: ``{key: [(chunk of the full logical tensor, view)]}``
        for ``model/<name>`` (the masters) and ``optim/<name>/exp_avg(_sq)``, and the 0-d
        ``optim/<name>/step`` tensors."""
        self.settle()
        entries: dict[str, list] = defaultdict(list)
        plain: dict[str, torch.Tensor] = {}
        for s in self.segs:
            st = self._state_of(s)
            for key, t in (
                (f"model/{s.name}", s.master),
                (f"optim/{s.name}/exp_avg", st["exp_avg"]),
                (f"optim/{s.name}/exp_avg_sq", st["exp_avg_sq"]),
            ):
                entries[key] += [(ch, chunk_view(t, ch)) for ch in s.chunks]
            plain[f"optim/{s.name}/step"] = st["step"]
        return dict(entries), plain

    @torch.no_grad()
    def after_load(self, optimizer_loaded: bool) -> None:
        """After a checkpoint was read (collective): the masters into the parameters and the
        parameters' other slices gathered (``optimizer_loaded``); else the masters from the
        loaded parameters."""
        self.settle()
        if not optimizer_loaded:
            for s in self.segs:
                if s.master is not None and s.master.data_ptr() != s.weights().data_ptr():
                    s.master.copy_(s.weights())
            return
        for s in self.segs:
            if s.host or self._own:
                s.weights().copy_(s.master)
        self.gather()


class _Gathers:
    """The all-gathers of updated weights of one step: one per dtype part of every sharded bucket,
    a sequence per process group in the buckets' order (the order the forward reads the
    parameters), at most :data:`OPTIM_INFLIGHT_GATHERS` of a group in flight (each holds a gathered
    flat); :meth:`use` waits for the one holding a parameter (and the group's earlier ones: a group
    runs its collectives in order), writes the parameters and issues the next."""

    def __init__(self, comm: Comm, buckets: tuple[Bucket, ...]) -> None:
        self.comm = comm
        seqs: dict[int, list[tuple[Bucket, int, int, int, list[nn.Parameter]]]] = {}
        for b in buckets:
            if not b.shard:
                continue
            pos = group_position(comm, b.axes)
            for j, (plist, numel) in enumerate(b.flat_parts()):
                lo, hi = b.owned_range(numel, pos)
                seqs.setdefault(id(comm.group(b.axes)), []).append((b, j, lo, hi, plist))
        self.seqs = list(seqs.values())
        self._queue: list[deque] = [deque() for _ in self.seqs]  # not yet issued
        self._flight: list[deque] = [deque() for _ in self.seqs]  # (plist, lo, hi, handle, flat or None) issued
        self.pending: dict[int, int] = {}  # id(param) -> its group's sequence, while its gather is not written
        self._slice = None
        self.stats = {"issued": 0, "at_use": 0, "settled": 0}  # gathers; written at a first read, or by settle

    def start(self, owned_slice) -> None:
        """Queue every part's gather (``owned_slice(bucket, part, into)`` writes this rank's new
        weights into its piece of the gathered flat) and issue the first of each group."""
        self._slice = owned_slice
        for g, seq in enumerate(self.seqs):
            for item in seq:
                self._queue[g].append(item)
                for p in item[4]:
                    self.pending[id(p)] = g
            self._top_up(g)

    def _top_up(self, g: int) -> None:
        while self._queue[g] and len(self._flight[g]) < OPTIM_INFLIGHT_GATHERS:
            b, j, lo, hi, plist = self._queue[g].popleft()
            self.stats["issued"] += 1
            if self.comm.is_pair(b.axes, plist[0]):  # two gloo ranks: straight from and into the parameters
                flats = [p.data.view(-1) for p in plist]
                h = self.comm.gather_runs(runs_of(flats, lo, hi), runs_of(flats, *other_range(lo, hi)), b.axes)
                self._flight[g].append((plist, lo, hi, h, None))
                continue
            full = self.comm.buffers.take((hi - lo) * b.size, plist[0].dtype, plist[0].device)
            self._slice(b, j, full[lo:hi])  # this rank's piece, written where the gather puts it
            h = self.comm.all_gather(full[lo:hi], b.axes, async_op=True, out=full)
            self._flight[g].append((plist, lo, hi, h, full))

    def _land_one(self, g: int, why: str) -> None:
        """Write the oldest gather of group ``g`` into its parameters: all but this rank's own run
        ``[lo, hi)``, which the parameters already hold (the slice sent was read from them)."""
        self.stats[why] += 1
        plist, lo, hi, h, full = self._flight[g].popleft()
        h.wait()
        if full is None:  # received into the parameters themselves
            for p in plist:
                self.pending.pop(id(p), None)
            self._top_up(g)
            return
        off = 0
        for p in plist:
            n, dst = p.numel(), p.data.view(-1)
            a, z = min(max(lo - off, 0), n), min(max(hi - off, 0), n)  # own run, in p's elements
            if a > 0:
                dst[:a].copy_(full[off : off + a])
            if z < n:
                dst[z:].copy_(full[off + z : off + n])
            off += n
            self.pending.pop(id(p), None)
        self.comm.buffers.give(full)
        self._top_up(g)

    def use(self, p: torch.Tensor) -> None:
        """``p`` is about to be read: wait until its gather is written (no-op when it is)."""
        g = self.pending.get(id(p))
        while g is not None and id(p) in self.pending:
            if not self._flight[g]:
                self._top_up(g)
            self._land_one(g, "at_use")

    def settle(self) -> None:
        """Write every gather still queued or in flight, in order."""
        for g in range(len(self.seqs)):
            while self._flight[g] or self._queue[g]:
                if not self._flight[g]:
                    self._top_up(g)
                self._land_one(g, "settled")
        self.pending.clear()
