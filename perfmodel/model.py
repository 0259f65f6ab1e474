"""Step-time, memory and feasibility estimate of one grid, and grid ranking.

``estimate`` prices every collective of :mod:`perfmodel.costs` with the ring
alpha-beta model of :mod:`perfmodel.collectives` and the bandwidth of its group
(:meth:`perfmodel.machine.Machine.bandwidth` at the group's stride and size),
and the local GEMMs at the machine's achieved GEMM rate.

Overlap model (``overlap=True``)::

    exposed = blocking
            + max(0, fwd_pool - forward compute)
            + max(0, bwd_pool - backward compute, sum_layers max(0, dX_allreduce - dW_gemm))

``blocking``: forward all-reduces of layer outputs (x or y), their recompute,
LayerNorm and cross-entropy statistics. ``fwd_pool``: forward z all-gathers
(prefetched). ``bwd_pool``: backward and recompute z all-gathers, z
reduce-scatters, data-parallel all-reduces and the backward dX all-reduces
(each of which can hide only behind its own layer's dW GEMM, hence the third
term). With ``overlap=False`` all communication is exposed; a machine's
``overlap_efficiency`` (1 by default, 0 for CPU ranks whose communication runs
on the compute cores) interpolates between the two; below 1 the latency part
of the prefetched forward z all-gathers and of the background z
reduce-scatters still hides behind the forward and backward pass (waiting for
peers does not occupy a core; backward gathers queue behind those
reduce-scatters on the same group, so they are not credited). Non-GEMM compute
(elementwise traffic, operator launches, the optimizer) counts only on
machines that give ``memory_gbps`` / ``op_overhead_us`` (profiled CPU hosts;
on GPUs it is small next to the GEMMs).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, Iterable

from axo4d.config import ModelConfig
from axo4d.dist.grid import AXES, Grid, all_grids
from axo4d.spec import Coll, Dtypes, ModelSpec, model_spec

from . import costs
from .collectives import collective_time, group_name, latency_steps
from .machine import GIB, Machine, group_link

DEFAULT_BUCKET_MB = 25.0


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
        return {"grid": self.grid.spec(), "order": ",".join(self.grid.order), "gpus": self.gpus,
                "machine": self.machine, "global_batch": self.global_batch,
                "step_time_s": self.step_time_s, "compute_s": self.compute_s,
                "comm_s": dict(self.comm_s), "comm_total_s": self.comm_total_s,
                "exposed_comm_s": self.exposed_comm_s, "overlap": self.overlap,
                "memory_bytes": dict(self.memory_bytes),
                "memory_gib": self.memory_bytes["total"] / GIB,
                "memory_limit_gib": self.memory_limit_bytes / GIB,
                "feasible": self.feasible, "reason": self.reason, "checkpointing": self.checkpointing,
                "flops_per_step": self.flops_per_step, "model_flops_per_step": self.model_flops_per_step,
                "tflops_per_gpu": self.tflops_per_gpu, "peak_fraction": self.peak_fraction,
                "bytes_per_rank": {f"{g}:{k}": v for (g, k), v in sorted(self.bytes_per_rank.items())}}


def step_flops(model: ModelConfig, global_batch: int, checkpointing: bool = False) -> float:
    """Training FLOPs per step: :meth:`axo4d.spec.ModelSpec.flops_per_step` (docs/design.md section 5;
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


def _compute(spec: ModelSpec, b: float, machine: Machine, ckpt: bool, dt: Dtypes,
             accum: int) -> dict[str, float]:
    """Seconds of compute per step: GEMM and attention FLOPs per phase (forward,
    backward, recompute), plus, on machines that describe them, elementwise
    traffic and operator overheads (``other_s``, counted in backward: not overlapped)."""
    rate, l, grid = machine.gemm_flops_per_s, spec.n_layer, spec.grid
    block_gemm = sum(x.gemm_flops(grid, b) for x in spec.linears())
    attn = costs.attention_flops(spec, b)
    head = spec.head_linear().gemm_flops(grid, b)
    fwd = accum * (l * (block_gemm + attn) + head) / rate
    bwd = accum * (l * (2 * block_gemm + 2 * attn) + 2 * head) / rate
    rec = accum * l * (block_gemm + attn) / rate if ckpt else 0.0
    other = _other_compute(spec, b, machine, dt, accum, ckpt)
    return {"forward_s": fwd, "backward_s": bwd, "recompute_s": rec,
            "attention_s": accum * (3 + ckpt) * l * attn / rate, "other_s": other,
            "total_s": fwd + bwd + rec + other}


def _other_compute(spec: ModelSpec, b: float, machine: Machine, dt: Dtypes, accum: int, ckpt: bool) -> float:
    """Elementwise traffic over ``memory_gbps`` and operator launches times ``op_overhead_us``."""
    t = 0.0
    if machine.memory_gbps:
        eb = costs.elementwise_bytes(spec, b, dt)
        blocks = eb["blocks"] * (4 / 3 if ckpt else 1)
        t += (accum * (blocks + eb["head"]) + eb["optimizer"]) / (machine.memory_gbps * 1e9)
    if machine.op_overhead_us:
        micro, step = costs.op_count(spec)
        t += (accum * micro * (1.3 if ckpt else 1) + step) * machine.op_overhead_us * 1e-6
    return t


def _memory(spec: ModelSpec, b: float, dt: Dtypes, ckpt: bool, flash: bool) -> dict[str, float]:
    pc = spec.local_params()
    n = pc["linear"] + pc["other"]
    block = costs.block_activation_bytes(spec, b, flash)
    head = costs.head_activation_bytes(spec, b, dt)
    if ckpt:
        acts = spec.n_layer * costs.checkpoint_bytes(spec, b, dt) + block + head
    else:
        acts = spec.n_layer * block + head
    wmax = max(x.weight_block(spec.grid) for x in costs.all_linears(spec))
    mem = {"params": n * dt.param_state, "grads": n * dt.grad_state, "optimizer": n * dt.optim_state,
           "activations": acts, "buffers": wmax * (2 * dt.weight + dt.grad)}
    mem["total"] = sum(mem.values())
    return mem


def _price(colls: list[Coll], spec: ModelSpec, b: float, pricer: _Pricer) -> tuple:
    """Seconds per axis and per overlap pool, bytes per (group, kind), details,
    and the dX all-reduce time its own layer's dW GEMM cannot hide."""
    lins = {x.name: x for x in costs.all_linears(spec)}
    comm = {a: 0.0 for a in ("x", "y", "z", "data")}
    pools = {"blocking": 0.0, "fwd": 0.0, "bwd": 0.0, "dx": 0.0, "fwd_latency": 0.0, "blocking_fwd": 0.0, "rs_latency": 0.0}
    sent: dict[tuple[str, str], float] = {}
    calls: dict[tuple[str, str], int] = {}
    details = []
    dx_exposed = 0.0
    for c in colls:
        reps = c.calls * (spec.n_layer if c.per_block else 1)
        t1 = pricer.seconds(c)
        details.append((c, reps, t1))
        comm["data" if "data" in c.axes else c.axes[0]] += t1 * reps
        pools[c.pool] += t1 * reps
        if c.pool == "fwd":
            pools["fwd_latency"] += pricer.latency(c) * reps
        elif c.kind == "reduce_scatter" and c.axes == ("z",):
            pools["rs_latency"] += pricer.latency(c) * reps
        elif c.pool == "blocking" and c.phase == "fwd":
            pools["blocking_fwd"] += t1 * reps
        if c.pool == "dx":
            dw = lins[c.layer].gemm_flops(spec.grid, b) / pricer.machine.gemm_flops_per_s
            dx_exposed += reps * max(0.0, t1 - dw)
        if pricer.link(c.axes)[0] > 1:
            key = (group_name(c.axes), c.kind)
            sent[key] = sent.get(key, 0.0) + c.nbytes * reps
            calls[key] = calls.get(key, 0) + reps
    return comm, pools, (sent, calls), details, dx_exposed


def _step_colls(spec: ModelSpec, b: float, dtypes: Dtypes, checkpointing: bool,
                grad_accum: int, dp_bucket_mb: float) -> list[Coll]:
    """Every collective of one optimizer step: ``grad_accum`` micro-steps of
    block and head collectives, then the data-parallel reductions and the
    bookkeeping scalars (once per step)."""
    micro = spec.collectives(b, dtypes, checkpointing)
    if grad_accum > 1:
        micro = [replace(c, calls=c.calls * grad_accum) for c in micro]
    return (micro + costs.dp_colls(spec, dtypes, dp_bucket_mb * 2 ** 20)
            + costs.bookkeeping_colls(spec, dtypes))


def estimate(model: ModelConfig, grid: Grid, global_batch: int, machine: Machine, *,
             overlap: bool = True, checkpointing: bool = False, gpus_per_node: int | None = None,
             dtypes: Dtypes = Dtypes(), flash_attention: bool = False,
             dp_bucket_mb: float = DEFAULT_BUCKET_MB, grad_accum: int = 1) -> Estimate:
    """Estimate one training step of ``model`` on ``grid`` (see module docstring).

    ``grad_accum`` micro-steps of ``global_batch / grad_accum`` samples each
    (as ``train.grad_accum``). Infeasible grids (divisibility, memory) are
    still estimated (with fractional shapes where sizes do not divide) and
    carry ``reason``.
    """
    if global_batch < 1:
        raise ValueError(f"global batch must be >= 1 sample, got {global_batch}")
    if grad_accum < 1:
        raise ValueError(f"grad_accum must be >= 1, got {grad_accum}")
    gpn = machine.check_gpus_per_node(gpus_per_node)
    spec = model_spec(model, grid)
    b = costs.local_rows(spec, global_batch / grad_accum)
    colls = _step_colls(spec, b, dtypes, checkpointing, grad_accum, dp_bucket_mb)
    comp = _compute(spec, b, machine, checkpointing, dtypes, grad_accum)
    priced = _price(colls, spec, b, _Pricer(grid, machine, gpn))
    comm, pools, (sent, ncalls), details, dx_exposed = priced

    total = sum(comm.values())
    if overlap:
        hidden = (pools["blocking"] + max(0.0, pools["fwd"] - comp["forward_s"])
                  + max(0.0, pools["bwd"] + pools["dx"] - comp["backward_s"] - comp["recompute_s"], dx_exposed))
        eff = machine.overlap_efficiency
        # waiting is not computing: the latency of a prefetched forward gather, and of a
        # background z reduce-scatter (waited for two layers later), hides behind the pass
        # even where the data movement cannot (eff < 1: communication on the compute cores)
        window = comp["forward_s"] + comp["other_s"] / 3 + pools["blocking_fwd"]   # the forward pass
        bwin = comp["backward_s"] + comp["other_s"] / 2
        exposed = (total - eff * (total - hidden) - (1 - eff) * min(pools["fwd_latency"], window)
                   - (1 - eff) * min(pools["rs_latency"], bwin))
    else:
        exposed = total
    mem = _memory(spec, b, dtypes, checkpointing, flash_attention)
    reasons = spec.divisibility_reasons(global_batch // grad_accum)
    if global_batch % grad_accum:
        reasons.append(f"batch={global_batch} not divisible by grad_accum={grad_accum}")
    limit = machine.usable_memory_bytes
    if mem["total"] > limit:
        reasons.append(f"memory {mem['total'] / GIB:.1f} GiB > {limit / GIB:.1f} GiB usable "
                       f"(over by {(mem['total'] - limit) / GIB:.1f} GiB)")
    step = comp["total_s"] + exposed
    return Estimate(grid=grid, step_time_s=step, compute_s=comp["total_s"], comm_s=comm, comm_total_s=total,
                    exposed_comm_s=exposed, memory_bytes=mem, feasible=not reasons, reason="; ".join(reasons),
                    checkpointing=checkpointing, flops_per_step=step_flops(model, global_batch, checkpointing),
                    model_flops_per_step=step_flops(model, global_batch, False), bytes_per_rank=sent,
                    global_batch=global_batch, machine=machine.name, overlap=overlap,
                    gemm_tflops=machine.gemm_tflops, memory_limit_bytes=limit, compute_detail=comp,
                    details=details, calls_per_rank=ncalls, grad_accum=grad_accum)


def _only_memory(e: Estimate) -> bool:
    return all(r.startswith("memory ") for r in e.reason.split("; "))


def estimate_auto(model: ModelConfig, grid: Grid, global_batch: int, machine: Machine,
                  checkpointing: bool | None = None, **kw: Any) -> Estimate:
    """``estimate`` with ``checkpointing=None`` meaning: without if it fits, else with."""
    if checkpointing is not None:
        return estimate(model, grid, global_batch, machine, checkpointing=checkpointing, **kw)
    e = estimate(model, grid, global_batch, machine, checkpointing=False, **kw)
    if e.feasible or not _only_memory(e):
        return e
    return estimate(model, grid, global_batch, machine, checkpointing=True, **kw)


def sort_estimates(ests: Iterable[Estimate]) -> list[Estimate]:
    """Feasible by step time, then grids failing only on memory, then the rest."""
    return sorted(ests, key=lambda e: (0 if e.feasible else 1 if _only_memory(e) else 2, e.step_time_s))


def rank_grids(model: ModelConfig, gpus: int, gpus_per_node: int | None, global_batch: int,
               machine: Machine, *, overlap: bool = True, checkpointing: bool | None = None,
               order: str | Iterable[str] | None = None, top: int | None = None,
               **kw: Any) -> list[Estimate]:
    """Estimate every grid ``data*x*y*z == gpus`` and sort them, feasible first
    by predicted step time. ``top`` keeps the best ``top`` feasible grids (all
    infeasible ones follow, with reasons). ``checkpointing=None``: per grid,
    without if it fits in memory, else with. Extra keywords go to ``estimate``.
    """
    if gpus < 1:
        raise ValueError(f"number of GPUs must be >= 1, got {gpus}")
    if global_batch < 1:
        raise ValueError(f"global batch must be >= 1 sample, got {global_batch}")
    gpn = machine.check_gpus_per_node(gpus_per_node)
    ests = sort_estimates(
        estimate_auto(model, g, global_batch, machine, checkpointing, overlap=overlap, gpus_per_node=gpn, **kw)
        for g in all_grids(gpus, order))
    if top is not None:
        feas = [e for e in ests if e.feasible]
        ests = feas[:max(0, top)] + [e for e in ests if not e.feasible]
    return ests


__all__ = ["Estimate", "estimate", "estimate_auto", "rank_grids", "step_flops", "sort_estimates", "AXES"]
