"""Two terms of the lower bound of :mod:`perfmodel.pruning`: a GEMM in row chunks (:func:`segments`,
:func:`segment_extra`) and the data-parallel tail (:func:`dp_tail`).

**A GEMM in row chunks.**

:meth:`perfmodel.timeline._Phases._chunks` plays a linear layer whose input all-gather (and, in the
forward, output reduce-scatter) is chunked as: every chunk's gather issued (overlapped schedule: all
at once, before the first chunk; eager: each before its chunk), then per chunk: wait for its
gathers, its share ``G/n`` of the GEMM, issue its reduce-scatters; in the forward every
reduce-scatter is waited for right after the last chunk (eager: each at once). In the backward
every chunked record of the phase is waited for before each chunk's GEMM (the dY gathers), and the
dX reduce-scatters are waited for later, at the phase's end (not counted here).

Call the segment of the compute stream from the first gather's issue to the last wait above ``S``;
the compute inside it is the GEMM, ``G`` seconds alone. Under the engine's premises (a group runs
its collectives one at a time, each at least as long as alone; compute at rate <= 1), with ``a``
the longest gather of a chunk, ``r`` the longest reduce-scatter of a chunk, and per group ``A`` and
``R`` the seconds alone of one chunk's gathers and reduce-scatters on that group:

* ``S >= a + G + r``: the first chunk waits for its gathers before any GEMM, the last chunk's
  reduce-scatter is issued after the last GEMM and waited for (the form the bound had before);
* ``S >= n A + G/n + r``: the group plays every chunk's gathers one after another from the
  segment's start, and the last chunk's GEMM waits for the last of them;
* ``S >= a + G/n + n R``: the first reduce-scatter is issued after the first chunk's GEMM and the
  group plays all ``n`` before the last wait;
* ``S >= n (A + R)``: a group that carries both plays both, all inside the segment.

So the step's compute-stream time exceeds its compute seconds by at least ``S - G`` per segment
(:func:`segment_extra`), each block contributing alike (affine in the blocks, as the bound needs).
"""

from __future__ import annotations

import math
from typing import Any, Callable

from axo4d.facts.spec import ALL_GATHER, Coll, Dtypes, ModelSpec

from .collectives import collective_time
from .pricing import Pricer

Segment = tuple[str, float, int, tuple[Coll, ...], tuple[Coll, ...], int]
"""``(phase, GEMM seconds, chunks, gathers, reduce-scatters, times per micro-step)``."""


def segments(spec: ModelSpec, micro: list[Coll], fwd_gemm: Callable, dx_gemm: Callable) -> list[Segment] | None:
    """The chunked GEMMs of one micro-step from its collective records ``micro`` (grouped by layer
    and phase), or ``None`` where a layer name is not one part of ``spec`` (the bound then keeps
    its per-record form). ``fwd_gemm(part)``, ``dx_gemm(part, in_block)``: the GEMM seconds the
    timeline plays."""
    parts: dict[str, tuple[Any, bool]] = {}
    for p, in_block in [(p, False) for p in spec.embeddings + spec.head] + [(p, True) for p in spec.block]:
        if p.name in parts:  # two parts of one name: their records cannot be told apart
            return None
        parts[p.name] = (p, in_block)
    groups: dict[tuple[str, str], list[Coll]] = {}
    for c in micro:
        if c.pool == "chunks" and c.phase in ("fwd", "bwd", "recompute"):
            groups.setdefault((c.layer, c.phase), []).append(c)
    out: list[Segment] = []
    for (layer, phase), cs in groups.items():
        hit = parts.get(layer)
        if hit is None or any(c.per_block != hit[1] or c.calls != cs[0].calls for c in cs):
            return None
        part, in_block = hit
        if phase == "bwd":
            gathers, scatters, gemm = tuple(cs), (), dx_gemm(part, in_block)
        else:
            gathers = tuple(c for c in cs if c.kind == ALL_GATHER)
            scatters, gemm = tuple(c for c in cs if c.kind != ALL_GATHER), fwd_gemm(part)
        out.append((phase, gemm, cs[0].calls, gathers, scatters, spec.n_layer if in_block else 1))
    return out


def segment_extra(seg: Segment, seconds: Callable[[Coll], float]) -> float:
    """Seconds the segment's stalls add at least to its GEMM (module docstring); ``seconds(c)``: one
    call of ``c`` alone (0 for a group of one rank)."""
    _, gemm, n, gathers, scatters, _ = seg
    ta = [seconds(c) for c in gathers]
    tr = [seconds(c) for c in scatters]
    a, r, g = max(ta, default=0.0), max(tr, default=0.0), gemm / n
    on: dict[tuple[str, ...], list[float]] = {}
    for c, t in zip(gathers, ta):
        on.setdefault(c.axes, [0.0, 0.0])[0] += t
    for c, t in zip(scatters, tr):
        on.setdefault(c.axes, [0.0, 0.0])[1] += t
    s = a + gemm + r
    for ga, gr in on.values():
        s = max(s, n * ga + g + r if ga else s, a + g + n * gr if gr else s, n * (ga + gr))
    return s - gemm


def group_elems(spec: ModelSpec) -> dict[frozenset, float]:
    """Gradient elements one rank holds per data-parallel group (the set of its axes), as the
    timeline's buckets count them (:func:`perfmodel.step_prices._params`)."""
    out: dict[frozenset, float] = {}
    for _, pl, per_block in spec.placements():
        n = math.prod(pl.full_shape) / (spec.grid.size(*pl.split) if pl.split else 1)
        k = frozenset(pl.grad_sum)
        out[k] = out.get(k, 0.0) + n * (spec.n_layer if per_block else 1)
    return out


def dp_tail(
    dp: list[Coll], elems: dict, dt: Dtypes, pricer: Pricer, overlap: bool, stream: float, last_bwd: float, tail: float
) -> float:
    """Seconds the data-parallel buckets add at least to ``stream`` (the compute and blocking
    seconds of the step; ``last_bwd``: those of the last micro-step's backward, ``tail``: those after
    its buckets are waited for). A group runs its collectives one at a time, each at least as long
    as alone (``latency + work``; the sum over a group's buckets at least one latency and the work
    of all their bytes, as the timeline's buckets carry them): the gradient reduce-scatters (or
    all-reduces) are issued from the last micro-step's backward on and waited for before ``tail``,
    so the step lasts at least ``stream - last_bwd - tail + max(last_bwd, RS) + tail``; the
    overlapped sharded optimizer's weight all-gathers run on the same group from the step's start,
    so at least ``AG + RS + tail``. The eager schedule waits for each bucket after the backward
    and gathers after the optimizer: every group's seconds add."""
    red = {frozenset(c.axes): c for c in dp if c.phase == "bwd"}
    ags = {frozenset(c.axes): c for c in dp if c.kind == ALL_GATHER}
    extra = serial = 0.0
    for key, n in elems.items():
        c = red.get(key)
        if c is None or n <= 0:
            continue
        p, gbps, alpha = pricer.link(c.axes, c.kind)
        if p == 1:
            continue
        nb = n * dt.grad
        rs = collective_time(c.kind, nb, p, gbps, alpha)  # one call's latency + every byte's work
        ag = 0.0
        a = ags.get(key)
        if a is not None and c.nbytes > 0:
            pa, ga, la = pricer.link(a.axes, a.kind)
            ag = collective_time(a.kind, nb * a.nbytes / c.nbytes, pa, ga, la)
        if not overlap:
            serial += rs + ag
            continue
        t = max(stream - last_bwd - tail + max(last_bwd, rs), ag + rs) + tail - stream
        extra = max(extra, t)
    return serial if not overlap else max(0.0, extra)


__all__ = ["Segment", "segments", "segment_extra", "group_elems", "dp_tail"]
