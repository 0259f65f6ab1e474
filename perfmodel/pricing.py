"""Prices of one grid's collectives and compute: each group's link (size, bandwidth, latency), the
seconds of a call, and the per-phase compute and per-axis communication totals of a step."""

from __future__ import annotations

import math

from axo4d.facts.grid import Grid
from axo4d.facts.spec import AttentionSpec, Coll, ModelSpec

from .collectives import axis_of, collective_time, group_name, latency_steps, link_kind
from .machine import Machine, group_link, group_span
from .step_prices import Prices, StepSetup


class Pricer:
    """Prices collectives on one grid, caching each group's (p, bw, alpha)."""

    def __init__(self, grid: Grid, machine: Machine, gpus_per_node: int):
        self.grid, self.machine, self.gpn = grid, machine, gpus_per_node
        self.links: dict[tuple, tuple[int, float, float]] = {}
        self._secs: dict[tuple, float] = {}  # one call's seconds per (axes, kind, bytes)

    def link(self, axes: tuple[str, ...], kind: str | None = None) -> tuple[int, float, float]:
        """``(group size, GB/s, alpha seconds)`` of the group over ``axes`` for collective ``kind``."""
        v = self.links.get((axes, kind))
        if v is None:
            stride, p = group_link(self.grid, axes)
            if p == 1:
                v = (1, math.inf, 0.0)
            else:
                k = link_kind(kind) if kind else kind
                v = (p, self.machine.bandwidth(stride, p, self.gpn, k), self.machine.latency_s(stride, p, k))
            self.links[(axes, kind)] = v
        return v

    def seconds(self, c: Coll) -> float:
        """Seconds of one call of ``c`` (memoised per group, kind and size: records of the same
        shape recur in every phase)."""
        key = (c.axes, c.kind, c.nbytes)
        v = self._secs.get(key)
        if v is None:
            p, bw, alpha = self.link(c.axes, c.kind)
            v = self._secs[key] = 0.0 if p == 1 else collective_time(c.kind, c.nbytes, p, bw, alpha)
        return v

    def latency(self, c: Coll) -> float:
        """The latency part (ring steps times alpha) of one call of ``c``."""
        p, _, alpha = self.link(c.axes, c.kind)
        return 0.0 if p == 1 else latency_steps(c.kind, p) * alpha

    def link_class(self, axes: tuple[str, ...]) -> str:
        """'inter' when the group's ranks span more than a node (of the job's GPUs per node)."""
        return "inter" if group_span(self.grid, tuple(axes)) > self.gpn else "intra"


def compute_detail(setup: StepSetup, prices: Prices) -> dict[str, float]:
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


def price(colls: list[Coll], spec: ModelSpec, pricer: Pricer) -> tuple:
    """Seconds per axis (alone), bytes and calls per (group, kind), and per-collective details."""
    comm = {a: 0.0 for a in ("x", "y", "z", "data")}
    sent: dict[tuple[str, str], float] = {}
    calls: dict[tuple[str, str], int] = {}
    details = []
    names: dict[tuple[str, ...], tuple[str, str]] = {}  # axes -> (axis reported under, group name)
    for c in colls:
        reps = c.calls * (spec.n_layer if c.per_block else 1)
        p = pricer.link(c.axes, c.kind)[0]  # the group's size is the same for every kind
        t1 = pricer.seconds(c)
        details.append((c, reps, t1))
        axis, name = names.get(c.axes) or names.setdefault(c.axes, (axis_of(c.axes), group_name(c.axes)))
        comm[axis] += t1 * reps
        if p > 1:
            key = (name, c.kind)
            sent[key] = sent.get(key, 0.0) + c.nbytes * reps
            calls[key] = calls.get(key, 0) + reps
    return comm, sent, calls, details


__all__ = ["Pricer", "compute_detail", "price"]
