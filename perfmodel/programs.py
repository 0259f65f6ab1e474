"""Step programs written once per grid's sizes and reused for its other rank orders.

A rank order changes which groups stay inside a node, hence each collective's link (bandwidth,
latency, link class), and nothing else of a step program (:func:`perfmodel.timeline.step_program`):
which collectives run is decided by group sizes, and the compute seconds by the local shapes.
:class:`Programs` keeps, per key (the grid's sizes and the estimate's options, from
:class:`perfmodel.plan.LinkMemo`), the first program written and the arguments of every task it
holds, and answers a later request with the same actions, each task priced anew on the new
order's links (:meth:`perfmodel.step_prices.Prices.task`) -- the same program
:func:`~perfmodel.timeline.step_program` would write, without writing it.
"""

from __future__ import annotations

from typing import Hashable

from .engine import Compute
from .step_prices import Prices, StepSetup
from .timeline import step_program


class Programs:
    """``programs(setup, prices, uncached, cached, micro)`` as :func:`step_program`, for one ``key``
    at a time (:meth:`keyed`): the program of an earlier call with the same key and block counts,
    its tasks priced by ``prices``."""

    def __init__(self) -> None:
        self._kept: dict[tuple, tuple[list, list]] = {}
        self.key: Hashable = None

    def keyed(self, key: Hashable) -> Programs:
        """This cache answering for ``key`` (sizes and options that fix a program but its links)."""
        self.key = key
        return self

    def __call__(self, setup: StepSetup, prices: Prices, uncached: int, cached: int, micro: int) -> list:
        k = (self.key, uncached, cached, micro)
        kept = self._kept.get(k)
        if kept is None:
            prices.made = []
            try:
                prog = step_program(setup, prices, uncached, cached, micro)
                self._kept[k] = (prog, prices.made)
            finally:
                prices.made = None
            return prog
        prog, made = kept
        new = {id(old): prices.task(*args) for old, args in made}
        return [a if type(a) is Compute else type(a)(new[id(a.task)]) for a in prog]


__all__ = ["Programs"]
