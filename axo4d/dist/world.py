"""The world group's calls that move no model tensor: broadcasting and gathering picklable
objects, agreeing every rank's outcome of a step (:meth:`WorldOps.on_rank0`,
:meth:`WorldOps.on_every_rank`), barriers, and the step boundary's one-integer maximum. Each is
traced and turns a failure into one :class:`~axo4d.config.errors.CommError` naming the rank
(:meth:`WorldOps._world`). :class:`axo4d.dist.comm.Comm` inherits them.
"""

from __future__ import annotations

from typing import Callable, TypeVar

import torch
import torch.distributed as dist

from axo4d.config.errors import USER_ERRORS, CommError, ConfigError, agreed
from axo4d.dist.bootstrap import first_line
from axo4d.dist.faults import Faults
from axo4d.dist.flight import CollectiveTrace
from axo4d.facts.grid import Grid

T = TypeVar("T")


class WorldOps:
    """Collectives over the world group of a rank's :class:`~axo4d.dist.comm.Comm`, which provides
    ``grid``, ``rank``, ``faults``, ``trace`` (and :meth:`_failed`: the error after the trace is
    written)."""

    grid: Grid
    rank: int
    faults: Faults | None
    trace: CollectiveTrace | None

    def _failed(self, msg: str, rec: list | None) -> CommError:
        """The CommError of a failed collective, after the trace is written (:mod:`axo4d.dist.flight`)."""
        if self.trace is not None:
            self.trace.failed(msg, rec)
        return CommError(msg)

    def _world(self, op: str, fn: Callable[[], T], nbytes: int = 0) -> T:
        """Run ``fn`` (a collective over the world group, blocking) traced and with one clear error
        (``nbytes``: its size for the trace; 0 for objects, whose pickled size is not known here)."""
        if self.faults is not None and self.faults.hit(f"{op}:world", self.rank):
            return None  # type: ignore[return-value]
        rec = self.trace.start("world", op, nbytes) if self.trace is not None else None
        try:
            out = fn()
        except Exception as e:
            raise self._failed(f"rank {self.rank}: {op} over world failed or timed out: {first_line(e)}", rec) from None
        if rec is not None:
            CollectiveTrace.end(rec)
        return out

    def broadcast_object(self, obj, src: int = 0):
        """Broadcast a picklable object from global rank ``src`` (world group)."""
        if self.grid.world_size == 1:
            return obj
        lst = [obj]
        self._world("broadcast_object", lambda: dist.broadcast_object_list(lst, src=src))
        return lst[0]

    def all_gather_object(self, obj) -> list:
        """Every rank's picklable ``obj``, indexed by global rank (world group)."""
        if self.grid.world_size == 1:
            return [obj]
        out: list = [None] * self.grid.world_size
        self._world("all_gather_object", lambda: dist.all_gather_object(out, obj))
        return out

    def agree(self, err: BaseException | None) -> BaseException | None:
        """Share each rank's outcome of a step that every rank ran: the error of the lowest rank
        that failed (the same object on every rank), or None when all succeeded."""
        errs = self.all_gather_object(err)
        return next((e for e in errs if e is not None), None)

    def on_rank0(self, fn: Callable[[], T]) -> T:
        """``fn()`` run on rank 0 and its result shared with every rank; a user error there (or an
        OS error, as a :class:`ConfigError` naming the file) is raised on every rank alike."""
        res, err = None, None
        if self.rank == 0:
            try:
                res = fn()
            except USER_ERRORS as e:
                err = e
            except OSError as e:
                err = ConfigError(f"{e.strerror or e}: {e.filename!r}" if e.filename else str(e))
        res, err = self.broadcast_object((res, err))
        if err is not None:
            raise agreed(err)
        return res

    def on_every_rank(self, fn: Callable[[], T]) -> T:
        """``fn()`` run on every rank; a user error on any rank stops every rank alike (the lowest
        rank's error, raised everywhere)."""
        res, err = None, None
        try:
            res = fn()
        except USER_ERRORS as e:
            err = e
        err = self.agree(err)
        if err is not None:
            raise agreed(err)
        return res

    def barrier(self) -> None:
        if self.grid.world_size > 1:
            self._world("barrier", dist.barrier)

    def max_over_world(self, value: int) -> int:
        """The largest ``value`` of any rank: one 8-byte all-reduce over the world group (the step
        boundary's agreement on signals and background saves, :mod:`axo4d.training.lifecycle`)."""
        if self.grid.world_size == 1:
            return int(value)
        dev = "cuda" if dist.get_backend() == "nccl" else "cpu"
        t = torch.tensor([value], dtype=torch.int64, device=dev)  # not in self.bytes: no model traffic
        self._world("all_reduce", lambda: dist.all_reduce(t, op=dist.ReduceOp.MAX), 8)
        return int(t[0])
