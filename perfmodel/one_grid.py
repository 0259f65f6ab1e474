"""The estimate of one grid (:func:`estimate`) and the plan :func:`perfmodel.model.rank_grids` keeps for
it (:func:`estimate_auto`): recomputation only where memory needs it, the cached blocks that fit,
and the z split that is feasible or faster; ``plans`` remembers a ranking's plans per grid sizes
(another rank order reuses them, :func:`in_order`).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable

from axo4d.config import ModelConfig
from axo4d.facts.archs import model_spec
from axo4d.facts.grid import Grid
from axo4d.facts.run import run_grid
from axo4d.facts.spec import Dtypes, ModelSpec

from . import expert_pricing as moe
from .estimates import Estimate, only_memory
from .machine import Machine
from .plan import Options, Plan, cache_memory_bytes, plan, timed
from .pruning import above, bound_estimate


def estimate(
    model: ModelConfig, grid: Grid, global_batch: int, machine: Machine, *, checkpointing: bool = False, **kw: Any
) -> Estimate:
    """Estimate one training step of ``model`` on ``grid`` (see module docstring).

    Keywords (defaults in :class:`Options`): ``overlap``, ``checkpointing``, ``gpus_per_node``,
    ``dtypes``, ``flash_attention``, ``dp_bucket_mb``, ``grad_accum``, ``cache_weights``,
    ``shard_optimizer``, ``offload``, ``fp8``, ``fp8_layers``, ``z_split``.

    ``z_split``: 'batch' or 'sequence' (``parallel.z_split``; :meth:`axo4d.facts.spec.ModelSpec.with_sequence_split`:
    K/V all-gathers over z and their reduce-scatters, attention's causal work per rank, the
    gathered K/V in memory, the micro-batch divided by G_data only).

    ``fp8`` / ``fp8_layers``: ``train.fp8`` and ``train.fp8_layers`` -- the layers of the rule
    (:mod:`axo4d.facts.fp8_rule`) run FP8 GEMMs (:mod:`perfmodel.compute`), gather their blocks over z
    in FP8 and agree their scales (:meth:`axo4d.facts.spec.LinearSpec.collectives`); a machine without
    FP8 GEMMs makes the grid infeasible (priced as bf16).

    ``grad_accum`` micro-steps of ``global_batch / grad_accum`` samples each
    (as ``train.grad_accum``); ``cache_weights``: blocks whose gathered weights are kept for
    backward (a number, or ``parallel.cache_weights``' 'off'/'all'/N); ``shard_optimizer``
    (``None``: 'auto', on when G_data > 1) and ``offload`` ('none', 'optimizer', 'auto'): the
    data-parallel collectives and the memory of :mod:`axo4d.facts.memory`. Infeasible grids
    (divisibility, memory) are still estimated (with fractional shapes where sizes do not
    divide) and carry ``reason``.
    """
    return timed(plan(model, grid, global_batch, machine, Options(checkpointing=checkpointing, **kw)))


def _plan_auto(
    model: ModelConfig, grid: Grid, global_batch: int, machine: Machine, checkpointing: bool | None, o: Options
) -> Plan:
    """The estimate :func:`estimate_auto` keeps for one ``z_split``, before pricing: recomputation
    only when memory alone refuses the grid without it, then the cached blocks that fit."""
    cache = o.cache_weights
    auto = isinstance(cache, str) and cache.strip().lower() == "auto"
    o = replace(o, cache_weights=0 if auto else cache)
    if checkpointing is None:
        st = plan(model, grid, global_batch, machine, replace(o, checkpointing=False))
        if not st.feasible and only_memory(st.reason):
            st = plan(model, grid, global_batch, machine, replace(o, checkpointing=True))
    else:
        st = plan(model, grid, global_batch, machine, replace(o, checkpointing=checkpointing))
    if not auto or not st.feasible or grid.z == 1:
        return st
    spec = model_spec(model, run_grid(model, grid, st.gpn))  # x and y exchanged as plan() does
    n = _fitting_blocks(spec, st.memory["total"], machine.usable_memory_bytes, o.dtypes)
    return plan(model, grid, global_batch, machine, replace(st.opts, cache_weights=n)) if n else st


def _memo_plan(plans: dict[tuple, Plan]) -> Callable[..., Plan]:
    """:func:`_plan_auto` remembering its plans in ``plans``; a plan of the same sizes in another
    rank order is the one made with the grid replaced (the order changes links, priced later,
    not the parts, memory or reasons: tests/unit/test_perfmodel_pruning.py checks it)."""

    def planned(
        model: ModelConfig, grid: Grid, global_batch: int, machine: Machine, checkpointing: bool | None, o: Options
    ) -> Plan:
        run = run_grid(model, grid, machine.check_gpus_per_node(o.gpus_per_node))  # as plan() runs it
        key = (run.data, run.x, run.y, run.z, model, global_batch, machine.name, checkpointing, o)
        st = plans.get(key)
        if st is None:
            st = plans[key] = _plan_auto(model, grid, global_batch, machine, checkpointing, o)
        return st if st.grid == grid else in_order(st, grid)

    return planned


def in_order(st: Plan, grid: Grid) -> Plan:
    """``st`` on ``grid``: the same sizes in another rank order (its specs on the grid with its
    expert group, as :func:`perfmodel.plan.plan` builds them), where the model runs on grids of the
    same sizes (x and y exchanged in both or in neither: :func:`axo4d.facts.run.derive.run_grid`)."""
    run = run_grid(st.model, grid, st.gpn)  # x and y exchanged as plan() does
    if (run.data, run.x, run.y, run.z) != (st.spec.grid.data, st.spec.grid.x, st.spec.grid.y, st.spec.grid.z):
        raise ValueError(f"{grid.spec()} in order {','.join(grid.order)} runs as {run.spec()}, not as {st.spec.grid}")
    eg = moe.expert_grid(run, st.opts.expert)
    full = None if st.full_spec is None else replace(st.full_spec, grid=eg)
    return replace(st, grid=grid, spec=replace(st.spec, grid=eg), full_spec=full)


def estimate_auto(
    model: ModelConfig,
    grid: Grid,
    global_batch: int,
    machine: Machine,
    checkpointing: bool | None = None,
    *,
    timed: Callable[[Plan], Estimate] = timed,
    plans: dict[tuple, Plan] | None = None,
    bound: Callable[[Plan], float] | None = None,
    limit: float | None = None,
    **kw: Any,
) -> Estimate:
    """``estimate`` with ``checkpointing=None`` meaning: without if it fits, else with;
    ``cache_weights='auto'``: as many cached blocks as the memory left fits (0 when none); and
    ``z_split='auto'`` (``perfmodel``'s command line; here the default is 'batch'): the batch
    split, or the sequence split where it is the only feasible one or faster (``z_split_note``
    says which). The sequence split's attention (SDPA with a mask) keeps no scores whatever
    ``flash_attention`` says; the batch split follows ``flash_attention``. Only the estimates
    kept are priced (the choices need memory and feasibility alone). ``timed``: what prices a
    plan (:func:`perfmodel.plan.timed`, or a :class:`perfmodel.plan.LinkMemo` sharing the answers of equal plans).
    ``plans``: a dict remembering the plans made (a ranking's, shared by its estimates and bounds).
    ``bound``: a lower bound on a plan's simulated step (:mod:`perfmodel.pruning`; a pruned
    ranking's): with both splits feasible, the sequence split is not simulated when its bound
    certainly exceeds the batch split's step (it could not be chosen: the same answer). ``limit``
    (with ``bound``): a step already found for the grid (another expert-group size): where every
    plan this would simulate is feasible and its bound certainly exceeds ``limit``, nothing is
    simulated and the batch split's plan comes back as a bound (``bound_only``, its step the bound:
    above ``limit``, so never the faster)."""
    z_split = kw.pop("z_split", "batch")
    o = Options(**kw)
    make = _plan_auto if plans is None else _memo_plan(plans)
    if z_split != "auto":
        one = make(model, grid, global_batch, machine, checkpointing, replace(o, z_split=z_split))
        return _beyond(one, [one], bound, limit) or timed(one)
    sb = make(model, grid, global_batch, machine, checkpointing, replace(o, z_split="batch"))
    if grid.z == 1:
        return _beyond(sb, [sb], bound, limit) or timed(sb)
    ss = make(model, grid, global_batch, machine, checkpointing, replace(o, z_split="sequence"))
    pruned = _beyond(sb, [sb, ss] if ss.feasible else [sb], bound, limit)
    if pruned is not None:
        return pruned
    if not ss.feasible:
        return timed(sb)
    if not sb.feasible:
        return replace(timed(ss), z_split_note="the only feasible split")
    e = timed(sb)
    if bound is not None and above(bound(ss), e.step_time_s):
        return e
    s = timed(ss)
    if s.step_time_s >= e.step_time_s:
        return e
    return replace(s, z_split_note=f"faster than the batch split ({e.step_time_s:.3g} s)")


def _beyond(st: Plan, plans: list[Plan], bound: Callable[[Plan], float] | None, limit: float | None) -> Estimate | None:
    """``st`` as a bound estimate where every plan of ``plans`` is feasible and its bound certainly
    exceeds ``limit`` (:func:`estimate_auto`'s ``limit``), else ``None``."""
    if bound is None or limit is None or not all(p.feasible for p in plans):
        return None
    bounds = [bound(p) for p in plans]
    if not all(above(b, limit) for b in bounds):
        return None
    return bound_estimate(st, min(bounds), {})


def _fitting_blocks(spec: ModelSpec, used: float, limit: float, dtypes: Dtypes) -> int:
    left = limit - used
    one = cache_memory_bytes(spec, dtypes, 1)
    if one <= 0 or left < one:
        return 0
    per_block = cache_memory_bytes(spec, dtypes, 2) - one
    return spec.n_layer if per_block <= 0 else min(spec.n_layer, 1 + int((left - one) // per_block))


def fitting_cache_blocks(
    e: Estimate, model: ModelConfig, machine: Machine, dtypes: Dtypes = Dtypes(), limit_bytes: float | None = None
) -> int:
    """The most blocks whose weights can be cached on top of ``e`` (an estimate without caching)
    within ``limit_bytes`` (default: the machine's usable memory)."""
    limit = machine.usable_memory_bytes if limit_bytes is None else limit_bytes
    return _fitting_blocks(model_spec(model, e.grid), e.memory_bytes["total"], limit, dtypes)


__all__ = ["estimate", "estimate_auto", "in_order", "fitting_cache_blocks"]
