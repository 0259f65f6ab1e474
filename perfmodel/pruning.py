"""A lower bound on a plan's simulated step (:func:`step_bound`) and the pruned ranking built on it
(:func:`pruned_rank`): the same table as simulating every grid, simulating only the grids that can
still appear in it.

**The bound.** Play a step program (:func:`perfmodel.timeline.step_program`) on
:func:`perfmodel.engine.simulate`. The compute stream's time is the sum of its compute actions'
durations and of its stalls (the two never overlap). A compute action of ``s`` seconds runs at
rate ``1/slowdown <= 1`` (every slowdown of the machine >= 1: :func:`_slows_only`), so it lasts
at least ``s``. A collective of the pool 'blocking' is issued and waited for at once
(``Issue(t), Wait(t)``); it starts no earlier than its issue, and progresses at a rate
``<= 1`` (each factor of :class:`perfmodel.engine._Rates` is a slowdown >= 1 or a concurrency
factor ``1 + (s - 1) * n >= 1``), so the stall lasts at least ``latency + work`` -- at least the
seconds of one call priced alone (:meth:`perfmodel.pricing.Pricer.seconds`). Hence, for every
simulated program, ``time >= C + B``: ``C`` its compute seconds, ``B`` the seconds alone of its
blocking collectives. Both are sums over the parts, each block contributing alike, so both are
affine in the number of blocks and of micro-steps, and :func:`perfmodel.timeline.simulate_step`'s
extrapolation of ``C + B`` from the programs it plays is ``C + B`` of the whole step:
:func:`perfmodel.pricing.compute_detail`'s total, plus ``B`` counted from the step's collective
records (one call per micro-step, per block when ``per_block``, of each 'blocking' record; each
'step' record of :attr:`StepSetup.step_colls` ``calls`` times). The expert all-to-all is added to
both sides as is.

A GEMM in row chunks (records of the pool 'chunks', :meth:`perfmodel.timeline._Phases._chunks`)
stalls the compute stream for at least what :mod:`perfmodel.bound_terms` says: its first chunk's
gathers and last chunk's reduce-scatters, or, when the chunks' collectives outrun the GEMM, all of
one group's chunks in a row plus one chunk's GEMM (per record, phase and micro-step, per block; a
model with cached blocks keeps the per-record form: one call of each gather and forward
reduce-scatter).

Two more terms, each a bound of every simulated program by the same premises (a group runs its
collectives one at a time, each at least as long as alone; every collective of a micro-step is
waited for before the step's bookkeeping collectives and optimizer, ``tail``):

* **busiest group**: ``time >= W + tail``, ``W`` the seconds alone of every collective one group
  plays in the micro-steps (the z weight gathers and reduce-scatters on a grid with a large z);
* **data-parallel tail** (:func:`perfmodel.bound_terms.dp_tail`): the buckets' reduce-scatters (or
  all-reduces) are issued from the last micro-step's backward on, so the step lasts at least its seconds before
  that backward, plus the longer of that backward and the buckets' seconds, plus ``tail``; with
  the overlapped sharded optimizer the weight all-gathers run on the same group from the step's
  start, so at least gathers + reductions + ``tail``; the eager schedule adds every bucket and
  gather (each waited for after the backward, or after the optimizer).

Each is affine in the blocks and micro-steps within one regime; where the regime changes between
the extrapolation's programs it is the same assumption as above (checked on every simulated estimate).

What the bound assumes about the program: every record of the pool 'blocking' is played once per
micro-step (per block) as ``Issue, Wait`` with no compute between, the step records likewise, a
chunked record as just said, and every compute piece of ``compute_detail`` is played. Collectives
of other pools ('fwd', 'bwd', 'dx') count for nothing, so moving a record out of 'blocking' keeps
the bound valid (only weaker). The extrapolation
``T(L) = T(P) + (L - P) (T(P) - T(P - 1))`` is not a simulated program: it keeps ``T >= C + B``
when ``E = T - C - B`` (stalls on other collectives, slowed compute) satisfies
``E(P) + (L - P) (E(P) - E(P - 1)) >= 0``, e.g. when ``E`` does not shrink from ``P - 1`` to ``P``
blocks -- the steady state the extrapolation itself assumes. That step is an assumption, not a
theorem; so :func:`pruned_rank` checks ``bound <= simulated`` on every estimate it simulates and,
were it ever false, ranks again without pruning (tests/unit/test_perfmodel_pruning.py checks the
bound on a sample of models, machines and grids). A tighter bound, each program played with every
rate 1 (provably below each simulated program), broke after extrapolation (llama3.1-8b,
``data=2,x=4`` on alps: 0.5446 s > 0.5393 s), which is why this one is used.

**The ranking.** :func:`pruned_rank` gives the list :func:`perfmodel.model.rank_grids` gives
(the same sort keys, the stable sorts' ties in the same order) but that only the first ``shown``
infeasible grids are simulated (the others: their bound, ``bound_only``). It bounds every grid
(planning and pricing only), then simulates grids in increasing order of their bound until the
next bound certainly exceeds the worst estimate still kept (:func:`_least`). A grid whose z may
split the sequence simulates that split only when its bound does not certainly exceed the batch
split's simulated step (:func:`perfmodel.model.estimate_auto`'s ``bound``: the same choice).
"""

from __future__ import annotations

import bisect
from typing import Callable

from axo4d.facts.grid import Grid
from axo4d.facts.spec import ALL_GATHER, Coll

from . import expert_pricing as moe
from .bound_terms import dp_tail, group_elems, segment_extra, segments
from .estimates import Estimate, only_memory
from .machine import Machine
from .plan import Plan, plan_estimate, step_records
from .pricing import Pricer, compute_detail, price
from .search import distinct_orders, traffic_order, with_order
from .step_prices import Prices, StepSetup

MARGIN = 1e-9
"""Relative room for rounding: a bound prunes only when ``bound * (1 - MARGIN)`` exceeds."""
EXTRAPOLATION_SLACK = 0.04
"""The bound is ``(1 - EXTRAPOLATION_SLACK)`` of what the argument above gives: the extrapolated step
is not a simulated program. Where a step's exposed data-parallel tail shrinks from ``P - 1`` to ``P``
blocks, the extrapolation carries that shrinking over every block (the data axis's stall comes out
negative and is cut to 0), and the step comes out below its compute plus the stalls every simulated
program has. Measured against the bound with :mod:`perfmodel.bound_terms`'s segments, 4 of 6,236
plans (llama3.1-8b and gpt-5b, seq 2,048 and 8,192, batch 8-64, 8-32 GPUs of Alps, Perlmutter and
Frontier, every grid with ``z <= 2``, accumulation 1 and 2) came out below it, by at most 3.2%, all
llama3.1-8b at seq 8,192 on Alps with ``data=8`` and ``x`` of 2 or 4 (before the segments, with the
per-record chunk term: 2 plans, 1.2%). Without the slack a pruned grid could have been one of them and
silently missing from the table; a departure beyond it is still caught where simulated. On programs
that are not extrapolated (3 blocks, one micro-step) the bound without the slack held on all 320
plans tried (at most 0.982 of the step: ``tests/unit/test_perfmodel_bound_terms.py``)."""


class BoundFailed(RuntimeError):
    """A simulated step came out below its bound (the ranking is redone without pruning)."""


def _slows_only(machine: Machine) -> bool:
    """Whether every slowdown of ``machine`` is >= 1 (rates <= 1: the bound's premise)."""
    g, c, conc = machine.link_slowdowns()
    vals = [*g.values(), *c.values(), *conc.values()]
    return all(v >= 1.0 for v in vals)


class Bounds:
    """:func:`step_bound` and :func:`bound` for one ranking (one model, batch and machine), the pieces
    that do not depend on the rank order (the collective records, the compute seconds) computed
    once per grid's sizes and options."""

    def __init__(self) -> None:
        self._sizes: dict[tuple, tuple[list[Coll], list[Coll], list[Coll], float]] = {}

    def _pieces(self, st: Plan) -> tuple:
        """The step's collective records (:func:`perfmodel.plan.step_records`), the micro-step's
        played in the timeline, the bookkeeping ones, the step's compute seconds (priced alone)
        and :func:`_phases` of them, memoised per grid sizes and options."""
        g, o = st.spec.grid, st.opts  # the grid the model runs on (x and y may be exchanged)
        key = (g.data, g.x, g.y, g.z, o, st.n_cache, st.rows)
        v = self._sizes.get(key)
        if v is None:
            micro = moe.micro_collectives(st.spec, st.rows, o.dtypes, o.checkpointing, st.n_cache)
            colls, dp, book = step_records(st)
            setup = StepSetup(
                st.spec, st.rows, o.dtypes, o.checkpointing, o.overlap, st.n_cache, o.grad_accum, o.dp_bucket_mb,
                o.flash_attention, tuple(dp), tuple(book),
            )  # fmt: skip
            pricer = Pricer(st.spec.grid, st.machine, st.gpn)
            prices = Prices(setup, st.machine, pricer.link, pricer.link_class)
            detail = compute_detail(setup, prices)
            dx_gemm = lambda p, in_block: prices.part(p, "bwd", in_block)[0]  # noqa: E731
            segs = None if st.n_cache else segments(st.spec, micro, prices.fwd_gemm, dx_gemm)
            v = self._sizes[key] = (colls, micro, book, detail, dp, group_elems(st.spec), segs)
        return v

    def step_bound(self, st: Plan) -> tuple[float, dict[str, float]]:
        """``(lower bound on the step's seconds, seconds alone per axis)`` of ``st`` (module
        docstring; 0 when a slowdown of the machine is below 1). The seconds per axis are
        :func:`perfmodel.pricing.price`'s (the same records, the same order)."""
        o, spec = st.opts, st.spec
        colls, micro, book, detail, dp, elems, segs = self._pieces(st)
        pricer = Pricer(spec.grid, st.machine, st.gpn)  # the grid with its expert group, as plan.priced
        comm = price(colls, spec, pricer)[0]
        if not _slows_only(st.machine):
            return 0.0, comm
        b_fwd = b_bwd = b_book = 0.0
        busy: dict[tuple[str, ...], float] = {}  # per group: seconds alone of a micro-step's tasks
        for c in micro:  # the timeline's: one call of each blocking record per micro-step counted
            t1 = pricer.seconds(c)
            if t1 > 0.0 and c.phase in ("fwd", "bwd", "recompute") and c.calls >= 1:
                calls = c.calls if c.pool in ("blocking", "fwd", "bwd", "chunks") else 1  # each chunk a task
                busy[c.axes] = busy.get(c.axes, 0.0) + t1 * calls * (spec.n_layer if c.per_block else 1)
            chunk = c.pool == "chunks" and (c.kind == ALL_GATHER or c.phase != "bwd")
            exposed = c.pool == "blocking" or (chunk and segs is None)
            if exposed and t1 > 0.0 and c.phase in ("fwd", "bwd", "recompute") and c.calls >= 1:
                t = t1 * (spec.n_layer if c.per_block else 1)
                if c.phase == "fwd":
                    b_fwd += t
                else:
                    b_bwd += t
        for seg in segs or ():  # the GEMMs in row chunks: bound_terms' segments
            t = segment_extra(seg, pricer.seconds) * seg[5]
            if seg[0] == "fwd":
                b_fwd += t
            else:
                b_bwd += t
        for c in book:  # the step's records: each one task of ``calls`` calls, issued and waited for
            if c.pool == "blocking":
                b_book += pricer.seconds(c) * c.calls
        accum = o.grad_accum
        stream = detail["total_s"] + accum * (b_fwd + b_bwd) + b_book
        last_bwd = (detail["backward_s"] + detail["recompute_s"]) / accum + b_bwd
        tail = detail["other_s"] + b_book
        extra = dp_tail(dp, elems, o.dtypes, pricer, o.overlap, stream, last_bwd, tail)
        # a group runs its tasks one at a time, each at least as long as alone, all waited for
        # before the step's bookkeeping collectives and optimizer
        extra = max(extra, max(busy.values(), default=0.0) * accum + tail - stream)
        a2a = moe.a2a_seconds(
            spec, st.rows, o.dtypes, moe.expert_parallel(spec, o.expert, o.imbalance), st.machine, st.gpn, o
        )
        return (stream + extra) * (1.0 - MARGIN - EXTRAPOLATION_SLACK) + a2a, comm

    def __call__(self, st: Plan, programs: object = None) -> Estimate:
        """``st`` as an :class:`Estimate` whose ``step_time_s`` is :meth:`step_bound`'s (``bound_only``;
        feasibility, reason, memory, seconds alone per axis exact)."""
        t, comm = self.step_bound(st)
        return bound_estimate(st, t, comm)


def step_bound(st: Plan) -> tuple[float, dict[str, float]]:
    """:meth:`Bounds.step_bound` of one plan."""
    return Bounds().step_bound(st)


def bound_estimate(st: Plan, t: float, comm: dict[str, float]) -> Estimate:
    """``st`` as an :class:`Estimate` of step ``t`` (a bound: ``bound_only``)."""
    return plan_estimate(
        st, step_time_s=t, compute_s=0.0, comm_s=comm, exposed_comm_s=0.0, bytes_per_rank={}, bound_only=True
    )


def above(lb: float, t: float) -> bool:
    """Whether the bound ``lb`` certainly exceeds ``t``."""
    return lb * (1.0 - MARGIN) > t


def _least(cands: list[int], n: int, lb: Callable[[int], float], t: Callable[[int], float]) -> list[int]:
    """The candidates to compute so that the ``n`` of least ``t`` (any tie order) are among them:
    in increasing order of their bound ``lb``, until ``n`` are computed and the next bound
    certainly exceeds the ``n``-th least ``t`` computed (every other candidate's ``t`` is larger)."""
    done: list[int] = []
    times: list[float] = []
    if n <= 0:
        return done
    for i in sorted(cands, key=lambda i: (lb(i), i)):
        if len(done) >= n and above(lb(i), times[n - 1]):
            break
        done.append(i)
        bisect.insort(times, t(i))
    return done


class Ranking:
    """One ranking's grids, their bounds and their estimates, computed on demand.

    ``est(grid)`` and ``bnd(grid)``: the exact estimate of a grid in its order and its bound
    (``bnd`` also returns the estimates its feasible choices could be: their orders of traffic
    are the candidates of :func:`perfmodel.search.traffic_order`)."""

    def __init__(
        self,
        grids: list[Grid],
        first: Callable[[int], Estimate | None],
        est: Callable[[Grid], Estimate],
        bnd: Callable[[Grid], tuple[Estimate, list[Estimate]]],
        search: bool,
        progress: Callable[[int, int], None] | None = None,
    ) -> None:
        self.grids, self.est, self.bnd, self.search, self.progress = grids, est, bnd, search, progress
        self.b: dict[int, Estimate] = {}
        self.lb: dict[int, float] = {}
        self.fixed: dict[int, Estimate] = {}
        for i in range(len(grids)):
            e = first(i)
            if e is not None:  # listed without an estimate
                self.fixed[i] = e
                continue
            self.b[i], leaves = bnd(grids[i])
            lb = self.b[i].step_time_s
            if search and self.b[i].feasible:
                for o in {traffic_order(grids[i], x.comm_s) for x in leaves if x.feasible}:
                    lb = min(lb, bnd(with_order(grids[i], o))[0].step_time_s)
            self.lb[i] = lb
            if progress is not None:
                progress(i + 1, len(grids))
        self._d: dict[int, Estimate] = {}
        self._e: dict[int, Estimate] = {}

    def d(self, i: int) -> Estimate:
        """Grid ``i`` in its own order (exact; checked against its bound)."""
        if i in self.fixed:
            return self.fixed[i]
        v = self._d.get(i)
        if v is None:
            v = self._d[i] = _checked(self.est(self.grids[i]), self.b[i].step_time_s)
            if self.progress is not None:  # every grid bounded; simulating those that can be shown
                self.progress(len(self.grids), len(self.grids))
        return v

    def e(self, i: int) -> Estimate:
        """Grid ``i`` after its traffic order (``order='search'``; else its own order), the traffic
        order simulated only when its bound does not certainly exceed the own order's step."""
        v = self._e.get(i)
        if v is None:
            d = self.d(i)
            v = d
            if self.search and d.feasible:
                g = with_order(d.grid, traffic_order(d.grid, d.comm_s))
                if not above(self.bnd(g)[0].step_time_s, d.step_time_s):  # else it cannot be faster
                    t = self.est(g)
                    v = t if t.feasible and t.step_time_s < d.step_time_s else d
                _checked(v, self.lb[i])
            self._e[i] = v
        return v

    def best_order(self, i: int, orders_lb: Callable[[Grid], float]) -> Estimate:
        """Grid ``i`` in the best of its distinct orders (``_search_orders``' choice: the first
        least of the others, kept when faster), orders bounded above the best found unsimulated."""
        e = self.e(i)
        others = distinct_orders(e.grid)[1:]
        lbs = [orders_lb(with_order(e.grid, o)) for o in others]
        best, best_k = None, -1
        limit = e.step_time_s
        for k in sorted(range(len(others)), key=lambda k: (lbs[k], k)):
            if above(lbs[k], limit):
                break
            c = _checked(self.est(with_order(e.grid, others[k])), lbs[k])
            if best is None or (c.step_time_s, k) < (best.step_time_s, best_k):
                best, best_k = c, k
                limit = min(limit, c.step_time_s)
        return best if best is not None and best.step_time_s < e.step_time_s else e


def _checked(e: Estimate, lb: float) -> Estimate:
    if e.step_time_s < lb:
        raise BoundFailed(f"{e.grid.spec()} order {','.join(e.grid.order)}: step {e.step_time_s!r} < bound {lb!r}")
    return e


def _kind(e: Estimate) -> int:
    return 0 if e.feasible else 1 if only_memory(e.reason) else 2


def pruned_rank(r: Ranking, top: int | None, shown: int, search_top: int) -> list[Estimate]:
    """The ranking of ``r`` as :func:`perfmodel.model.rank_grids` sorts it (before ties and the
    ``top`` cut), every feasible grid that can be among the ``top`` (and the ``search_top`` searched
    in every order) and the first ``shown`` infeasible ones simulated, the other infeasible ones
    after them as bounds (``bound_only``); the feasible ones that cannot be shown left out."""
    idx = [i for i in range(len(r.grids)) if i not in r.fixed]
    feas = [i for i in idx if r.b[i].feasible]
    need = len(feas) if top is None else max(top, search_top if r.search else 0)
    got = _least(feas, need, r.lb.__getitem__, lambda i: r.e(i).step_time_s)
    got.sort(key=lambda i: (r.e(i).step_time_s, r.d(i).step_time_s, i))
    final = {i: r.e(i) for i in got}
    if r.search:
        cache: dict[tuple, float] = {}

        def olb(g: Grid) -> float:
            key = (g.data, g.x, g.y, g.z, tuple(g.order))
            if key not in cache:
                cache[key] = r.bnd(g)[0].step_time_s
            return cache[key]

        for i in got[:search_top]:
            final[i] = r.best_order(i, olb)
    pos = {i: n for n, i in enumerate(got)}
    got.sort(key=lambda i: (final[i].step_time_s, pos[i]))
    out = [final[i] for i in got]
    # infeasible: (memory only, then the rest) by step time, ties in the grids' order
    bad = [i for i in range(len(r.grids)) if i in r.fixed or not r.b[i].feasible]
    kind = {i: _kind(r.fixed[i] if i in r.fixed else r.b[i]) for i in bad}
    lb = {i: (r.fixed[i] if i in r.fixed else r.b[i]).step_time_s for i in bad}
    exact: list[int] = []
    for k in (1, 2):
        of = [i for i in bad if kind[i] == k]
        exact += _least(of, max(0, shown - len(exact)), lb.__getitem__, lambda i: r.d(i).step_time_s)
    exact = sorted(exact, key=lambda i: (kind[i], r.d(i).step_time_s, i))[:shown]
    kept = set(exact)
    rest = sorted((i for i in bad if i not in kept), key=lambda i: (kind[i], lb[i], i))
    return out + [r.d(i) for i in exact] + [r.fixed.get(i) or r.b[i] for i in rest]


__all__ = [
    "MARGIN",
    "EXTRAPOLATION_SLACK",
    "BoundFailed",
    "Bounds",
    "step_bound",
    "bound_estimate",
    "above",
    "Ranking",
    "pruned_rank",
]
