"""Mixture-of-experts pricing (docs/design.md section 16): routed rows, expert parallelism, the
all-to-all on the expert group's links and the routing imbalance. Facts from
:mod:`axo4d.facts.moe_memory`; called from :mod:`perfmodel.model` in three places (the spec a
grid prices, the memory, the step's all-to-all) and from its search (the expert-group size).

* **Routed rows.** An expert's GEMMs multiply only the rows routed to it: :func:`routed_spec`
  keeps a rank's ``E/G_ep`` experts and sets each one's ``active`` to ``k * G_ep * imb / E``,
  the share of the rank's rows its busiest expert multiplies (the timeline prices a linear
  layer's GEMMs, element-wise passes and output collectives on ``rows * active`` rows). The
  model FLOPs (MFU) come from the model on one device and are unchanged.
* **All-to-all.** Per MoE layer and micro-step, dispatch and combine in forward, the same two in
  backward and again in a recomputed forward, each rank sending ``k * b * C/(G_x G_y) *
  (G_ep-1)/G_ep`` elements per all-to-all (:func:`axo4d.facts.moe_memory.a2a_elements` counts
  both of a pass). The expert group is ``G_ep`` consecutive ranks of ``data``: its link is the
  machine's for ``G_ep`` ranks at the data axis' stride (inside a node when ``G_ep`` times that
  stride fits in one). The experts wait for their tokens, so the time is added to the step
  whole (no overlap): an upper bound, stated. The bytes and calls per rank (``bytes_per_rank``,
  group ``ep``, kind ``all_to_all``) come from the facts' records of the same exchanges
  (:func:`moe_colls`: with the counts' exchange, each call's whole input as
  :class:`~axo4d.dist.comm.Comm` counts it), checked equal to the counted ones by
  ``python -m bench.bytes_check --moe``.
* **Gradients.** The spec is the model on the grid with its expert group (:func:`expert_grid`),
  so each held expert's gradient is summed over ``edp``, the ``G_data/G_ep`` ranks holding copies
  of it, on that group's link (stride ``G_ep`` data ranks), and the rest over data as in a
  dense model; the gradient norm's all-reduces over ``ep`` and ``edp`` as the trainer runs them.
* **Imbalance.** :data:`IMBALANCE`: routed rows of the busiest rank over the mean, assumed for
  the priced GEMMs and memory of expert-parallel grids (with ``G_ep = 1`` every rank runs every
  expert on its own tokens: no imbalance between ranks).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable

from axo4d.facts import moe_memory
from axo4d.facts.grid import Grid
from axo4d.facts.memory import Setup, memory
from axo4d.facts.moe_memory import ExpertParallel, a2a_elements, ep_problems, ep_sizes, memory_with_experts
from axo4d.facts.moe_parts import a2a_collectives, held_experts, router_of, router_stats_coll
from axo4d.facts.parts import ALL_GATHER
from axo4d.facts.spec import Coll, Dtypes, ModelSpec

IMBALANCE = moe_memory.IMBALANCE  # the routing imbalance the trainer's memory check assumes too
EXPERT_PREFIX = "mlp.experts."


def expert_parallel(spec: ModelSpec, g_ep: int, imbalance: float = IMBALANCE) -> ExpertParallel:
    """The expert setting priced for ``g_ep`` (imbalance only between ranks: ``G_ep > 1``)."""
    return moe_memory.expert_setting(g_ep, imbalance)


def routed_spec(spec: ModelSpec, ep: ExpertParallel) -> ModelSpec:
    """``spec`` with a rank's ``E/G_ep`` experts, each marked with the rows it multiplies
    (``active = k * G_ep * imb / E`` of the rank's rows) and, on a grid with its expert group
    (``spec.grid.expert = G_ep``), with its gradient summed over ``edp``
    (:func:`axo4d.facts.moe_parts.held_experts`); a dense spec unchanged."""
    r = router_of(spec.block)
    if not r:
        return spec
    share = r.top_k * ep.g_ep * ep.imbalance / r.n_experts
    return dataclasses.replace(spec, block=held_experts(spec.block, ep.g_ep, share))


def expert_grid(grid: Grid, g_ep: int) -> Grid:
    """``grid`` with its expert group of ``g_ep`` ranks where ``g_ep`` divides ``G_data`` (the
    grid as it is otherwise: :func:`ep_problems` says why)."""
    if g_ep == grid.expert or g_ep < 1 or grid.data % g_ep:
        return grid
    return dataclasses.replace(grid, expert=g_ep)


def moe_colls(spec: ModelSpec, rows: float, dt: Dtypes, recompute: bool) -> list[Coll]:
    """The MoE collectives of a micro-step the timeline does not play (none for a dense model):
    the expert group's all-to-alls of every MoE layer on ``spec``'s grid
    (:func:`axo4d.facts.moe_parts.a2a_collectives`, none with ``G_ep = 1``; their time is
    :func:`a2a_seconds`) and the routers' statistics all-reduce
    (:func:`axo4d.facts.moe_parts.router_stats_coll`)."""
    r = router_of(spec.block)
    if not r:
        return []
    return a2a_collectives(r, spec.grid, rows, dt, recompute) + [router_stats_coll(r, spec.n_layer, dt)]


def rows_of(part: object, rows: float) -> float:
    """The rows a part multiplies: ``rows * active`` for an expert, ``rows`` otherwise."""
    active = getattr(part, "active", 1.0)
    return rows if active == 1 else rows * active


def a2a_seconds(spec: ModelSpec, rows: float, dt: Dtypes, ep: ExpertParallel, machine, gpn: int, opts) -> float:
    """Seconds of one step's all-to-alls on the expert group's link (module docstring)."""
    if ep.g_ep == 1:
        return 0.0
    stride = spec.grid.stride("data")
    gbps = machine.bandwidth(stride, ep.g_ep, gpn, ALL_GATHER)
    alpha = machine.latency_s(stride, ep.g_ep, ALL_GATHER)
    passes = 2 + (1 if opts.checkpointing else 0)  # forward, backward, recomputed forward
    per_pass = a2a_elements(spec, rows, ep) * dt.act / (gbps * 1e9) + 2 * (ep.g_ep - 1) * alpha
    return per_pass * passes * spec.n_layer * opts.grad_accum


def a2a_bytes(spec: ModelSpec, rows: float, dt: Dtypes, ep: ExpertParallel, opts) -> float:
    """Bytes one rank sends over the expert group's links per step (:func:`a2a_seconds`' volume)."""
    passes = 2 + (1 if opts.checkpointing else 0)
    return a2a_elements(spec, rows, ep) * dt.act * passes * spec.n_layer * opts.grad_accum


def with_experts(
    mem: dict[str, float], spec: ModelSpec, b: float, dt: Dtypes, setup: Setup, ep: ExpertParallel
) -> dict[str, float]:
    """``mem`` (device terms of :func:`axo4d.facts.memory.memory` under ``setup``) changed as
    :func:`axo4d.facts.moe_memory.memory_with_experts` changes them; ``mem`` for a dense model."""
    if not router_of(spec.block):
        return mem
    base, moe = memory(spec, b, dt, setup).device, memory_with_experts(spec, b, dt, setup, ep).device
    out = {k: v + moe.get(k, 0.0) - base.get(k, 0.0) for k, v in mem.items() if k != "total"}
    out["total"] = sum(out.values())
    return out


def micro_collectives(spec: ModelSpec, rows: float, dt: Dtypes, recompute: bool, cached: int) -> list[Coll]:
    """:meth:`~axo4d.facts.spec.ModelSpec.collectives` with each expert's on its routed rows."""
    r = router_of(spec.block)
    if not r:
        return spec.collectives(rows, dt, recompute, cached)
    experts = tuple(p for p in spec.block if p.name.startswith(EXPERT_PREFIX))
    rest = dataclasses.replace(spec, block=tuple(p for p in spec.block if not p.name.startswith(EXPERT_PREFIX)))
    only = dataclasses.replace(spec, block=experts, embeddings=(), head=())
    routed = rows_of(experts[0], rows)
    return rest.collectives(rows, dt, recompute, cached) + only.collectives(routed, dt, recompute, cached)


def ep_candidates(spec: ModelSpec) -> list[int]:
    """Expert-group sizes the search tries on ``spec``'s grid ([1] for a dense model)."""
    return ep_sizes(spec)


def best(ests: Iterable[Any]) -> Any:
    """The feasible estimate with the shortest step (the first on equal steps), else the first."""
    ests = list(ests)
    return min(ests, key=lambda e: (not e.feasible, e.step_time_s if e.feasible else 0.0))


def grid_label(text: str, g_ep: int) -> str:
    """``data=16,x=2`` -> ``data=16(ep=8),x=2`` for ``G_ep = 8``; unchanged for 1."""
    if g_ep == 1:
        return text
    head, sep, rest = text.partition(",")
    return f"{head}(ep={g_ep}){sep}{rest}"


__all__ = [
    "IMBALANCE",
    "expert_parallel",
    "ep_problems",
    "with_experts",
    "micro_collectives",
    "routed_spec",
    "expert_grid",
    "moe_colls",
    "rows_of",
    "a2a_seconds",
    "a2a_bytes",
    "ep_candidates",
    "best",
    "grid_label",
]
