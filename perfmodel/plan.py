"""One grid's estimate in two steps: the plan (:func:`plan`: the model's spec on the grid, its local
rows, memory and the reasons it is infeasible -- no pricing) and its price (:func:`timed`: every
collective and compute piece priced, the step simulated by :mod:`perfmodel.timeline`);
:class:`LinkMemo` shares the price of plans that only differ in rank orders the machine cannot
tell apart. :mod:`perfmodel.model` chooses plans (recomputation, cached blocks, z split) and
ranks grids."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace
from typing import Any, Callable

from axo4d.config import ModelConfig
from axo4d.facts.archs import model_spec
from axo4d.facts.fp8_rule import mark_fp8
from axo4d.facts.grid import AXES, Grid
from axo4d.facts.memory import Setup, device_memory, weight_dtypes
from axo4d.facts.run import fp8_of, micro_batch, run_grid
from axo4d.facts.schedule_rules import largest_bucket_limit
from axo4d.facts.spec import Coll, Dtypes, ModelSpec, cached_blocks

from . import costs
from . import expert_pricing as moe
from .estimates import Estimate
from .machine import GIB, Machine, group_link, group_span
from .pricing import Pricer, compute_detail, price
from .programs import Programs
from .step_prices import Prices, StepSetup
from .timeline import simulate_step

DEFAULT_BUCKET_MB = "auto"
"""``parallel.dp_bucket_mb``'s default (the rule of :mod:`axo4d.facts.schedule_rules`)."""


_FLOPS: dict[tuple, float] = {}


def step_flops(model: ModelConfig, global_batch: int, checkpointing: bool = False) -> float:
    """Training FLOPs per step: :meth:`axo4d.facts.spec.ModelSpec.flops_per_step` (docs/design.md section 5;
    the same on every grid; memoised per model, batch and recomputation)."""
    key = (model, global_batch, checkpointing)
    v = _FLOPS.get(key)
    if v is None:
        v = _FLOPS[key] = model_spec(model, Grid()).flops_per_step(global_batch, checkpointing)
    return v


def cache_memory_bytes(spec: ModelSpec, dt: Dtypes, cached: int) -> float:
    """Memory of weight caching: one gathered block per cached layer (the last ``cached`` blocks'
    linear layers and the LM head), all held at the end of the forward pass."""
    if cached <= 0 or spec.grid.z == 1:
        return 0.0
    per_block = sum(x.weight_block(spec.grid) for x in spec.linears())
    return (min(cached, spec.n_layer) * per_block + spec.head_linear().weight_block(spec.grid)) * dt.weight


def _cached(value: int | str, n_layer: int) -> int:
    return max(0, min(int(value), n_layer)) if isinstance(value, int) else cached_blocks(value, n_layer)


@dataclass(frozen=True)
class Options:
    """The settings of :func:`estimate` besides the model, grid, batch and machine."""

    overlap: bool = True
    checkpointing: bool = False
    gpus_per_node: int | None = None
    dtypes: Dtypes = Dtypes()
    flash_attention: bool = False
    dp_bucket_mb: str | float = DEFAULT_BUCKET_MB
    grad_accum: int = 1
    cache_weights: int | str = 0
    shard_optimizer: bool | None = None
    offload: str = "none"
    fp8: str = "off"
    fp8_layers: str = "auto"
    z_split: str = "batch"
    expert: int = 1
    """``parallel.expert``: the expert-group size G_ep (:mod:`perfmodel.expert_pricing`)."""
    imbalance: float = moe.IMBALANCE


@dataclass
class Plan:
    """What an estimate knows before any pricing: the model on its grid, the rows, the memory and
    why the grid is infeasible (cheap; :func:`timed` adds the simulated step)."""

    model: ModelConfig
    grid: Grid
    global_batch: int
    machine: Machine
    opts: Options
    gpn: int
    spec: ModelSpec
    n_cache: int
    rows: float
    memory: dict[str, float]
    reasons: list[str]
    full_spec: ModelSpec | None = None
    """``spec`` before :func:`perfmodel.expert_pricing.routed_spec` (every expert; None: ``spec``)."""

    @property
    def feasible(self) -> bool:
        return not self.reasons

    @property
    def exchanged(self) -> bool:
        """Whether the model runs on ``grid`` with x and y exchanged (:func:`axo4d.facts.run.run_grid`:
        ``spec.grid`` is then ``grid.with_xy_exchanged()`` with the expert group)."""
        return self.spec.grid.x != self.grid.x

    @property
    def reason(self) -> str:
        return "; ".join(self.reasons)


def plan(model: ModelConfig, grid: Grid, global_batch: int, machine: Machine, o: Options) -> Plan:
    """Checks, the model's spec on ``grid``, the memory and the reasons (no pricing)."""
    if global_batch < 1:
        raise ValueError(f"global batch must be >= 1 sample, got {global_batch}")
    if o.grad_accum < 1:
        raise ValueError(f"grad_accum must be >= 1, got {o.grad_accum}")
    gpn = machine.check_gpus_per_node(o.gpus_per_node)
    if o.z_split not in ("batch", "sequence"):
        raise ValueError(f"z_split={o.z_split!r}: estimate takes 'batch' or 'sequence' ('auto': estimate_auto)")
    # the model on the grid it runs on: x and y exchanged where the trainer's start-up exchanges them
    spec = model_spec(model, moe.expert_grid(run_grid(model, grid, gpn), o.expert))
    fp8, fp8_probs = fp8_of(
        spec, o.fp8, o.fp8_layers, micro_batch(global_batch, o.grad_accum), model.seq_len, spec.grid
    )
    spec = mark_fp8(spec, o.fp8, fp8)  # the layers, and the grids refused, of the trainer's start-up
    if o.z_split == "sequence":
        spec = spec.with_sequence_split()
    no_fp8 = o.fp8 != "off" and not machine.has_fp8
    if no_fp8:  # priced as bf16, reported infeasible
        machine = replace(machine, fp8_gemm_ratio=1.0, _cache={})
    n_cache = _cached(o.cache_weights, spec.n_layer)
    b = costs.local_rows(spec, global_batch / o.grad_accum)
    bucket = largest_bucket_limit(o.dp_bucket_mb, spec)
    mem = device_memory(  # axo4d.facts.memory
        spec,
        b,
        o.dtypes,
        o.checkpointing,
        o.flash_attention,
        o.shard_optimizer,
        o.offload,
        bucket,
        machine.usable_memory_bytes,
    )
    ep = moe.expert_parallel(spec, o.expert, o.imbalance)
    setup = Setup(o.checkpointing, o.flash_attention, o.shard_optimizer, o.offload, bucket_bytes=bucket)
    full = spec  # every expert, as the trainer's spec (the gradient norm's groups)
    mem, spec = moe.with_experts(mem, spec, b, o.dtypes, setup, ep), moe.routed_spec(spec, ep)
    if n_cache:
        mem["weight_cache"] = cache_memory_bytes(spec, o.dtypes, n_cache)
        mem["total"] = sum(v for k, v in mem.items() if k != "total")
    reasons = spec.divisibility_reasons(micro_batch(global_batch, o.grad_accum)) + moe.ep_problems(spec, ep) + fp8_probs
    if no_fp8:
        reasons.append(
            f"fp8={o.fp8}: machine {machine.name} has no FP8 GEMMs (fp8_gemm_ratio 0, no float8 gemm_table); "
            "price it on one that has them (alps, or a profile: --grid auto without parallel.machine) or fp8 off"
        )
    if global_batch % o.grad_accum:
        reasons.append(f"batch={global_batch} not divisible by grad_accum={o.grad_accum}")
    limit = machine.usable_memory_bytes
    if mem["total"] > limit:
        reasons.append(
            f"memory {mem['total'] / GIB:.1f} GiB > {limit / GIB:.1f} GiB usable "
            f"(over by {(mem['total'] - limit) / GIB:.1f} GiB)"
        )
    return Plan(model, grid, global_batch, machine, o, gpn, spec, n_cache, b, mem, reasons, full)


_DP: dict[tuple, tuple[list[Coll], list[Coll]]] = {}


def _step_colls(st: Plan) -> tuple[list[Coll], list[Coll]]:
    """The data-parallel and bookkeeping collectives of ``st`` (memoised: they depend on the grid's
    sizes, not its rank order; nor on the z split, which changes attention, a part without
    parameters: the same buckets and norms)."""
    o, g = st.opts, st.spec.grid  # the grid the model runs on (x and y may be exchanged)
    key = (st.model, g.data, g.x, g.y, g.z, o.fp8, o.fp8_layers, o.dtypes, o.offload, o.dp_bucket_mb)
    key += (o.shard_optimizer, o.expert)
    v = _DP.get(key)
    if v is None:
        if len(_DP) > 4096:
            _DP.clear()
        dp = costs.dp_colls(st.spec, weight_dtypes(o.dtypes, o.offload), o.dp_bucket_mb, o.shard_optimizer)
        v = _DP[key] = (dp, costs.bookkeeping_colls(st.full_spec or st.spec, o.dtypes, o.shard_optimizer))
    return v


def step_records(st: Plan) -> tuple[list[Coll], list[Coll], list[Coll]]:
    """Every collective record of ``st``'s step (the micro-step's times the accumulation, the
    expert group's, the data-parallel and bookkeeping ones), and the last two alone."""
    o, spec = st.opts, st.spec
    dp, book = _step_colls(st)
    micro = moe.micro_collectives(spec, st.rows, o.dtypes, o.checkpointing, st.n_cache)
    micro += moe.moe_colls(spec, st.rows, o.dtypes, o.checkpointing)  # not in the timeline (a2a_seconds)
    if o.grad_accum != 1:
        micro = [replace(c, calls=c.calls * o.grad_accum) for c in micro]
    return micro + dp + book, dp, book


@dataclass
class Priced:
    """A plan's pieces priced, before any simulation: the collectives' seconds alone per axis
    (``comm``), bytes and calls per (group, kind), the per-collective ``details`` (record, calls
    per step, seconds a call), the step's setup and prices, and the expert all-to-all's seconds."""

    comm: dict[str, float]
    sent: dict[tuple[str, str], float]
    ncalls: dict[tuple[str, str], int]
    details: list[tuple[Coll, int, float]]
    setup: StepSetup
    prices: Prices
    a2a: float


def priced(st: Plan) -> Priced:
    """Every collective and compute piece of ``st`` priced (no simulation)."""
    o, spec, machine = st.opts, st.spec, st.machine
    colls, dp, book = step_records(st)
    pricer = Pricer(spec.grid, machine, st.gpn)  # the grid with its expert group
    comm, sent, ncalls, details = price(colls, spec, pricer)
    setup = StepSetup(
        spec, st.rows, o.dtypes, o.checkpointing, o.overlap, st.n_cache, o.grad_accum, o.dp_bucket_mb,
        o.flash_attention, tuple(dp), tuple(book),
    )  # fmt: skip
    prices = Prices(setup, machine, pricer.link, pricer.link_class)
    a2a = moe.a2a_seconds(spec, st.rows, o.dtypes, moe.expert_parallel(spec, o.expert, o.imbalance), machine, st.gpn, o)
    return Priced(comm, sent, ncalls, details, setup, prices, a2a)


def timed(st: Plan, programs: Programs | None = None) -> Estimate:
    """``st`` priced and its step simulated (:mod:`perfmodel.timeline`; ``programs``: step programs
    shared with other rank orders of the same sizes and options)."""
    machine = st.machine
    pc = priced(st)
    comm, sent, ncalls, details, setup, prices, a2a = (
        pc.comm, pc.sent, pc.ncalls, pc.details, pc.setup, pc.prices, pc.a2a
    )  # fmt: skip
    sim = simulate_step(setup, prices, machine.link_slowdowns(), programs)
    exposed_axis = {a: sim.stalls.get(a, 0.0) for a in ("x", "y", "z", "data")}
    exposed_axis["data"] += a2a  # the expert group lies along data; its all-to-alls are not overlapped
    return plan_estimate(
        st,
        step_time_s=sim.time + a2a,
        compute_s=sim.compute,
        comm_s=comm,
        exposed_comm_s=sum(exposed_axis.values()),
        bytes_per_rank=sent,
        compute_detail=compute_detail(setup, prices),
        details=details,
        calls_per_rank=ncalls,
        exposed_by_axis=exposed_axis,
        contention_s=sim.contention,
    )


def plan_estimate(st: Plan, **priced_fields: Any) -> Estimate:
    """An :class:`Estimate` of ``st``: the fields the plan fixes (grid, memory, feasibility, FLOPs,
    the machine's figures, the options) and ``priced_fields`` (step time, seconds per axis, ...,
    from a simulation or a bound); ``comm_total_s`` is the sum of ``comm_s``."""
    o, m = st.opts, st.machine
    if st.exchanged:  # priced on the exchanged grid: reported per axis of the grid asked
        priced_fields = {k: _as_asked(v) if k in _BY_AXIS else v for k, v in priced_fields.items()}
        priced_fields["runs_as"] = runs_as(st)
    return Estimate(
        grid=st.grid,
        comm_total_s=sum(priced_fields["comm_s"].values()),
        memory_bytes=st.memory,
        feasible=st.feasible,
        reason=st.reason,
        checkpointing=o.checkpointing,
        flops_per_step=step_flops(st.model, st.global_batch, o.checkpointing),
        model_flops_per_step=step_flops(st.model, st.global_batch, False),
        global_batch=st.global_batch,
        machine=m.name,
        overlap=o.overlap,
        gemm_tflops=m.gemm_tflops,
        vendor_tflops=m.vendor_tflops,
        memory_limit_bytes=m.usable_memory_bytes,
        grad_accum=o.grad_accum,
        cached_blocks=st.n_cache,
        uncertainty=m.uncertainty,
        z_split=o.z_split,
        expert=o.expert,
        **priced_fields,
    )


def runs_as(st: Plan) -> str:
    """:attr:`Estimate.runs_as` of ``st``: its run grid and order where x and y are exchanged, else ''."""
    run = st.spec.grid
    return f"{run.spec()} order {','.join(run.order)}" if st.exchanged else ""


_BY_AXIS = ("comm_s", "exposed_by_axis", "bytes_per_rank", "calls_per_rank")
_SWAP = {"x": "y", "y": "x"}


def _as_asked(d: dict) -> dict:
    """A per-axis (or per-group) dict of the exchanged grid keyed by the asked grid's axes: x and y
    swapped in each key (an axis, a group name such as 'x' or 'x,z', or ``(group name, kind)``;
    a group over both keeps its name: the same ranks)."""

    def name(k: str) -> str:
        parts = k.split(",")
        return k if "x" in parts and "y" in parts else ",".join(_SWAP.get(a, a) for a in parts)

    return {(name(k[0]), *k[1:]) if isinstance(k, tuple) else name(k): v for k, v in d.items()}


class LinkMemo:
    """:func:`timed` remembering its answers for one ranking: two plans of the same sizes and
    settings whose every group gets the same link (bandwidth table entry, the job's node cap,
    intra/inter class) -- rank orders that differ only in strides the machine file does not tell
    apart -- have the same estimate but for the grid's order (the same arithmetic), so the second
    is a copy of the first. Orders the machine tells apart share their step programs
    (:class:`perfmodel.programs.Programs`: the same actions, tasks priced on each order's links)."""

    def __init__(
        self, price: Callable[[Plan, Programs], Estimate] | None = None, links: dict[tuple, tuple] | None = None
    ) -> None:
        self.price = timed if price is None else price
        self.answers: dict[tuple, Estimate] = {}
        self.programs = Programs()
        self._links: dict[tuple, tuple] = {} if links is None else links  # may be shared (one machine)

    def __call__(self, st: Plan) -> Estimate:
        g = st.spec.grid  # the grid the model runs on: its sizes and order fix the program and links
        sizes = (g.data, g.x, g.y, g.z, st.opts)
        where = (g.data, g.x, g.y, g.z, tuple(g.order), st.opts.expert, st.gpn)
        sig = self._links.get(where)
        if sig is None:  # the same for every plan of one grid and order (one machine per ranking)
            sig = self._links[where] = _link_signature(st)
        key = sizes + (sig, st.exchanged)  # estimates are reported on the axes of the grid asked
        e = self.answers.get(key)
        if e is None:
            e = self.answers[key] = self.price(st, self.programs.keyed(sizes))
            return e
        return replace(e, grid=st.grid, memory_bytes=st.memory, runs_as=runs_as(st))


def _link_signature(st: Plan) -> tuple:
    """What the rank order changes in :class:`perfmodel.pricing.Pricer`'s links, for every group of
    more than one rank: its bandwidth table entry, whether the job's node cap applies
    (``stride * size > gpus per node``) and its link class (span > gpus per node)."""
    g, m, gpn = st.spec.grid, st.machine, st.gpn
    out = []
    for axes in _GROUPS:
        stride, p = group_link(g, axes)
        if p > 1:
            span = group_span(g, axes)
            out.append((axes, m.entry(stride, p), stride * p > gpn, span > gpn))
    if st.opts.expert > 1:  # the expert group: G_ep ranks along data (priced by expert_pricing.a2a_seconds)
        stride = g.stride("data")
        out.append(("ep", m.entry(stride, st.opts.expert), stride * st.opts.expert > gpn))
        if g.data > st.opts.expert:  # the copies of an expert, summing its gradient (edp)
            s, p = stride * st.opts.expert, g.data // st.opts.expert
            out.append(("edp", m.entry(s, p), s * p > gpn, 1 + s * (p - 1) > gpn))
    return tuple(out)


_GROUPS = tuple(c for r in range(1, len(AXES) + 1) for c in itertools.combinations(AXES, r))


__all__ = [
    "DEFAULT_BUCKET_MB",
    "Options",
    "Plan",
    "plan",
    "timed",
    "Priced",
    "priced",
    "LinkMemo",
    "step_flops",
    "cache_memory_bytes",
]
