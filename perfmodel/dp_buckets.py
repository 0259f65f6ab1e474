"""The data-parallel buckets of a simulated step (:class:`Buckets`): planned as the trainer plans
them, reduced as their gradients become final, and the overlapped sharded optimizer's weight
all-gathers waited for before the first part that reads them (:mod:`perfmodel.timeline`)."""

from __future__ import annotations

from collections import deque
from typing import Any

from axo4d.facts.schedule_rules import OPTIM_INFLIGHT_GATHERS, bucket_limit, plan_buckets
from axo4d.facts.spec import ALL_GATHER, Coll

from .engine import Issue, Task, Wait
from .step_prices import Prices, StepSetup


class Buckets:
    """Data-parallel buckets planned as :func:`axo4d.nn.buckets.plan_buckets` does (the rule of
    :func:`axo4d.facts.schedule_rules.plan_buckets`), reduced in reverse per group as their parameters
    become final; with the overlapped sharded optimizer, their weight all-gathers issued at the
    start of the step (the end of the previous one), in order per group and at most
    :data:`~axo4d.facts.schedule_rules.OPTIM_INFLIGHT_GATHERS` in flight, each waited for before the
    first part that reads one of its weights (:meth:`need`)."""

    def __init__(self, layout: list[tuple[Any, int]], setup: StepSetup, prices: Prices) -> None:
        self.prices = prices
        keys, items = [], []
        for slot, (part, _) in enumerate(layout):
            for axes, nbytes, weight in prices.params(part):
                keys.append(((slot, weight), nbytes))
                items.append((len(items), axes, nbytes / setup.dt.grad * 4.0))  # planned on fp32 sizes
        red = {c.axes: c for c in setup.dp_colls if c.phase == "bwd"}
        ags = {c.axes: c for c in setup.dp_colls if c.kind == ALL_GATHER}
        self.seqs: list[list[list]] = []  # per group: buckets [needed keys, bytes, coll, done?]
        self.gathers: list[deque] = []  # per group: [slots, task] in forward order
        by_group: dict[tuple[str, ...], list] = {}
        for axes, idx in plan_buckets(items, bucket_limit(setup.bucket_mb, setup.spec, 4.0)):
            proto = record_of(red, axes)
            if proto is None or prices.link(axes, proto.kind)[0] == 1:
                continue
            by_group.setdefault(axes, []).append(
                [{keys[i][0] for i in idx}, sum(keys[i][1] for i in idx), proto, False]
            )
        for axes, buckets in by_group.items():
            self.seqs.append(list(reversed(buckets)))
            ag = record_of(ags, axes)
            if ag is not None and setup.overlap:  # the gather's bytes per reduced byte, from the records
                per = ag.nbytes / max(buckets[0][2].nbytes, 1e-30)
                self.gathers.append(deque([{k[0] for k in b[0]}, prices.task(ag, b[1] * per)] for b in buckets))
        self.final: set[tuple[int, bool]] = set()
        self.issued: list[Task] = []
        self._in_flight: list[list] = [[] for _ in self.gathers]  # per group: [slots, task] issued, not waited

    def ready(self, key: tuple[int, bool], prog: list) -> None:
        """The gradients of ``key`` = (slot, z-sharded weights or not) are final: issue every
        bucket now complete (in order per group)."""
        self.final.add(key)
        for seq in self.seqs:
            for b in seq:
                if b[3]:
                    continue
                if not b[0] <= self.final:
                    break
                self._issue(b, prog)

    def flush(self, prog: list, serial: bool = False) -> None:
        """Issue what is left and wait for everything (``serial``: one bucket at a time, as the
        eager schedule's ``finish`` does)."""
        for seq in self.seqs:
            for b in seq:
                if not b[3]:
                    self._issue(b, prog)
                    if serial and self.issued:
                        prog.append(Wait(self.issued.pop()))
        prog += [Wait(t) for t in self.issued]
        self.issued = []

    def _issue(self, b: list, prog: list) -> None:
        b[3] = True
        t = self.prices.task(b[2], b[1])
        if t is not None:
            prog.append(Issue(t))
            self.issued.append(t)

    # ---- the sharded optimizer's weight all-gathers, overlapped with the next forward --------
    def start_gathers(self, prog: list) -> None:
        for g in range(len(self.gathers)):
            self._top_up(g, prog)

    def _top_up(self, g: int, prog: list) -> None:
        while self.gathers[g] and len(self._in_flight[g]) < OPTIM_INFLIGHT_GATHERS:
            item = self.gathers[g].popleft()
            if item[1] is not None:
                prog.append(Issue(item[1]))
            self._in_flight[g].append(item)

    def need(self, slot: int, prog: list) -> None:
        """Part ``slot`` reads its weights: wait for the gathers up to its bucket's (each group)."""
        for g in range(len(self.gathers)):
            while any(slot in it[0] for it in self._in_flight[g]) or any(slot in it[0] for it in self.gathers[g]):
                self._top_up(g, prog)
                slots, t = self._in_flight[g].pop(0)
                if t is not None:
                    prog.append(Wait(t))
                self._top_up(g, prog)

    def end_gathers(self, prog: list) -> None:
        """Wait for any gather no part read (a forward that left a parameter unused)."""
        for g in range(len(self.gathers)):
            while self._in_flight[g] or self.gathers[g]:
                self._top_up(g, prog)
                _, t = self._in_flight[g].pop(0)
                if t is not None:
                    prog.append(Wait(t))


def record_of(kinds: dict[tuple[str, ...], Coll], axes: tuple[str, ...]) -> Coll | None:
    """The record of ``kinds`` whose group is ``axes`` (in any order)."""
    return kinds.get(axes) or next((c for a, c in kinds.items() if set(a) == set(axes)), None)


__all__ = ["Buckets", "record_of"]
