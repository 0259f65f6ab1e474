"""AdamW over the parts of the parameters this rank owns: the sharded optimizer over data (ZeRO-1,
Megatron's distributed optimizer) and host offload (docs/design.md section 9).

The model's schedule plans the gradient buckets (:func:`axo4d.nn.schedule.plan_buckets`). With
``parallel.shard_optimizer`` a bucket is reduce-scattered over its axes (``data``; ``z, data`` for
replicated parameters) instead of all-reduced, so each rank of the group holds the sum of one
``1/G`` slice of the bucket (:meth:`~axo4d.nn.schedule.Bucket.owned_range`). A :class:`Segment`
is the run of one parameter's flat local piece inside this rank's slice (the whole piece when
the bucket is not sharded, or the parameter is in none). :class:`ShardedAdamW` keeps the fp32
master weights and both Adam moments of its segments only, and per step:

1. :meth:`~ShardedAdamW.grad_norm`: squares of the owned gradient slices, summed over the bucket's
   axes, then over the parameter's ``split`` axes (replicas counted once): the global norm;
2. :meth:`~ShardedAdamW.step`: clipping, ``torch.optim.AdamW`` over the segments (elementwise, so
   a segment gets the values AdamW over the whole piece gives it: losses equal the unsharded
   optimizer's), the new weights written into the parameters and all-gathered over each sharded
   bucket's axes (reduce-scatter + all-gather: the bytes of the all-reduce it replaces).

A segment's master is a view of its parameter when the parameter is fp32 and the state stays
on the device; otherwise its own fp32 tensor, on the device or, offloaded (``train.offload``),
in pinned host memory where a CPU AdamW updates it (:class:`axo4d.training.optim.offload.HostState`);
the device then keeps the weights in the compute dtype only.

Checkpoints describe the state by the segments' rectangles of the full logical tensors
(:func:`run_chunks`: a placement's chunks cut to the segment's run), under the same DCP keys as
``torch.optim.AdamW``'s state (``optim/<name>/exp_avg`` ...; the masters are ``model/<name>``), so
every element is written once, by its owner, and a checkpoint loads on any grid with or without
the sharded optimizer (:mod:`axo4d.training.checkpoint.shards`).
"""

from __future__ import annotations

import math
from collections import defaultdict, deque

import torch
from torch import nn

from axo4d.config import ParallelConfig, TrainConfig
from axo4d.dist.comm import Comm
from axo4d.dist.grid import Grid
from axo4d.dist.placement import Chunk, chunk_view, placement_of
from axo4d.nn.schedule import group_position
from axo4d.schedule_facts import OPTIM_INFLIGHT_GATHERS
from axo4d.training.optim.offload import HostState
from axo4d.training.optim.owned import Segment, adamw, init_state, plan_segments


def shard_optimizer_on(p: ParallelConfig, grid: Grid) -> bool:
    """``parallel.shard_optimizer``: 'auto' is on when G_data > 1."""
    return p.shard_optimizer == "true" or (p.shard_optimizer == "auto" and grid.size("data") > 1)


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
        self.dev = adamw([s.master for s in dev], [_decay(s) for s in dev], t, device.type)
        init_state(self.dev)
        self._dev, self._own = dev, own
        # the norm's partial sums, one per (split axes, shard axes): from every parameter, so that
        # every rank issues the same all-reduces even where it owns nothing of a kind
        sharded = {id(p): b.axes for b in self.schedule.bucket_plan() if b.shard for p in b.params}
        self._norm_keys = sorted({(tuple(placement_of(p).split), sharded.get(id(p), ())) for p in model.parameters()})
        if self.host is not None:
            self.schedule.on_bucket_reduced(self.host.fetch)

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
            sq = torch.zeros(1, dtype=torch.float64, device=self.device)
            for s in segs:
                sq += s.grad().detach().double().pow(2).sum()
            if shard:
                self.comm.all_reduce(sq, shard)
            if split:
                self.comm.all_reduce(sq, split)
            total += sq[0]
        return math.sqrt(float(total))

    @torch.no_grad()
    def step(self, lr: float, coef: float = 1.0) -> None:
        """Clip the gradients by ``coef``, update every segment, bring every parameter up to date."""
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
        self.gather()

    def skip(self) -> None:
        """A step not taken (non-finite gradients): nothing changes."""
        if self.host is not None:
            self.host.drop_pending()

    @torch.no_grad()
    def gather(self) -> None:
        """All-gather the new weights of every sharded bucket over its axes into the parameters
        (in bucket order; at most :data:`OPTIM_INFLIGHT_GATHERS` gathered flats alive at once)."""
        by_part: dict[tuple[int, int], list[Segment]] = defaultdict(list)
        for s in self.segs:
            if s.shard_axes:
                by_part[(id(s.bucket), s.part)].append(s)
        pending: deque = deque()
        for b in self.schedule.bucket_plan():
            if not b.shard:
                continue
            pos = group_position(self.comm, b.axes)
            for j, (plist, numel) in enumerate(b.flat_parts()):
                lo, hi = b.owned_range(numel, pos)
                mine = torch.zeros(hi - lo, dtype=plist[0].dtype, device=plist[0].device)
                for s in by_part.get((id(b), j), []):
                    mine[s.at : s.at + s.numel].copy_(s.weights())
                pending.append((plist, self.comm.all_gather(mine, b.axes, async_op=True)))
                while len(pending) > OPTIM_INFLIGHT_GATHERS:
                    _write_params(*pending.popleft())
        while pending:
            _write_params(*pending.popleft())

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
        if not optimizer_loaded:
            for s in self.segs:
                if s.master is not None and s.master.data_ptr() != s.weights().data_ptr():
                    s.master.copy_(s.weights())
            return
        for s in self.segs:
            if s.host or self._own:
                s.weights().copy_(s.master)
        self.gather()


def _write_params(plist: list[nn.Parameter], handle) -> None:
    full = handle.wait()
    off = 0
    for p in plist:
        p.data.view(-1).copy_(full[off : off + p.numel()])
        off += p.numel()
