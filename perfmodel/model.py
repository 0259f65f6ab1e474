"""Step-time, memory and feasibility estimate of one grid, and grid ranking.

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

import math
from dataclasses import dataclass, field, replace
from typing import Any, Iterable

from axo4d.config import ModelConfig
from axo4d.facts.archs import model_spec
from axo4d.facts.fp8_rule import with_fp8
from axo4d.facts.grid import AXES, Grid, all_grids
from axo4d.facts.memory import device_memory, weight_dtypes
from axo4d.facts.run import micro_batch
from axo4d.facts.schedule_rules import largest_bucket_limit
from axo4d.facts.spec import AttentionSpec, Coll, Dtypes, ModelSpec, cached_blocks

from . import costs
from .collectives import collective_time, group_name, latency_steps
from .machine import GIB, Machine, group_link
from .search import distinct_orders, mark_ties, traffic_order, with_order
from .timeline import Prices, StepSetup, simulate_step

DEFAULT_BUCKET_MB = "auto"
"""``parallel.dp_bucket_mb``'s default (the rule of :mod:`axo4d.facts.schedule_rules`)."""


@dataclass
class Estimate:
    """Predicted cost of one training step on one grid (per GPU).

    ``comm_s``: seconds per axis ('x', 'y', 'z', 'data'; the (data, z)
    reduction of replicated parameters counts under 'data'). ``bytes_per_rank``:
    ``(group, kind) -> bytes`` per rank per step under the convention of
    :func:`perfmodel.collectives.counted_bytes` (group 'x', 'y', 'z', 'data'
    or 'data,z'; groups of size one are omitted; the bookkeeping scalars of
    :func:`perfmodel.costs.bookkeeping_colls` are included, e.g. under
    'x,y,z'). ``calls_per_rank``: the number of calls behind each of those
    byte counts. ``memory_bytes``: params,
    grads, optimizer, activations, buffers (gathered weight blocks), total.
    ``flops_per_step``: docs/design.md section 5 (96 instead of 72 with
    checkpointing), whole job; ``model_flops_per_step``: the same without
    recomputation.
    """

    grid: Grid
    step_time_s: float
    compute_s: float
    comm_s: dict[str, float]
    comm_total_s: float
    exposed_comm_s: float
    memory_bytes: dict[str, float]
    feasible: bool
    reason: str
    checkpointing: bool
    flops_per_step: float
    model_flops_per_step: float
    bytes_per_rank: dict[tuple[str, str], float]
    global_batch: int = 0
    machine: str = ""
    overlap: bool = True
    gemm_tflops: float = 0.0
    memory_limit_bytes: float = 0.0
    compute_detail: dict[str, float] = field(default_factory=dict)
    details: list[tuple[Coll, int, float]] = field(default_factory=list, repr=False)
    calls_per_rank: dict[tuple[str, str], int] = field(default_factory=dict)
    grad_accum: int = 1
    exposed_by_axis: dict[str, float] = field(default_factory=dict)
    """Seconds the compute stream waited for each axis's collectives."""
    contention_s: float = 0.0
    """What overlap cost: compute slowed by concurrent collectives (``step - compute - exposed``)."""
    cached_blocks: int = 0
    """Blocks (the last ones, and the LM head) whose gathered weights are kept for backward."""
    tie: bool = False
    """Within the machine's ``uncertainty`` of the best feasible grid of a ranking."""
    uncertainty: float = 0.0
    z_split: str = "batch"
    """What z splits (``parallel.z_split``): 'batch' (whole samples) or 'sequence' (every sample's
    sequence: K/V all-gathered over z, the micro-batch divided by G_data only)."""
    z_split_note: str = ""
    """Why ``z_split='auto'`` chose the sequence split: the only feasible choice, or faster."""

    @property
    def gpus(self) -> int:
        return self.grid.world_size

    @property
    def tflops_per_gpu(self) -> float:
        """``flops_per_step`` / step time / GPUs, in TFLOP/s."""
        return self.flops_per_step / self.step_time_s / self.gpus / 1e12 if self.step_time_s > 0 else 0.0

    @property
    def peak_fraction(self) -> float:
        """TFLOP/s per GPU as a fraction of the machine's ``gemm_tflops``."""
        return self.tflops_per_gpu / self.gemm_tflops if self.gemm_tflops else 0.0

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready summary (no per-collective details)."""
        return {
            "grid": self.grid.spec(),
            "order": ",".join(self.grid.order),
            "gpus": self.gpus,
            "machine": self.machine,
            "global_batch": self.global_batch,
            "step_time_s": self.step_time_s,
            "compute_s": self.compute_s,
            "comm_s": dict(self.comm_s),
            "comm_total_s": self.comm_total_s,
            "exposed_comm_s": self.exposed_comm_s,
            "overlap": self.overlap,
            "memory_bytes": dict(self.memory_bytes),
            "memory_gib": self.memory_bytes["total"] / GIB,
            "memory_limit_gib": self.memory_limit_bytes / GIB,
            "feasible": self.feasible,
            "reason": self.reason,
            "checkpointing": self.checkpointing,
            "flops_per_step": self.flops_per_step,
            "model_flops_per_step": self.model_flops_per_step,
            "tflops_per_gpu": self.tflops_per_gpu,
            "peak_fraction": self.peak_fraction,
            "exposed_by_axis": dict(self.exposed_by_axis),
            "contention_s": self.contention_s,
            "cached_blocks": self.cached_blocks,
            "tie": self.tie,
            "uncertainty": self.uncertainty,
            "z_split": self.z_split,
            "z_split_note": self.z_split_note,
            "bytes_per_rank": {f"{g}:{k}": v for (g, k), v in sorted(self.bytes_per_rank.items())},
        }


def step_flops(model: ModelConfig, global_batch: int, checkpointing: bool = False) -> float:
    """Training FLOPs per step: :meth:`axo4d.facts.spec.ModelSpec.flops_per_step` (docs/design.md section 5;
    the same on every grid)."""
    return model_spec(model, Grid()).flops_per_step(global_batch, checkpointing)


# ---- pricing ---------------------------------------------------------------------
class _Pricer:
    """Prices collectives on one grid, caching each group's (p, bw, alpha)."""

    def __init__(self, grid: Grid, machine: Machine, gpus_per_node: int):
        self.grid, self.machine, self.gpn = grid, machine, gpus_per_node
        self.links: dict[tuple, tuple[int, float, float]] = {}

    def link(self, axes: tuple[str, ...], kind: str | None = None) -> tuple[int, float, float]:
        """``(group size, GB/s, alpha seconds)`` of the group over ``axes`` for collective ``kind``."""
        v = self.links.get((axes, kind))
        if v is None:
            stride, p = group_link(self.grid, axes)
            if p == 1:
                v = (1, math.inf, 0.0)
            else:
                v = (p, self.machine.bandwidth(stride, p, self.gpn, kind), self.machine.latency_s(stride, p, kind))
            self.links[(axes, kind)] = v
        return v

    def seconds(self, c: Coll) -> float:
        """Seconds of one call of ``c``."""
        p, bw, alpha = self.link(c.axes, c.kind)
        return 0.0 if p == 1 else collective_time(c.kind, c.nbytes, p, bw, alpha)

    def latency(self, c: Coll) -> float:
        """The latency part (ring steps times alpha) of one call of ``c``."""
        p, _, alpha = self.link(c.axes, c.kind)
        return 0.0 if p == 1 else latency_steps(c.kind, p) * alpha

    def link_class(self, axes: tuple[str, ...]) -> str:
        """'inter' when the group's ranks span more than a node (of the job's GPUs per node)."""
        span = 1 + sum(self.grid.stride(a) * (self.grid.size(a) - 1) for a in axes)
        return "inter" if span > self.gpn else "intra"


def _compute_detail(setup: StepSetup, prices: Prices) -> dict[str, float]:
    """Seconds of compute per step as priced alone, per phase (``attention_s`` and ``other_s``,
    elementwise and launches, are included in the phases)."""
    sp, accum = setup.spec, setup.grad_accum
    out = {"forward_s": 0.0, "backward_s": 0.0, "recompute_s": 0.0, "attention_s": 0.0, "other_s": 0.0}
    for parts, reps, in_block in ((sp.embeddings + sp.head, 1, False), (sp.block, sp.n_layer, True)):
        for part in parts:
            f = sum(prices.part(part, "fwd", in_block))
            bwd = sum(prices.part(part, "bwd", in_block))
            out["forward_s"] += accum * reps * f
            out["backward_s"] += accum * reps * bwd
            if in_block and setup.checkpointing:
                out["recompute_s"] += accum * reps * f
            if isinstance(part, AttentionSpec):
                out["attention_s"] += accum * reps * (f + bwd) * (1 + (in_block and setup.checkpointing) / 3)
    out["other_s"] = prices.optimizer()
    out["total_s"] = out["forward_s"] + out["backward_s"] + out["recompute_s"] + out["other_s"]
    return out


def _price(colls: list[Coll], spec: ModelSpec, pricer: _Pricer) -> tuple:
    """Seconds per axis (alone), bytes and calls per (group, kind), and per-collective details."""
    comm = {a: 0.0 for a in ("x", "y", "z", "data")}
    sent: dict[tuple[str, str], float] = {}
    calls: dict[tuple[str, str], int] = {}
    details = []
    for c in colls:
        reps = c.calls * (spec.n_layer if c.per_block else 1)
        t1 = pricer.seconds(c)
        details.append((c, reps, t1))
        comm["data" if "data" in c.axes else c.axes[0]] += t1 * reps
        if pricer.link(c.axes)[0] > 1:
            key = (group_name(c.axes), c.kind)
            sent[key] = sent.get(key, 0.0) + c.nbytes * reps
            calls[key] = calls.get(key, 0) + reps
    return comm, sent, calls, details


def cache_memory_bytes(spec: ModelSpec, dt: Dtypes, cached: int) -> float:
    """Memory of weight caching: one gathered block per cached layer (the last ``cached`` blocks'
    linear layers and the LM head), all held at the end of the forward pass."""
    if cached <= 0 or spec.grid.z == 1:
        return 0.0
    per_block = sum(x.weight_block(spec.grid) for x in spec.linears())
    return (min(cached, spec.n_layer) * per_block + spec.head_linear().weight_block(spec.grid)) * dt.weight


def _cached(value: int | str, n_layer: int) -> int:
    return max(0, min(int(value), n_layer)) if isinstance(value, int) else cached_blocks(value, n_layer)


def estimate(
    model: ModelConfig,
    grid: Grid,
    global_batch: int,
    machine: Machine,
    *,
    overlap: bool = True,
    checkpointing: bool = False,
    gpus_per_node: int | None = None,
    dtypes: Dtypes = Dtypes(),
    flash_attention: bool = False,
    dp_bucket_mb: str | float = DEFAULT_BUCKET_MB,
    grad_accum: int = 1,
    cache_weights: int | str = 0,
    shard_optimizer: bool | None = None,
    offload: str = "none",
    fp8: str = "off",
    fp8_layers: str = "auto",
    z_split: str = "batch",
) -> Estimate:
    """Estimate one training step of ``model`` on ``grid`` (see module docstring).

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
    if global_batch < 1:
        raise ValueError(f"global batch must be >= 1 sample, got {global_batch}")
    if grad_accum < 1:
        raise ValueError(f"grad_accum must be >= 1, got {grad_accum}")
    gpn = machine.check_gpus_per_node(gpus_per_node)
    if z_split not in ("batch", "sequence"):
        raise ValueError(f"z_split={z_split!r}: estimate takes 'batch' or 'sequence' ('auto': estimate_auto)")
    spec = with_fp8(model_spec(model, grid), fp8, fp8_layers)
    if z_split == "sequence":
        spec = spec.with_sequence_split()
    no_fp8 = fp8 != "off" and not machine.has_fp8
    if no_fp8:  # priced as bf16, reported infeasible
        machine = replace(machine, fp8_gemm_ratio=1.0, _cache={})
    n_cache = _cached(cache_weights, spec.n_layer)
    b = costs.local_rows(spec, global_batch / grad_accum)
    dp = costs.dp_colls(spec, weight_dtypes(dtypes, offload), dp_bucket_mb, shard_optimizer)
    book = costs.bookkeeping_colls(spec, dtypes, shard_optimizer)
    micro = spec.collectives(b, dtypes, checkpointing, n_cache)
    colls = [replace(c, calls=c.calls * grad_accum) for c in micro] + dp + book
    pricer = _Pricer(grid, machine, gpn)
    comm, sent, ncalls, details = _price(colls, spec, pricer)
    setup = StepSetup(
        spec,
        b,
        dtypes,
        checkpointing,
        overlap,
        n_cache,
        grad_accum,
        dp_bucket_mb,
        flash_attention,
        tuple(dp),
        tuple(book),
    )
    prices = Prices(setup, machine, pricer.link, pricer.link_class)
    sim = simulate_step(setup, prices, machine.link_slowdowns())
    comp = _compute_detail(setup, prices)
    exposed_axis = {a: sim.stalls.get(a, 0.0) for a in ("x", "y", "z", "data")}
    mem = device_memory(
        spec,
        b,
        dtypes,
        checkpointing,
        flash_attention,
        shard_optimizer,
        offload,  # axo4d.facts.memory
        largest_bucket_limit(dp_bucket_mb, spec),
        machine.usable_memory_bytes,
    )
    if n_cache:
        mem["weight_cache"] = cache_memory_bytes(spec, dtypes, n_cache)
        mem["total"] = sum(v for k, v in mem.items() if k != "total")
    reasons = spec.divisibility_reasons(micro_batch(global_batch, grad_accum))
    if no_fp8:
        reasons.append(f"fp8={fp8}: machine {machine.name} has no FP8 GEMMs (fp8_gemm_ratio 0, no float8 gemm_table)")
    if global_batch % grad_accum:
        reasons.append(f"batch={global_batch} not divisible by grad_accum={grad_accum}")
    limit = machine.usable_memory_bytes
    if mem["total"] > limit:
        reasons.append(
            f"memory {mem['total'] / GIB:.1f} GiB > {limit / GIB:.1f} GiB usable "
            f"(over by {(mem['total'] - limit) / GIB:.1f} GiB)"
        )
    return Estimate(
        grid=grid,
        step_time_s=sim.time,
        compute_s=sim.compute,
        comm_s=comm,
        comm_total_s=sum(comm.values()),
        exposed_comm_s=sum(exposed_axis.values()),
        memory_bytes=mem,
        feasible=not reasons,
        reason="; ".join(reasons),
        checkpointing=checkpointing,
        flops_per_step=step_flops(model, global_batch, checkpointing),
        model_flops_per_step=step_flops(model, global_batch, False),
        bytes_per_rank=sent,
        global_batch=global_batch,
        machine=machine.name,
        overlap=overlap,
        gemm_tflops=machine.gemm_tflops,
        memory_limit_bytes=limit,
        compute_detail=comp,
        details=details,
        calls_per_rank=ncalls,
        grad_accum=grad_accum,
        exposed_by_axis=exposed_axis,
        contention_s=sim.contention,
        cached_blocks=n_cache,
        uncertainty=machine.uncertainty,
        z_split=z_split,
    )


def _only_memory(e: Estimate) -> bool:
    return all(r.startswith("memory ") for r in e.reason.split("; "))


def estimate_auto(
    model: ModelConfig, grid: Grid, global_batch: int, machine: Machine, checkpointing: bool | None = None, **kw: Any
) -> Estimate:
    """``estimate`` with ``checkpointing=None`` meaning: without if it fits, else with;
    ``cache_weights='auto'``: as many cached blocks as the memory left fits (0 when none); and
    ``z_split='auto'`` (``perfmodel``'s command line; here the default is 'batch'): the batch
    split, or the sequence split where it is the only feasible one or faster (``z_split_note``
    says which). The sequence split's attention (SDPA with a mask) keeps no scores whatever
    ``flash_attention`` says; the batch split follows ``flash_attention``."""
    z_split = kw.pop("z_split", "batch")
    if z_split != "auto":
        return _estimate_auto(model, grid, global_batch, machine, checkpointing, z_split=z_split, **kw)
    e = _estimate_auto(model, grid, global_batch, machine, checkpointing, z_split="batch", **kw)
    if grid.z == 1:
        return e
    s = _estimate_auto(model, grid, global_batch, machine, checkpointing, z_split="sequence", **kw)
    if not s.feasible or (e.feasible and s.step_time_s >= e.step_time_s):
        return e
    note = f"faster than the batch split ({e.step_time_s:.3g} s)" if e.feasible else "the only feasible split"
    return replace(s, z_split_note=note)


def _estimate_auto(
    model: ModelConfig, grid: Grid, global_batch: int, machine: Machine, checkpointing: bool | None, **kw: Any
) -> Estimate:
    cache = kw.pop("cache_weights", 0)
    auto = isinstance(cache, str) and cache.strip().lower() == "auto"
    first = 0 if auto else cache
    if checkpointing is None:
        e = estimate(model, grid, global_batch, machine, checkpointing=False, cache_weights=first, **kw)
        if not e.feasible and _only_memory(e):
            e = estimate(model, grid, global_batch, machine, checkpointing=True, cache_weights=first, **kw)
    else:
        e = estimate(model, grid, global_batch, machine, checkpointing=checkpointing, cache_weights=first, **kw)
    if not auto or not e.feasible or grid.z == 1:
        return e
    n = fitting_cache_blocks(e, model, machine, kw.get("dtypes", Dtypes()))
    return (
        estimate(model, grid, global_batch, machine, checkpointing=e.checkpointing, cache_weights=n, **kw) if n else e
    )


def fitting_cache_blocks(
    e: Estimate, model: ModelConfig, machine: Machine, dtypes: Dtypes = Dtypes(), limit_bytes: float | None = None
) -> int:
    """The most blocks whose weights can be cached on top of ``e`` (an estimate without caching)
    within ``limit_bytes`` (default: the machine's usable memory)."""
    spec = model_spec(model, e.grid)
    left = (machine.usable_memory_bytes if limit_bytes is None else limit_bytes) - e.memory_bytes["total"]
    one = cache_memory_bytes(spec, dtypes, 1)
    if one <= 0 or left < one:
        return 0
    per_block = cache_memory_bytes(spec, dtypes, 2) - one
    return spec.n_layer if per_block <= 0 else min(spec.n_layer, 1 + int((left - one) // per_block))


def sort_estimates(ests: Iterable[Estimate]) -> list[Estimate]:
    """Feasible by step time, then grids failing only on memory, then the rest."""
    return sorted(ests, key=lambda e: (0 if e.feasible else 1 if _only_memory(e) else 2, e.step_time_s))


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


def unestimated(grid: Grid, reason: str, machine: Machine, global_batch: int) -> Estimate:
    """An infeasible grid listed without an estimate (:data:`FULL_SEARCH_MAX`)."""
    return Estimate(
        grid=grid,
        step_time_s=math.inf,
        compute_s=0.0,
        comm_s={},
        comm_total_s=0.0,
        exposed_comm_s=0.0,
        memory_bytes={"total": 0.0},
        feasible=False,
        reason=reason + " (not estimated)",
        checkpointing=False,
        flops_per_step=0.0,
        model_flops_per_step=0.0,
        bytes_per_rank={},
        global_batch=global_batch,
        machine=machine.name,
        gemm_tflops=machine.gemm_tflops,
        memory_limit_bytes=machine.usable_memory_bytes,
    )


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
    keywords go to :func:`estimate_auto` (``cache_weights='auto'`` included).
    """
    if gpus < 1:
        raise ValueError(f"number of GPUs must be >= 1, got {gpus}")
    if global_batch < 1:
        raise ValueError(f"global batch must be >= 1 sample, got {global_batch}")
    gpn = machine.check_gpus_per_node(gpus_per_node)
    search = isinstance(order, str) and order.strip().lower() == "search"

    def est(g: Grid) -> Estimate:
        return estimate_auto(model, g, global_batch, machine, checkpointing, overlap=overlap, gpus_per_node=gpn, **kw)

    grids = all_grids(gpus, None if search else order)
    if len(grids) > FULL_SEARCH_MAX:
        why = {
            id(g): sizes_reason(model, g, global_batch, kw.get("grad_accum", 1), kw.get("z_split", "batch"))
            for g in grids
        }
        ests = sort_estimates(
            unestimated(g, why[id(g)], machine, global_batch) if why[id(g)] else est(g) for g in grids
        )
    else:
        ests = sort_estimates(est(g) for g in grids)
    if search:
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
    mark_ties(ests)
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
