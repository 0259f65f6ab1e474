"""What one simulated step costs, piece by piece: :class:`StepSetup` (what the step does) and
:class:`Prices` (each collective call as an engine task, each part's compute seconds per phase,
memoised per estimate), for :mod:`perfmodel.timeline`."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

from axo4d.facts.placement import Block3D
from axo4d.facts.spec import Coll, Dtypes, LinearSpec, ModelSpec

from . import compute as C
from .collectives import axis_of, collective_time, latency_steps
from .engine import Task
from .expert_pricing import rows_of


@dataclass(frozen=True)
class StepSetup:
    """What one step does: the model on its grid, local rows per micro-step, element sizes,
    recomputation, overlap, cached blocks, accumulation micro-steps, bucket size
    (``parallel.dp_bucket_mb``: 'auto' or MiB), fused attention."""

    spec: ModelSpec
    rows: float
    dt: Dtypes
    checkpointing: bool
    overlap: bool
    cached_blocks: int
    grad_accum: int
    bucket_mb: str | float
    flash: bool
    dp_colls: tuple[Coll, ...]
    step_colls: tuple[Coll, ...]


class Prices:
    """Seconds of the pieces: ``task(coll)`` -> a :class:`~perfmodel.engine.Task` (or ``None`` for
    a group of one rank), and compute seconds of each part and phase."""

    def __init__(
        self,
        setup: StepSetup,
        machine: Any,
        link: Callable[[tuple[str, ...], str], tuple],
        link_class: Callable[[tuple[str, ...]], str],
    ) -> None:
        self.s, self.m, self.link, self.link_class = setup, machine, link, link_class
        self.gemm = machine.gemm_model
        self.dtype = C.dtype_name(setup.dt)
        self.scores = not (setup.flash or machine.attention_tflops)
        self._memo: dict = {}
        self._tasks: dict = {}
        self._links: dict = {}
        self._colls: dict = {}
        self.made: list | None = None

    def task(self, c: Coll, n_bytes: float | None = None, calls: int = 1) -> Task | None:
        """A fresh task for one call of ``c`` (of ``n_bytes`` instead of its size when given;
        ``calls`` > 1: that many calls back to back, one task of their summed time). With ``made``
        a list, each task is recorded there with these arguments (:class:`perfmodel.programs.Programs`)."""
        kept = self._tasks.get((id(c), n_bytes))  # by identity: the record is kept beside its price
        if kept is None or kept[0] is not c:
            kept = self._tasks[(id(c), n_bytes)] = (c, self._price(c, n_bytes))
        v = kept[1]
        if not v:
            return None
        t = Task(*v)
        if calls != 1:
            t.latency, t.work = t.latency * calls, t.work * calls
        if self.made is not None:
            self.made.append((t, (c, n_bytes, calls)))
        return t

    def _price(self, c: Coll, n_bytes: float | None) -> tuple:
        """The fields of ``c``'s task (``()`` for a group of one rank)."""
        p, gbps, alpha = self.link(c.axes, c.kind)
        if p == 1:
            return ()
        nb = c.nbytes if n_bytes is None else n_bytes
        lat = latency_steps(c.kind, p) * alpha
        total = collective_time(c.kind, nb, p, gbps, alpha)
        link = self._links.get(c.axes) or self._links.setdefault(c.axes, self.link_class(c.axes))
        return (c.axes, axis_of(c.axes), link, lat, max(0.0, total - lat))

    def _elementwise(self, nbytes: float, ops: float) -> float:
        t = nbytes / (self.m.memory_gbps * 1e9) if self.m.memory_gbps else 0.0
        return t + ops * self.m.op_overhead_us * 1e-6

    def part(self, part: Any, phase: str, in_block: bool) -> tuple[float, float]:
        """``(seconds before, seconds after)`` the dX all-reduce is issued, for ``phase`` in
        'fwd', 'rec', 'bwd' (forward phases: everything 'before')."""
        key = (id(part), phase, in_block)
        v = self._memo.get(key)
        if v is None:
            v = self._memo[key] = self._part(part, phase, in_block)
        return v

    def _part(self, part: Any, phase: str, in_block: bool) -> tuple[float, float]:
        s, grid, rows = self.s, self.s.spec.grid, rows_of(part, self.s.rows)  # an expert: its routed rows
        parts = s.spec.block if in_block else s.spec.embeddings + s.spec.head
        ops = (C.OPS_BLOCK if in_block else C.OPS_HEAD) / max(1, len(parts))
        ew = C.part_bytes(part, s.spec, rows, s.dt, in_block, self.scores)
        fwd_ops, bwd = ops / 3, phase == "bwd"
        other = self._elementwise(ew * (2 if bwd else 1), ops - fwd_ops if bwd else fwd_ops)
        if isinstance(part, LinearSpec):
            g, dtype = C.linear_gemms(part, grid, rows), C.FP8 if part.fp8 else self.dtype
            if not bwd:
                return self.gemm.seconds(*g["fwd"], dtype) + other, 0.0
            return self.gemm.seconds(*g["dx"], dtype), self.gemm.seconds(*g["dw"], dtype) + other
        flops = part.gemm_flops(grid, rows)
        if flops:
            rate = (
                self.m.attention_tflops * 1e12
                if self.m.attention_tflops
                else self.gemm.flops_per_s(
                    getattr(part, "seq_len", rows),
                    getattr(part, "seq_len", rows),
                    getattr(part, "head_dim", rows),
                    "nt",
                    self.dtype,
                )
            )
            other += flops * (2 if bwd else 1) / rate
        return other, 0.0

    def dw(self, part: LinearSpec) -> float:
        """Seconds of ``part``'s dW GEMM (the part of its backward a deferral moves)."""
        return self._gemm(part, "dw")

    def fwd_gemm(self, part: LinearSpec) -> float:
        """Seconds of ``part``'s forward GEMM (cut into row chunks: :meth:`LinearSpec.fwd_chunks`)."""
        return self._gemm(part, "fwd")

    def _gemm(self, part: LinearSpec, kind: str) -> float:
        key = (id(part), kind)
        v = self._memo.get(key)
        if v is None:
            g = C.linear_gemms(part, self.s.spec.grid, rows_of(part, self.s.rows))
            v = self._memo[key] = self.gemm.seconds(*g[kind], C.FP8 if part.fp8 else self.dtype)
        return v

    def optimizer(self) -> float:
        """Seconds of the optimizer step (AdamW traffic, launches)."""
        v = self._memo.get("optimizer")
        if v is None:
            sp = self.s.spec
            v = self._memo["optimizer"] = self._elementwise(C.optimizer_bytes(sp, self.s.dt), C.step_ops(sp))
        return v

    def params(self, part: Any) -> list[tuple[tuple[str, ...], float, bool]]:
        """:func:`_params` of ``part``, memoised."""
        key = ("params", id(part))
        v = self._memo.get(key)
        if v is None:
            v = self._memo[key] = _params(part, self.s.spec, self.s.dt)
        return v


def _params(part: Any, spec: ModelSpec, dt: Dtypes) -> list[tuple[tuple[str, ...], float, bool]]:
    """``(grad_sum axes, gradient bytes on this rank, is a z-sharded weight)`` of a part's parameters."""
    out = []
    for pl in part.placements().values():
        n = math.prod(pl.full_shape) / (spec.grid.size(*pl.split) if pl.split else 1)
        out.append((tuple(pl.grad_sum), n * dt.grad, isinstance(pl, Block3D)))
    return out


__all__ = ["StepSetup", "Prices"]
