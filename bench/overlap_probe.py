"""Compute alone and communication alone of a training step, for :mod:`bench.overlap`'s ideal ratio.

* :class:`NullComm`: the grid and rank of a job without any process group; every collective
  returns at once a tensor of the shape the real one returns (an all-reduce its input, an
  all-gather its input repeated, a reduce-scatter this rank's slice of its input: the copies the
  real call writes). A trainer on it runs the step's compute and nothing else (the values are not
  summed, so its losses mean nothing; only its time is used).
* :class:`Recorder`: the collectives a :class:`~axo4d.dist.comm.Comm` issues while recording
  (kind, axes, elements, dtype), in issue order; :func:`replay` issues the same calls on the same
  groups with tensors of the same sizes, one after the other and each waited for: the step's
  communication with nothing else running. Every rank issues its collectives in program order,
  so every rank replays the same sequence per group.

``max(comm, compute) / (comm + compute)`` is then the on/off ratio of perfect overlap (each
hidden entirely behind the other), beside the measured one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import torch

from axo4d.dist.comm import Comm, Handle
from axo4d.facts.grid import Grid


class NullComm(Comm):
    """A :class:`Comm` that communicates nothing (module docstring)."""

    def __init__(self, grid: Grid, rank: int) -> None:
        super().__init__(grid, rank, init_groups=False)

    def _done(self, t: torch.Tensor, async_op: bool):
        return Handle(None, t, "") if async_op else t

    def all_reduce(self, t: torch.Tensor, axes, async_op: bool = False, op: str = "sum"):
        return self._done(t, async_op)

    def all_gather(self, t: torch.Tensor, axes, async_op: bool = False, out: torch.Tensor | None = None):
        n = self.size(axes)
        full = t.reshape(-1).repeat(n) if n > 1 else t
        return self._done(out.copy_(full) if out is not None else full, async_op)

    def reduce_scatter(self, t: torch.Tensor, axes, async_op: bool = False):
        n, flat = self.size(axes), t.reshape(-1)
        return self._done(flat[: flat.numel() // n].clone() if n > 1 else flat, async_op)

    def broadcast_object(self, obj, src: int = 0):
        return obj

    def all_gather_object(self, obj) -> list:
        return [obj] * self.grid.world_size

    def barrier(self) -> None:
        pass


@dataclass(frozen=True)
class Call:
    """One recorded collective: ``kind`` ('all_reduce', 'all_gather', 'reduce_scatter'), its
    ``axes``, the input's elements and dtype."""

    kind: str
    axes: tuple[str, ...]
    numel: int
    dtype: torch.dtype


class Recorder:
    """Records the collectives of ``comm`` between :meth:`start` and :meth:`stop` (wraps its
    three collective methods on this instance only)."""

    KINDS = ("all_reduce", "all_gather", "reduce_scatter")

    def __init__(self, comm: Comm) -> None:
        self.comm, self.calls, self.on = comm, [], False
        for kind in self.KINDS:
            setattr(comm, kind, self._wrap(kind, getattr(comm, kind)))
        # the two-rank forms straight between runs: recorded as the flat collective they are
        comm.gather_runs = self._wrap_runs("all_gather", comm.gather_runs, 1)
        comm.reduce_scatter_runs = self._wrap_runs("reduce_scatter", comm.reduce_scatter_runs, 2)

    def _wrap_runs(self, kind: str, fn, factor: int):
        def call(mine: list, other: list, axes, *args, **kw):
            key = (axes,) if isinstance(axes, str) else tuple(axes)
            if self.on:
                self.calls.append(Call(kind, key, factor * sum(r.numel() for r in mine), mine[0].dtype))
            return fn(mine, other, axes, *args, **kw)

        return call

    def _wrap(self, kind: str, fn):
        def call(t: torch.Tensor, axes, *args, **kw):
            key = (axes,) if isinstance(axes, str) else tuple(axes)
            if self.on and self.comm.size(key) > 1:
                self.calls.append(Call(kind, key, t.numel(), t.dtype))
            return fn(t, axes, *args, **kw)

        return call

    def start(self) -> None:
        self.calls, self.on = [], True

    def stop(self) -> list[Call]:
        self.on = False
        return list(self.calls)


def replay(comm: Comm, calls: Iterable[Call]) -> None:
    """Issue ``calls`` on ``comm``'s groups, each waited for before the next (module docstring)."""
    bufs: dict[tuple[int, torch.dtype], torch.Tensor] = {}
    for c in calls:
        t = bufs.get((c.numel, c.dtype))
        if t is None:
            t = bufs[(c.numel, c.dtype)] = torch.zeros(c.numel, dtype=c.dtype)
        getattr(comm, c.kind)(t, c.axes)


def ideal_ratio(comm_s: float, compute_s: float) -> float:
    """``max(comm, compute) / (comm + compute)``: the on/off ratio of perfect overlap."""
    total = comm_s + compute_s
    return max(comm_s, compute_s) / total if total > 0 else float("nan")


__all__ = ["NullComm", "Recorder", "Call", "replay", "ideal_ratio"]
