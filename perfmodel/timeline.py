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
from typing import Any

from axo4d.facts.schedule_rules import RS_LAG
from axo4d.facts.spec import ALL_GATHER, REDUCE_SCATTER, Coll, LinearSpec, ModelSpec

from .dp_buckets import Buckets
from .engine import Compute, Issue, Result, Task, Wait, simulate
from .expert_pricing import rows_of
from .step_prices import Prices, StepSetup

STEADY_BLOCKS = 3
"""Blocks of each kind simulated before extrapolating (enough for the prefetch and reduce-scatter
pipeline to reach its steady state)."""


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
    buckets = Buckets(layout, setup, prices)
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
    t = prices.task(c, calls=c.calls)
    if t is not None:
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

    def _chunks(self, gathers: list, scatters: list, gemm: float, wait_scatters: bool) -> list:
        """A GEMM of ``gemm`` seconds in row chunks (:meth:`LinearSpec.fwd_chunks`, ``bwd_chunks``: the
        chunked collectives have that many calls): every chunk's all-gather (of ``gathers``) issued
        first and waited for before its chunk's GEMM (eager: issued there), each chunk's
        reduce-scatter (of ``scatters``) issued behind it (waited for at once when
        ``wait_scatters``); gives the reduce-scatters' tasks."""
        ops, task, overlap = self.ops, self.prices.task, self.overlap
        n = (gathers or scatters)[0].calls
        gs = [[task(c) for c in gathers] for _ in range(n)]
        rs = [[task(c) for c in scatters] for _ in range(n)]
        if overlap:
            ops.extend(Issue(t) for ts in gs for t in ts)
        for ts, r in zip(gs, rs):
            ops.extend(([] if overlap else [Issue(t) for t in ts]) + [Wait(t) for t in ts] + [Compute(gemm / n)])
            ops.extend(a for t in r for a in ([Issue(t), Wait(t)] if wait_scatters else [Issue(t)]))
        return [t for r in rs for t in r]

    def _forward_gemm(self, part: Any, chunked: list, before: float) -> float:
        """The forward GEMM in row chunks, each chunk's input gathered before it and its output
        reduce-scattered behind the next one (:meth:`_chunks`); what is left of the part's compute."""
        if not chunked:
            return before
        gemm = self.prices.fwd_gemm(part)
        ags = [c for c in chunked if c.kind == ALL_GATHER]
        rss = self._chunks(ags, [c for c in chunked if c.kind != ALL_GATHER], gemm, not self.overlap)
        self.ops.extend(Wait(t) for t in rss if self.overlap)
        return max(0.0, before - gemm)

    def _dx_gemm(self, chunked: list, dxs: list, before: float) -> tuple[list, float]:
        """The backward's dX GEMM (``before``: a linear layer's dX GEMM) and its dX reduce-scatters
        (issued, waited for at the phase's end): in row chunks when its collectives are chunked
        (``bwd_chunks``: each chunk's dY gathered before it, its dX reduce-scatter issued behind it)."""
        if chunked or any(c.calls > 1 for c in dxs):
            return self._chunks(chunked, dxs, before, False), 0.0
        self.ops.append(Compute(before))
        dx = [self.prices.task(c) for c in dxs]
        self.ops.extend(Issue(t) for t in dx)
        return dx, 0.0

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
        if step == "bwd":
            dx, before = self._dx_gemm(chunked, dxs, before)
        else:
            ops.append(Compute(self._forward_gemm(part, chunked, before)))
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
        for c in blocking:  # all of a record's calls (a norm's two parameter gradients: two gathers)
            _blocking(prices, c, ops)
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
    buckets: Buckets | None,
    gathers: Buckets,
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


def _drain(rs: list, keep: int, ops: list, buckets: Buckets | None) -> None:
    while len(rs) > keep:
        t, slot = rs.pop(0)
        ops.append(Wait(t))
        if buckets is not None:
            ops.append(("rs_final", slot))


def _resolve(ops: list, overlap: bool, buckets: Buckets | None, gathers: Buckets | None) -> list:
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


def simulate_step(setup: StepSetup, prices: Prices, slowdowns: tuple, programs: Any = None) -> Result:
    """The step of ``setup`` (every block and micro-step, by extrapolation; module docstring).
    ``programs(setup, prices, uncached, cached, micro)``: what writes the step programs (default
    :func:`step_program`; :class:`perfmodel.programs.Programs` reuses them across rank orders)."""
    write = step_program if programs is None else programs
    g, c, conc = slowdowns
    L = setup.spec.n_layer
    n_c = min(setup.cached_blocks, L)
    n_u = L - n_c
    p_u, p_c = min(n_u, STEADY_BLOCKS), min(n_c, STEADY_BLOCKS)
    micro = setup.grad_accum

    def run(u: int, k: int, m: int) -> Result:
        return simulate(write(setup, prices, u, k, m), g, c, conc)

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
