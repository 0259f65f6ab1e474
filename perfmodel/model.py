"""Grid ranking, and the step-time, memory and feasibility estimate of one grid (:mod:`perfmodel.one_grid`).

``estimate`` prices every collective of a step (:mod:`perfmodel.costs`, the parts' own records in
:mod:`axo4d.facts.spec`) with the ring alpha-beta model of :mod:`perfmodel.collectives` on the bandwidth
of its group (:meth:`perfmodel.machine.Machine.bandwidth` at the group's stride and size), the
local GEMMs, attention and elementwise work from measured rates (:mod:`perfmodel.compute`), and
plays the step as the implementation schedules it, layer by layer (:mod:`perfmodel.timeline`,
:mod:`perfmodel.engine`): prefetched gathers, the dX all-reduce behind the dW GEMM, background
reduce-scatters, data-parallel buckets, with the measured slowdown of compute while a collective
moves data and the sharing of links between concurrent collectives. ``overlap=False`` plays the
eager schedule. Exposed communication is what the compute stream waited for, per axis.

``rank_grids`` estimates every grid of a job (and, with ``order='search'``, every rank order of
the best ones: which groups stay inside a node) and flags as ties the grids whose predicted step
is within the machine's stated ``uncertainty`` of the best.
"""

from __future__ import annotations

import contextlib
import gc
from typing import Any, Callable, Iterable, Iterator

from axo4d.config import ModelConfig
from axo4d.facts.archs import model_spec
from axo4d.facts.grid import AXES, Grid, all_grids
from axo4d.facts.run import micro_batch

from . import expert_pricing as moe
from .estimates import Estimate, sort_estimates, unestimated
from .machine import Machine
from .one_grid import _plan_auto as _plan_auto
from .one_grid import estimate as estimate
from .one_grid import estimate_auto as estimate_auto
from .one_grid import fitting_cache_blocks as fitting_cache_blocks
from .one_grid import in_order as in_order
from .plan import DEFAULT_BUCKET_MB as DEFAULT_BUCKET_MB
from .plan import LinkMemo, Plan, cache_memory_bytes, step_flops
from .pruning import BoundFailed, Bounds, Ranking, pruned_rank
from .search import distinct_orders, mark_ties, traffic_order, with_order


def _better(a: Estimate, b: Estimate) -> Estimate:
    return b if b.feasible and b.step_time_s < a.step_time_s else a


ORDER_SEARCH_TOP = 12
"""With ``order='search'``: how many of the best grids (in the default order) get every order."""
FULL_SEARCH_MAX = 2000
"""Above this many grids, those whose sizes do not divide the model or the batch are listed with
their reason but not estimated (an estimate takes milliseconds; 10^9 GPUs have 48,400 grids)."""


def sizes_reason(model: ModelConfig, grid: Grid, global_batch: int, grad_accum: int = 1, z_split: str = "batch") -> str:
    """Why ``grid``'s sizes cannot run ``model`` at ``global_batch`` ('' when they can): integer
    checks of the batch first, then the model's divisibility (no pricing); ``z_split`` 'sequence'
    or 'auto': the sequence split counts too."""
    micro = micro_batch(global_batch, grad_accum)
    shards = grid.size("data", "z")
    if global_batch % max(1, grad_accum) or micro % shards:
        seq = z_split != "batch" and grid.z > 1 and not micro % grid.size("data")
        if not seq:
            return f"micro-batch {micro} not divisible by G_data*G_z={shards}"
        return "; ".join(model_spec(model, grid).with_sequence_split().divisibility_reasons(micro))
    return "; ".join(model_spec(model, grid).divisibility_reasons(micro))


def _first_pass(
    grids: list[Grid], est: Callable[[Grid], Estimate], progress: Callable[[int, int], None] | None
) -> Callable[[Grid], Estimate]:
    """``est`` that reports each grid done to ``progress``."""
    done = [0]

    def run(g: Grid) -> Estimate:
        e = est(g)
        done[0] += 1
        if progress is not None:
            progress(done[0], len(grids))
        return e

    return run


def _search_orders(ests: list[Estimate], est: Callable[[Grid], Estimate]) -> list[Estimate]:
    """``order='search'``: each feasible grid also in its traffic order, then the
    :data:`ORDER_SEARCH_TOP` best in every distinct order, each keeping its best; sorted again."""
    ests = sort_estimates(
        _better(e, est(with_order(e.grid, traffic_order(e.grid, e.comm_s)))) if e.feasible else e for e in ests
    )
    best = [e for e in ests if e.feasible][:ORDER_SEARCH_TOP]
    chosen = {
        id(e): min(
            (est(with_order(e.grid, o)) for o in distinct_orders(e.grid)[1:]),
            key=lambda x: x.step_time_s,
            default=e,
        )
        for e in best
    }
    ests = sort_estimates(c if c.step_time_s < e.step_time_s else e for e in ests for c in [chosen.get(id(e), e)])
    return ests


@contextlib.contextmanager
def _no_cycle_collection() -> Iterator[None]:
    """The cyclic garbage collector paused (and restored as it was): a ranking makes millions of
    short-lived objects that reference counting frees, and keeps the step programs it reuses
    (:class:`perfmodel.programs.Programs`), which the collector's full passes would scan again and
    again (a fifth of a ranking's CPU time, measured on gpt-80b at 4,096 GPUs)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def rank_grids(
    model: ModelConfig,
    gpus: int,
    gpus_per_node: int | None,
    global_batch: int,
    machine: Machine,
    *,
    overlap: bool = True,
    checkpointing: bool | None = None,
    order: str | Iterable[str] | None = None,
    top: int | None = None,
    progress: Callable[[int, int], None] | None = None,
    shown_infeasible: int | None = None,
    prune: bool = True,
    **kw: Any,
) -> list[Estimate]:
    """Estimate every grid ``data*x*y*z == gpus`` and sort them, feasible first
    by predicted step time; grids within the machine's ``uncertainty`` of the best are flagged
    ``tie``. Of more than :data:`FULL_SEARCH_MAX` grids, those whose sizes do not divide the
    model or the batch are not estimated. ``order``: the rank order of every grid (default x,y,z,data), or ``'search'``:
    every grid is also tried in its traffic order (:func:`perfmodel.search.traffic_order`) and
    the :data:`ORDER_SEARCH_TOP` best then in every distinct order, each keeping its best. ``top``
    keeps the best ``top`` feasible grids (all infeasible ones follow, with
    reasons). ``checkpointing=None``: per grid, without if it fits in memory, else with. Extra
    keywords go to :func:`estimate_auto` (``cache_weights='auto'`` included). ``progress(done,
    total)`` is called after each grid of the first pass. Every (sizes, order) is estimated once.

    ``shown_infeasible``: only the first that many infeasible grids are simulated, the others
    follow with their reasons and a lower bound (``bound_only``; default: all simulated). With
    ``top`` or ``shown_infeasible``, grids that cannot be among them are not simulated
    (:mod:`perfmodel.pruning`; the same list otherwise); ``prune=False`` simulates every grid.
    """
    if gpus < 1:
        raise ValueError(f"number of GPUs must be >= 1, got {gpus}")
    if global_batch < 1:
        raise ValueError(f"global batch must be >= 1 sample, got {global_batch}")
    gpn = machine.check_gpus_per_node(gpus_per_node)
    args = (model, gpus, gpn, global_batch, machine, overlap, checkpointing, order, top, progress, kw)
    with _no_cycle_collection():
        if prune and (top is not None or shown_infeasible is not None):
            try:
                return _rank(*args, shown=shown_infeasible)
            except BoundFailed:  # a step below its bound: every grid simulated instead
                pass
        return _rank(*args)


def _rank(
    model: ModelConfig,
    gpus: int,
    gpn: int,
    global_batch: int,
    machine: Machine,
    overlap: bool,
    checkpointing: bool | None,
    order: str | Iterable[str] | None,
    top: int | None,
    progress: Callable[[int, int], None] | None,
    kw: dict[str, Any],
    shown: int | None = -1,
) -> list[Estimate]:
    """:func:`rank_grids` after its checks (``gpn``: the GPUs per node checked; ``shown``: the
    infeasible grids simulated, :func:`perfmodel.pruning.pruned_rank`, ``None`` all, -1: no pruning)."""
    search = isinstance(order, str) and order.strip().lower() == "search"
    plans: dict[tuple, Plan] = {}
    eps: dict[tuple, list[int]] = {}  # the expert-group sizes of a grid's sizes (one model)

    links: dict[tuple, tuple] = {}  # the link signatures, shared by the estimates and the bounds
    bounds = LinkMemo(Bounds(), links)  # a plan's bound (pruned rankings), memoised as the estimates
    every_plan = _every_plan(model, global_batch, machine, checkpointing, overlap, gpn, kw, plans, eps)
    est = every_plan(LinkMemo(links=links), None if shown == -1 else lambda st: bounds(st).step_time_s)
    grids = all_grids(gpus, None if search else order)
    why = {}
    if len(grids) > FULL_SEARCH_MAX:
        why = {
            id(g): sizes_reason(model, g, global_batch, kw.get("grad_accum", 1), kw.get("z_split", "batch"))
            for g in grids
        }
    if shown != -1:
        bnd = every_plan(bounds)
        ests = _pruned(grids, why, est, bnd, search, top, shown, progress, machine, global_batch)
        mark_ties(ests)
        return _top(ests, top)
    first = _first_pass(grids, est, progress)
    ests = sort_estimates(
        unestimated(g, why[id(g)], machine, global_batch) if why.get(id(g)) else first(g) for g in grids
    )
    if search:
        ests = _search_orders(ests, est)
    mark_ties(ests)
    return _top(ests, top)


def _every_plan(
    model: ModelConfig,
    global_batch: int,
    machine: Machine,
    checkpointing: bool | None,
    overlap: bool,
    gpn: int,
    kw: dict[str, Any],
    plans: dict[tuple, Plan],
    eps: dict[tuple, list[int]],
) -> Callable[..., Callable[[Grid, list | None], Estimate]]:
    """``every_plan(price, bound=None)``: the estimate of a grid in its order for one ranking, each
    plan priced by ``price`` (memoised; ``plans`` and ``eps`` shared by the ranking's estimates and
    bounds); ``seen`` collects the estimates of the plans it priced; ``bound``: :func:`estimate_auto`'s."""

    def every_plan(price: Callable, bound: Callable | None = None) -> Callable[[Grid, list | None], Estimate]:
        memo: dict[tuple, Estimate] = {}

        def est(g: Grid, seen: list | None = None) -> Estimate:
            key = (g.data, g.x, g.y, g.z, tuple(g.order))
            e = memo.get(key)
            if e is None:
                timed = price if seen is None else lambda st: seen.append(price(st)) or seen[-1]
                ests: list[Estimate] = []  # every expert-group size (one for a dense model)
                for d in _candidates(eps, model, g):
                    fast = [x.step_time_s for x in ests if x.feasible]  # a size bounded above them: not simulated
                    ests.append(estimate_auto(
                        model, g, global_batch, machine, checkpointing, timed=timed, plans=plans, bound=bound,
                        limit=min(fast, default=None), overlap=overlap, gpus_per_node=gpn, expert=d, **kw,
                    ))  # fmt: skip
                e = memo[key] = moe.best(ests)
            return e

        return est

    return every_plan


def _candidates(eps: dict[tuple, list[int]], model: ModelConfig, g: Grid) -> list[int]:
    """:func:`perfmodel.expert_pricing.ep_candidates` of ``model`` on ``g``, remembered in ``eps``
    per grid sizes (they depend on the model and the sizes, not the rank order)."""
    key = (g.data, g.x, g.y, g.z)
    v = eps.get(key)
    if v is None:
        v = eps[key] = moe.ep_candidates(model_spec(model, g))
    return v


def _pruned(grids, why, est, bnd, search, top, shown, progress, machine, global_batch) -> list[Estimate]:
    """:func:`perfmodel.pruning.pruned_rank` of ``grids`` (``why``: the reasons of grids listed
    without an estimate; ``est``, ``bnd``: a grid's estimate, its bound)."""

    def first(i: int) -> Estimate | None:
        g = grids[i]
        return unestimated(g, why[id(g)], machine, global_batch) if why.get(id(g)) else None

    def bnd_leaves(g: Grid) -> tuple[Estimate, list[Estimate]]:
        seen: list[Estimate] = []
        return bnd(g, seen), seen

    r = Ranking(grids, first, est, bnd_leaves, search, progress)
    return pruned_rank(r, top, len(grids) if shown is None else shown, ORDER_SEARCH_TOP)


def _top(ests: list[Estimate], top: int | None) -> list[Estimate]:
    """The best ``top`` feasible estimates, then every infeasible one."""
    if top is not None:
        feas = [e for e in ests if e.feasible]
        ests = feas[: max(0, top)] + [e for e in ests if not e.feasible]
    return ests


__all__ = [
    "Estimate",
    "estimate",
    "estimate_auto",
    "rank_grids",
    "step_flops",
    "sort_estimates",
    "AXES",
    "cache_memory_bytes",
    "fitting_cache_blocks",
    "ORDER_SEARCH_TOP",
]
