"""One training step of one rank as the implementation schedules it, simulated per layer.

:func:`step_program` writes, from the model's parts (:mod:`axo4d.facts.spec`, any architecture), what
a rank does in one optimizer step, in the order :mod:`axo4d.nn.schedule` and
:mod:`axo4d.nn.linear` do it, and :mod:`perfmodel.engine` plays it:

* **forward**, part by part: the weight's z all-gather (overlapped schedule: the first of a pass
  synchronous, then each one prefetched as the previous one is served -- so at most one is in
  flight ahead, :data:`~axo4d.facts.schedule_rules.MAX_INFLIGHT_GATHERS` bounds it), the GEMM, blocking
  all-reduces (layer outputs, norm and loss statistics);
* **backward**, in reverse, each activation-checkpointed block recomputed first: the gather, the
  dX GEMM, its all-reduce issued, the dW GEMM, the dW reduce-scatter left in flight and waited
  for once :data:`~axo4d.facts.schedule_rules.RS_LAG` newer ones are (eager schedule: at once), then the
  dX all-reduce waited for; data-parallel buckets all-reduced as soon as their gradients are
  final (eager: all at the end), the last micro-step only;
* cached weights (``parallel.cache_weights``: the last ``N`` blocks and the head) skip the
  backward and recompute gathers;
* then the loss and gradient-norm all-reduces and the optimizer.

Deep models are simulated with a few blocks and extrapolated: the step time (and every other
figure) is linear in the number of blocks of each kind once the pipeline is in steady state, so
``T(L) = T(P) + (L - P) * (T(P) - T(P - 1))`` per block kind (cached or not), and likewise in the
number of accumulation micro-steps.
"""

from __future__ import annotations

import dataclasses
import math
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable

from axo4d.facts.placement import Block3D
from axo4d.facts.schedule_rules import OPTIM_INFLIGHT_GATHERS, RS_LAG, bucket_limit, plan_buckets
from axo4d.facts.spec import ALL_GATHER, REDUCE_SCATTER, Coll, Dtypes, LinearSpec, ModelSpec

from . import compute as C
from .collectives import collective_time, latency_steps
from .engine import Compute, Issue, Result, Task, Wait, simulate
from .expert_pricing import rows_of

STEADY_BLOCKS = 3
"""Blocks of each kind simulated before extrapolating (enough for the prefetch and reduce-scatter
pipeline to reach its steady state)."""


@dataclass(frozen=True)
class StepSetup:
    """What one step does: the model on its grid, local rows per micro-step, element sizes,
    recomputation, overlap, cached blocks, accumulation micro-steps, bucket size
    (``parallel.dp_bucket_mb``: 'auto' or MiB), fused attention."""

    spec: ModelSpec
    rows: float
    dt: Dtypes
    checkpointing: bool
    overlap: bool
    cached_blocks: int
    grad_accum: int
    bucket_mb: str | float
    flash: bool
    dp_colls: tuple[Coll, ...]
    step_colls: tuple[Coll, ...]


class Prices:
    """Seconds of the pieces: ``task(coll)`` -> a :class:`~perfmodel.engine.Task` (or ``None`` for
    a group of one rank), and compute seconds of each part and phase."""

    def __init__(
        self,
        setup: StepSetup,
        machine: Any,
        link: Callable[[tuple[str, ...], str], tuple],
        link_class: Callable[[tuple[str, ...]], str],
    ) -> None:
        self.s, self.m, self.link, self.link_class = setup, machine, link, link_class
        self.gemm = machine.gemm_model
        self.dtype = C.dtype_name(setup.dt)
        self.scores = not (setup.flash or machine.attention_tflops)
        self._memo: dict = {}
        self._tasks: dict = {}
        self._links: dict = {}
        self._colls: dict = {}

    def task(self, c: Coll, n_bytes: float | None = None) -> Task | None:
        """A fresh task for one call of ``c`` (of ``n_bytes`` instead of its size when given)."""
        key = (c, n_bytes)
        v = self._tasks.get(key)
        if v is None:
            p, gbps, alpha = self.link(c.axes, c.kind)
            if p == 1:
                v = ()
            else:
                nb = c.nbytes if n_bytes is None else n_bytes
                lat = latency_steps(c.kind, p) * alpha
                total = collective_time(c.kind, nb, p, gbps, alpha)
                link = self._links.get(c.axes) or self._links.setdefault(c.axes, self.link_class(c.axes))
                v = (c.axes, "data" if "data" in c.axes else c.axes[0], link, lat, max(0.0, total - lat))
            self._tasks[key] = v
        return Task(*v) if v else None

    def _elementwise(self, nbytes: float, ops: float) -> float:
        t = nbytes / (self.m.memory_gbps * 1e9) if self.m.memory_gbps else 0.0
        return t + ops * self.m.op_overhead_us * 1e-6

    def part(self, part: Any, phase: str, in_block: bool) -> tuple[float, float]:
        """``(seconds before, seconds after)`` the dX all-reduce is issued, for ``phase`` in
        'fwd', 'rec', 'bwd' (forward phases: everything 'before')."""
        key = (id(part), phase, in_block)
        v = self._memo.get(key)
        if v is None:
            v = self._memo[key] = self._part(part, phase, in_block)
        return v

    def _part(self, part: Any, phase: str, in_block: bool) -> tuple[float, float]:
        s, grid, rows = self.s, self.s.spec.grid, rows_of(part, self.s.rows)  # an expert: its routed rows
        parts = s.spec.block if in_block else s.spec.embeddings + s.spec.head
        ops = (C.OPS_BLOCK if in_block else C.OPS_HEAD) / max(1, len(parts))
        ew = C.part_bytes(part, s.spec, rows, s.dt, in_block, self.scores)
        fwd_ops, bwd = ops / 3, phase == "bwd"
        other = self._elementwise(ew * (2 if bwd else 1), ops - fwd_ops if bwd else fwd_ops)
        if isinstance(part, LinearSpec):
            g, dtype = C.linear_gemms(part, grid, rows), C.FP8 if part.fp8 else self.dtype
            if not bwd:
                return self.gemm.seconds(*g["fwd"], dtype) + other, 0.0
            return self.gemm.seconds(*g["dx"], dtype), self.gemm.seconds(*g["dw"], dtype) + other
        flops = part.gemm_flops(grid, rows)
        if flops:
            rate = (
                self.m.attention_tflops * 1e12
                if self.m.attention_tflops
                else self.gemm.flops_per_s(
                    getattr(part, "seq_len", rows),
                    getattr(part, "seq_len", rows),
                    getattr(part, "head_dim", rows),
                    "nt",
                    self.dtype,
                )
            )
            other += flops * (2 if bwd else 1) / rate
        return other, 0.0

    def dw(self, part: LinearSpec) -> float:
        """Seconds of ``part``'s dW GEMM (the part of its backward a deferral moves)."""
        return self._gemm(part, "dw")

    def fwd_gemm(self, part: LinearSpec) -> float:
        """Seconds of ``part``'s forward GEMM (cut into row chunks: :meth:`LinearSpec.fwd_chunks`)."""
        return self._gemm(part, "fwd")

    def _gemm(self, part: LinearSpec, kind: str) -> float:
        key = (id(part), kind)
        v = self._memo.get(key)
        if v is None:
            g = C.linear_gemms(part, self.s.spec.grid, rows_of(part, self.s.rows))
            v = self._memo[key] = self.gemm.seconds(*g[kind], C.FP8 if part.fp8 else self.dtype)
        return v

    def optimizer(self) -> float:
        """Seconds of the optimizer step (AdamW traffic, launches)."""
        v = self._memo.get("optimizer")
        if v is None:
            sp = self.s.spec
            v = self._memo["optimizer"] = self._elementwise(C.optimizer_bytes(sp, self.s.dt), C.step_ops(sp))
        return v

    def params(self, part: Any) -> list[tuple[tuple[str, ...], float, bool]]:
        """:func:`_params` of ``part``, memoised."""
        key = ("params", id(part))
        v = self._memo.get(key)
        if v is None:
            v = self._memo[key] = _params(part, self.s.spec, self.s.dt)
        return v


# ---- the program ------------------------------------------------------------------------------
def _params(part: Any, spec: ModelSpec, dt: Dtypes) -> list[tuple[tuple[str, ...], float, bool]]:
    """``(grad_sum axes, gradient bytes on this rank, is a z-sharded weight)`` of a part's parameters."""
    out = []
    for pl in part.placements().values():
        n = math.prod(pl.full_shape) / (spec.grid.size(*pl.split) if pl.split else 1)
        out.append((tuple(pl.grad_sum), n * dt.grad, isinstance(pl, Block3D)))
    return out


class _Buckets:
    """Data-parallel buckets planned as :func:`axo4d.nn.buckets.plan_buckets` does (the rule of
    :func:`axo4d.facts.schedule_rules.plan_buckets`), reduced in reverse per group as their parameters
    become final; with the overlapped sharded optimizer, their weight all-gathers issued at the
    start of the step (the end of the previous one), in order per group and at most
    :data:`~axo4d.facts.schedule_rules.OPTIM_INFLIGHT_GATHERS` in flight, each waited for before the
    first part that reads one of its weights (:meth:`need`)."""

    def __init__(self, layout: list[tuple[Any, int]], setup: StepSetup, prices: Prices) -> None:
        self.prices = prices
        keys, items = [], []
        for slot, (part, _) in enumerate(layout):
            for axes, nbytes, weight in prices.params(part):
                keys.append(((slot, weight), nbytes))
                items.append((len(items), axes, nbytes / setup.dt.grad * 4.0))  # planned on fp32 sizes
        red = {c.axes: c for c in setup.dp_colls if c.phase == "bwd"}
        ags = {c.axes: c for c in setup.dp_colls if c.kind == ALL_GATHER}
        self.seqs: list[list[list]] = []  # per group: buckets [needed keys, bytes, coll, done?]
        self.gathers: list[deque] = []  # per group: [slots, task] in forward order
        by_group: dict[tuple[str, ...], list] = {}
        for axes, idx in plan_buckets(items, bucket_limit(setup.bucket_mb, setup.spec, 4.0)):
            proto = _proto(red, axes)
            if proto is None or prices.link(axes, proto.kind)[0] == 1:
                continue
            by_group.setdefault(axes, []).append(
                [{keys[i][0] for i in idx}, sum(keys[i][1] for i in idx), proto, False]
            )
        for axes, buckets in by_group.items():
            self.seqs.append(list(reversed(buckets)))
            ag = _proto(ags, axes)
            if ag is not None and setup.overlap:  # the gather's bytes per reduced byte, from the records
                per = ag.nbytes / max(buckets[0][2].nbytes, 1e-30)
                self.gathers.append(deque([{k[0] for k in b[0]}, prices.task(ag, b[1] * per)] for b in buckets))
        self.final: set[tuple[int, bool]] = set()
        self.issued: list[Task] = []
        self._in_flight: list[list] = [[] for _ in self.gathers]  # per group: [slots, task] issued, not waited

    def ready(self, key: tuple[int, bool], prog: list) -> None:
        """The gradients of ``key`` = (slot, z-sharded weights or not) are final: issue every
        bucket now complete (in order per group)."""
        self.final.add(key)
        for seq in self.seqs:
            for b in seq:
                if b[3]:
                    continue
                if not b[0] <= self.final:
                    break
                self._issue(b, prog)

    def flush(self, prog: list, serial: bool = False) -> None:
        """Issue what is left and wait for everything (``serial``: one bucket at a time, as the
        eager schedule's ``finish`` does)."""
        for seq in self.seqs:
            for b in seq:
                if not b[3]:
                    self._issue(b, prog)
                    if serial and self.issued:
                        prog.append(Wait(self.issued.pop()))
        prog += [Wait(t) for t in self.issued]
        self.issued = []

    def _issue(self, b: list, prog: list) -> None:
        b[3] = True
        t = self.prices.task(b[2], b[1])
        if t is not None:
            prog.append(Issue(t))
            self.issued.append(t)

    # ---- the sharded optimizer's weight all-gathers, overlapped with the next forward --------
    def start_gathers(self, prog: list) -> None:
        for g in range(len(self.gathers)):
            self._top_up(g, prog)

    def _top_up(self, g: int, prog: list) -> None:
        while self.gathers[g] and len(self._in_flight[g]) < OPTIM_INFLIGHT_GATHERS:
            item = self.gathers[g].popleft()
            if item[1] is not None:
                prog.append(Issue(item[1]))
            self._in_flight[g].append(item)

    def need(self, slot: int, prog: list) -> None:
        """Part ``slot`` reads its weights: wait for the gathers up to its bucket's (each group)."""
        for g in range(len(self.gathers)):
            while any(slot in it[0] for it in self._in_flight[g]) or any(slot in it[0] for it in self.gathers[g]):
                self._top_up(g, prog)
                slots, t = self._in_flight[g].pop(0)
                if t is not None:
                    prog.append(Wait(t))
                self._top_up(g, prog)

    def end_gathers(self, prog: list) -> None:
        """Wait for any gather no part read (a forward that left a parameter unused)."""
        for g in range(len(self.gathers)):
            while self._in_flight[g] or self.gathers[g]:
                self._top_up(g, prog)
                _, t = self._in_flight[g].pop(0)
                if t is not None:
                    prog.append(Wait(t))


def _proto(kinds: dict[tuple[str, ...], Coll], axes: tuple[str, ...]) -> Coll | None:
    """The record of ``kinds`` whose group is ``axes`` (in any order)."""
    return kinds.get(axes) or next((c for a, c in kinds.items() if set(a) == set(axes)), None)


def defers_dw(spec: ModelSpec, part: Any) -> bool:
    """Whether the overlapped schedule leaves ``part``'s dW GEMM for the next dX all-reduce
    (:meth:`axo4d.nn.overlap_schedule.OverlapSchedule.defers_weight_grad`): a linear layer (not FP8)
    whose output axis is of one rank and input axis is not, used once (not a tied head)."""
    if not isinstance(part, LinearSpec) or part.fp8:
        return False
    a_in, a_out = part.axes()
    tied = any(getattr(e, "head", None) is part for e in spec.embeddings)
    return spec.grid.size(a_out) == 1 and spec.grid.size(a_in) > 1 and not tied


def _layout(spec: ModelSpec, uncached: int, cached: int) -> list[tuple[Any, int]]:
    """``(part, block index or -1)`` in parameter order: embeddings, blocks, head."""
    out = [(p, -1) for p in spec.embeddings]
    for i in range(uncached + cached):
        out += [(p, i) for p in spec.block]
    return out + [(p, -1) for p in spec.head]


def step_program(setup: StepSetup, prices: Prices, uncached: int, cached: int, micro: int) -> list:
    """The actions of one optimizer step with ``uncached + cached`` blocks (the cached ones last)
    and ``micro`` micro-steps (module docstring)."""
    sp = setup.spec
    layout = _layout(sp, uncached, cached)
    first_block = len(sp.embeddings)
    per = len(sp.block)
    prog: list = []
    buckets = _Buckets(layout, setup, prices)
    buckets.start_gathers(prog)  # the previous step's weight all-gathers (overlapped sharded optimizer)
    for m in range(micro):
        sync = m == micro - 1
        _micro_step(
            setup, prices, layout, first_block, per, uncached, cached, prog, buckets if sync else None, buckets, m == 0
        )
    if not setup.overlap:
        buckets.flush(prog, serial=True)
    for c in setup.step_colls:  # loss, gradient norm: blocking
        _blocking(prices, c, prog)
    prog.append(Compute(prices.optimizer(), "optimizer"))
    if not setup.overlap:
        for c in setup.dp_colls:  # after the optimizer: the eager sharded optimizer's gathers
            if c.phase != "bwd":
                _blocking(prices, c, prog)
    return _merged(prog)


def _blocking(prices: Prices, c: Coll, prog: list) -> None:
    """``c.calls`` blocking calls back to back on one group: one task of their summed time."""
    t = prices.task(c)
    if t is not None:
        t.latency, t.work = t.latency * c.calls, t.work * c.calls
        prog += [Issue(t), Wait(t)]


def _merged(prog: list) -> list:
    """Adjacent compute actions as one (fewer events to simulate; the same timeline)."""
    out: list = []
    for a in prog:
        if type(a) is Compute and out and type(out[-1]) is Compute:
            out[-1] = Compute(out[-1].seconds + a.seconds)
        elif type(a) is not Compute or a.seconds > 0:
            out.append(a)
    return out


def _plan(setup: StepSetup, prices: Prices, part: Any, block: int, cached_from: int, name: str) -> tuple:
    """What one part does in one phase: ``(gathers, dx, reduce-scatters, blocking, has_rs,
    chunks)``, collectives of groups larger than one rank only (memoised per part kind)."""
    sp, in_block = setup.spec, block >= 0
    cached = isinstance(part, LinearSpec) and setup.cached_blocks > 0 and (not in_block or block >= cached_from)
    key = (id(part), in_block, cached, name)
    out = prices._colls.get(key)
    if out is None:
        args = (sp.grid, rows_of(part, setup.rows), setup.dt, setup.checkpointing and in_block, in_block)
        cs = [
            c
            for c in (part.collectives(*args, cached=True) if cached else part.collectives(*args))
            if c.phase == name and prices.link(c.axes, c.kind)[0] > 1
        ]
        z = lambda c, kind: c.kind == kind and c.axes == ("z",) and c.pool != "blocking"  # not attention's K/V
        out = prices._colls[key] = (
            [c for c in cs if z(c, ALL_GATHER)],
            [c for c in cs if c.pool == "dx"],
            [c for c in cs if z(c, REDUCE_SCATTER)],
            [c for c in cs if c.pool == "blocking"],
            any(z(c, REDUCE_SCATTER) for c in cs),
            [c for c in cs if c.pool == "chunks"],
        )
    return out


class _Phases:
    """The actions of one micro-step's phases, part by part (placeholders resolved by :func:`_resolve`):
    ``ops`` with ('gather', task, slot), ('need', slot) and finality markers; the reduce-scatters in
    flight; the dW GEMMs deferred to the next dX all-reduce."""

    def __init__(self, setup: StepSetup, prices: Prices, layout: list, uncached: int, buckets, first: bool) -> None:
        self.setup, self.prices, self.layout, self.uncached = setup, prices, layout, uncached
        self.buckets, self.first, self.overlap = buckets, first, setup.overlap
        self.ops: list = []
        self.rs: list[tuple[Task, int]] = []  # reduce-scatters in flight, with their slot
        self.deferred: list[tuple[float, list, int]] = []  # dW GEMMs waiting for a dX all-reduce: seconds, rs, slot

    def run_deferred(self) -> None:
        ops, task = self.ops, self.prices.task
        for secs, rss_, slot in self.deferred:
            ops.append(Compute(secs))
            for c in rss_:
                t = task(c)
                ops.append(Issue(t))
                self.rs.append((t, slot))
            if not rss_ and self.buckets is not None:
                ops.append(("final", slot, False))
        self.deferred.clear()

    def _chunked(self, part: Any, chunked: list, before: float) -> float:
        """The forward GEMM in row chunks, each chunk's all-reduce behind the next one; what is left."""
        ops, task, overlap = self.ops, self.prices.task, self.overlap
        for c in chunked:
            gemm = self.prices.fwd_gemm(part)
            tasks = [task(c) for _ in range(c.calls)]
            for t in tasks:
                ops.extend([Compute(gemm / len(tasks)), Issue(t)] + ([] if overlap else [Wait(t)]))
            ops.extend(Wait(t) for t in tasks if overlap)
            before = max(0.0, before - gemm)
        return before

    def phase(self, i: int, name: str, step: str) -> None:
        """Part ``i`` in phase ``name`` ('fwd', 'recompute', 'bwd'; priced as ``step``)."""
        setup, prices, ops, task, overlap = self.setup, self.prices, self.ops, self.prices.task, self.overlap
        part, block = self.layout[i]
        gathers_, dxs, rss, blocking, has_rs, chunked = _plan(setup, prices, part, block, self.uncached, name)
        if step == "bwd" and overlap and len(self.rs) > RS_LAG:
            _drain(self.rs, RS_LAG, ops, self.buckets)
        if self.first and step == "fwd":
            ops.append(("need", i))
        for c in gathers_:
            ops.append(("gather", task(c), i))
        before, after = prices.part(part, step, block >= 0)
        before = self._chunked(part, chunked, before)
        ops.append(Compute(before))
        dx = [task(c) for c in dxs]
        ops.extend(Issue(t) for t in dx)
        if dx and overlap:
            self.run_deferred()
        defer = overlap and step == "bwd" and defers_dw(setup.spec, part)
        if defer:  # its dW GEMM (and z reduce-scatter) behind the next dX all-reduce
            self.deferred.append((prices.dw(part), rss, i))
            after = max(0.0, after - prices.dw(part))
        if after:
            ops.append(Compute(after))
        for c in [] if defer else rss:
            t = task(c)
            ops.append(Issue(t))
            if overlap:
                self.rs.append((t, i))
            else:
                ops.append(Wait(t))
        ops.extend(Wait(t) for t in dx)
        for c in blocking:
            t = task(c)
            ops.extend((Issue(t), Wait(t)))
        if step == "bwd" and self.buckets is not None and overlap:
            ops.append(("final", i, has_rs or defer))


def _micro_step(
    setup: StepSetup,
    prices: Prices,
    layout: list,
    first_block: int,
    per: int,
    uncached: int,
    cached: int,
    prog: list,
    buckets: _Buckets | None,
    gathers: _Buckets,
    first: bool,
) -> None:
    """Forward, (recompute and) backward of one micro-step; ``buckets``: the synchronised one;
    ``first``: the first micro-step (its forward waits for the weight all-gathers of ``gathers``)."""
    ph = _Phases(setup, prices, layout, uncached, buckets, first)
    phase = ph.phase
    nb = uncached + cached
    head = range(first_block + nb * per, len(layout))
    for i in range(first_block):
        phase(i, "fwd", "fwd")
    for i in range(first_block, first_block + nb * per):
        phase(i, "fwd", "fwd")
    for i in head:
        phase(i, "fwd", "fwd")
    for i in reversed(head):
        phase(i, "bwd", "bwd")
    for blk in reversed(range(nb)):
        lo = first_block + blk * per
        if setup.checkpointing:
            for i in range(lo, lo + per):
                phase(i, "recompute", "rec")
        for i in reversed(range(lo, lo + per)):
            phase(i, "bwd", "bwd")
    for i in reversed(range(first_block)):
        phase(i, "bwd", "bwd")
    ph.run_deferred()
    _drain(ph.rs, 0, ph.ops, buckets)
    prog += _resolve(ph.ops, setup.overlap, buckets, gathers if first else None)
    if first:
        gathers.end_gathers(prog)
    if buckets is not None and setup.overlap:
        buckets.flush(prog)


def _drain(rs: list, keep: int, ops: list, buckets: _Buckets | None) -> None:
    while len(rs) > keep:
        t, slot = rs.pop(0)
        ops.append(Wait(t))
        if buckets is not None:
            ops.append(("rs_final", slot))


def _resolve(ops: list, overlap: bool, buckets: _Buckets | None, gathers: _Buckets | None) -> list:
    """Placeholders -> actions: z gathers synchronous or prefetched (a gather reads its weight
    piece: the weight all-gathers of ``gathers`` up to its bucket are waited for first, as at any
    first read); finality markers -> bucket issues."""
    zg = [o for o in ops if type(o) is tuple and o[0] == "gather"]
    out: list = []
    need = (lambda slot: gathers.need(slot, out)) if gathers is not None else (lambda slot: None)
    k = 0
    for o in ops:
        if type(o) is not tuple:
            out.append(o)
        elif o[0] == "need":
            need(o[1])
        elif o[0] == "gather":
            t = o[1]
            if not overlap or k == 0:
                need(o[2])
                out += [Issue(t), Wait(t)]
            else:
                out.append(Wait(t))
            if overlap and k + 1 < len(zg):
                need(zg[k + 1][2])
                out.append(Issue(zg[k + 1][1]))
            k += 1
        elif buckets is None:
            continue
        elif o[0] == "rs_final":  # the weight's summed piece has landed
            buckets.ready((o[1], True), out)
        else:  # norms, biases, embeddings; weights without z
            buckets.ready((o[1], False), out)
            if not o[2]:
                buckets.ready((o[1], True), out)
    return out


# ---- extrapolation -----------------------------------------------------------------------------
def _combine(base: Result, parts: list[tuple[float, Result, Result]]) -> Result:
    """``base + sum(n * (hi - lo))`` figure by figure."""
    out = dataclasses.replace(base, stalls=dict(base.stalls))
    for n, hi, lo in parts:
        out.time += n * (hi.time - lo.time)
        out.compute += n * (hi.compute - lo.compute)
        out.comm_busy += n * (hi.comm_busy - lo.comm_busy)
        for a in set(hi.stalls) | set(lo.stalls):
            out.stalls[a] = out.stalls.get(a, 0.0) + n * (hi.stalls.get(a, 0.0) - lo.stalls.get(a, 0.0))
    out.stalls = {a: max(0.0, v) for a, v in out.stalls.items()}
    return out


def simulate_step(setup: StepSetup, prices: Prices, slowdowns: tuple) -> Result:
    """The step of ``setup`` (every block and micro-step, by extrapolation; module docstring)."""
    g, c, conc = slowdowns
    L = setup.spec.n_layer
    n_c = min(setup.cached_blocks, L)
    n_u = L - n_c
    p_u, p_c = min(n_u, STEADY_BLOCKS), min(n_c, STEADY_BLOCKS)
    micro = setup.grad_accum

    def run(u: int, k: int, m: int) -> Result:
        return simulate(step_program(setup, prices, u, k, m), g, c, conc)

    def blocks(m: int) -> Result:
        base = run(p_u, p_c, m)
        parts = []
        if n_u > p_u:
            parts.append((n_u - p_u, base, run(p_u - 1, p_c, m)))
        if n_c > p_c:
            parts.append((n_c - p_c, base, run(p_u, p_c - 1, m)))
        return _combine(base, parts) if parts else base

    one = blocks(1)
    if micro == 1:
        return one
    two = blocks(2)
    return _combine(one, [(micro - 1, two, one)])


__all__ = ["StepSetup", "Prices", "step_program", "simulate_step", "STEADY_BLOCKS", "RS_LAG"]
