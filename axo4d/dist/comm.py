"""Process groups of a grid, named collectives, and autograd primitives.

:class:`Comm` owns the process group of every axis (and of the combined
groups the layers need), built once on every rank in the same order. Its
collectives skip groups of one rank (no call, no copy), count bytes per axis
and operation, and turn a failure or timeout into :class:`CommError` naming
the rank, the group and the operation.

Timeouts come in two phases, like torchtitan's: the groups start with the start-up timeout
(``parallel.init_timeout_s``: process group, set-up, the first step with its compilation and
tuning, checkpoint saves and loads) and :meth:`Comm.set_timeout` shortens it once training runs
(``parallel.timeout_s``), so that a hung rank stops the others quickly.
:meth:`Comm.close` destroys the groups and drops them; :func:`axo4d.dist.bootstrap.shutdown`
closes every live Comm before it destroys the world group.

Every collective of a rank is recorded in its :class:`~axo4d.dist.flight.CollectiveTrace` (when
one is given: ``parallel.trace_collectives``), under the name of its process group (``world`` for
the world group) with the group's sequence number; a failure or timeout writes the trace and
compares the ranks' traces (:mod:`axo4d.dist.flight`).

The world group's calls on objects and scalars (broadcasts, agreements of an outcome, barriers)
are :class:`~axo4d.dist.world.WorldOps`, which :class:`Comm` inherits.

Byte-counting convention (shared with ``perfmodel``): the logical message
size ``n`` of each call -- the input of an all-reduce, the gathered output of
an all-gather, the full input of a reduce-scatter -- in bytes, per rank.
"""

from __future__ import annotations

import contextlib
import datetime
import sys
from collections import Counter
from typing import Iterable, Iterator, Sequence

import torch
import torch.distributed as dist

from axo4d.config.errors import CommError
from axo4d.dist import pairwise
from axo4d.dist.bootstrap import first_line, native_stderr_captured, register_closable
from axo4d.dist.buffers import BufferPool
from axo4d.dist.faults import Faults
from axo4d.dist.flight import CollectiveTrace
from axo4d.dist.world import WorldOps
from axo4d.facts.grid import Grid

#: Groups built at start-up: each axis, the batch-sharding group, the tensor-parallel group.
GROUP_AXES: tuple[tuple[str, ...], ...] = (
    ("x",),
    ("y",),
    ("z",),
    ("data",),
    ("z", "data"),
    ("x", "y", "z"),
    ("x", "y"),
    ("ep",),
    ("edp",),
)
EXPERT_GROUPS: tuple[tuple[str, ...], ...] = (("ep",), ("edp",))
"""The expert group and the copies of its experts (sub-axes of data, :mod:`axo4d.facts.grid`):
built when ``grid.expert`` > 1; otherwise ``edp`` is the data group and ``ep`` has one rank."""

_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _key(axes: Iterable[str] | str) -> tuple[str, ...]:
    return (axes,) if isinstance(axes, str) else tuple(axes)


class Handle:
    """A pending collective; ``wait()`` returns its result tensor."""

    def __init__(self, work, result: torch.Tensor, describe: str, post=None, rec: list | None = None, trace=None):
        self._work, self._result, self._describe, self._post = work, result, describe, post
        self._rec, self._trace = rec, trace

    def wait(self) -> torch.Tensor:
        if self._work is not None:
            try:
                self._work.wait()
            except Exception as e:
                msg = f"{self._describe} failed or timed out: {first_line(e)}"
                if self._trace is not None:
                    self._trace.failed(msg, self._rec)
                raise CommError(msg) from None
            self._work = None
            if self._rec is not None:
                CollectiveTrace.end(self._rec)
            if self._post is not None:
                self._result = self._post(self._result)
        return self._result


class Comm(WorldOps):
    """The process groups of ``grid`` seen from ``rank``, and collectives over them.

    ``Comm(grid, rank, init_groups=False)`` gives the arithmetic without any
    process group (sizes, indices) for single-process use and tests.
    """

    def __init__(
        self,
        grid: Grid,
        rank: int = 0,
        *,
        init_groups: bool = True,
        timeout_s: float | None = None,
        faults: Faults | None = None,
        trace: CollectiveTrace | None = None,
    ) -> None:
        self.grid = grid
        self.faults = faults
        self.trace = trace
        self.rank = rank
        self.timeout_s = timeout_s
        self.bytes: Counter = Counter()
        self.calls: Counter = Counter()
        self._groups: dict[tuple[str, ...], object] = {}
        self._pairs: dict[tuple[str, ...], tuple[int, int] | None] = {}
        self.buffers = BufferPool()  # CPU buffers of the bucket collectives, reused (axo4d.dist.buffers)
        self._ranks: dict[tuple[str, ...], tuple[int, ...]] = {}
        for axes in GROUP_AXES:
            self._ranks[axes] = grid.group_ranks(rank, axes)
        #: the trace's name of each axes' process group ('world' for the world group)
        self._names = {
            axes: "world" if grid.size(*axes) == grid.world_size else "+".join(self._alias(axes)) for axes in GROUP_AXES
        }
        if trace is not None:
            trace.add_group("world", range(grid.world_size))
            for axes in GROUP_AXES:
                if grid.size(*axes) > 1 and self._alias(axes) == axes:
                    trace.add_group(self._names[axes], self._ranks[axes])
        if init_groups and grid.world_size > 1:
            self._build(timeout_s)
            register_closable(self)

    def _build(self, timeout_s: float | None) -> None:
        kw = {"timeout": datetime.timedelta(seconds=timeout_s)} if timeout_s else {}
        for axes in GROUP_AXES:
            if self.grid.size(*axes) == 1 or self._alias(axes) != axes:
                continue
            if self.grid.size(*axes) == self.grid.world_size:
                self._groups[axes] = dist.group.WORLD
                continue
            for ranks in self.grid.all_groups(axes):
                with native_stderr_captured() as log:
                    try:
                        g = dist.new_group(sorted(ranks), **kw)
                    except Exception as e:
                        g = CommError(
                            f"rank {self.rank}: start-up: building the {'+'.join(axes)} group "
                            f"{sorted(ranks)} failed or timed out: {first_line(e)}"
                        )
                if isinstance(g, CommError):
                    raise g
                sys.stderr.write(log[0])
                if self.rank in ranks:
                    self._groups[axes] = g

    # ---- arithmetic ----------------------------------------------------------
    def size(self, axes: Iterable[str] | str) -> int:
        return self.grid.size(*_key(axes))

    def index(self, axes: Iterable[str] | str) -> int:
        """This rank's index in its ``axes`` group (first axis fastest)."""
        return self.grid.group_index(self.rank, _key(axes))

    def coord(self, axis: str) -> int:
        return self.grid.coords(self.rank)[axis]

    def _alias(self, axes: tuple[str, ...]) -> tuple[str, ...]:
        """The built axes whose group an expert group's is (the data group when it spans data)."""
        if axes in EXPERT_GROUPS and self.grid.size(*axes) == self.grid.data:
            return ("data",)
        return axes

    def group(self, axes: Iterable[str] | str):
        axes = _key(axes)
        if axes not in self._ranks:
            raise KeyError(f"no process group for axes {axes}; built: {GROUP_AXES}")
        return self._groups.get(self._alias(axes))

    def describe(self, op: str, axes: Sequence[str]) -> str:
        limit = f", timeout {self.timeout_s:g} s" if self.timeout_s else ""
        return (
            f"rank {self.rank}: {op} over axis {'+'.join(axes)} "
            f"(group ranks {list(self._ranks.get(tuple(axes), ()))}, grid {self.grid.spec()}{limit})"
        )

    def _count(self, op: str, axes: tuple[str, ...], t: torch.Tensor) -> int:
        n = t.numel() * t.element_size()
        self.bytes[("+".join(axes), op)] += n
        self.calls[("+".join(axes), op)] += 1
        return n

    def fault_point(self, point: str) -> None:
        """This rank reached ``point`` (:mod:`axo4d.dist.faults`; nothing unless a fault is armed)."""
        if self.faults is not None:
            self.faults.hit(point, self.rank)

    def reset_counters(self) -> None:
        self.bytes.clear()
        self.calls.clear()

    def close(self) -> None:
        """Destroy this Comm's process groups (not the world group) and drop every reference to a
        group, the world's included, so that their threads can end; idempotent."""
        world = dist.group.WORLD if dist.is_initialized() else None
        for g in {id(g): g for g in self._groups.values()}.values():
            if g is not world and dist.is_initialized():
                with contextlib.suppress(Exception):  # already gone with the world group
                    dist.destroy_process_group(g)
        self._groups.clear()
        self._pairs.clear()

    def set_timeout(self, seconds: float) -> None:
        """Timeout of every later collective of this rank (world and this Comm's groups)."""
        if self.grid.world_size > 1 and dist.is_initialized():
            td = datetime.timedelta(seconds=seconds)
            for g in {id(g): g for g in [dist.group.WORLD, *self._groups.values()]}.values():
                dist.distributed_c10d._set_pg_timeout(td, g)
        self.timeout_s = seconds

    @contextlib.contextmanager
    def timeout(self, seconds: float | None) -> Iterator[None]:
        """``with comm.timeout(s):`` collectives inside use ``s`` (None: unchanged), then the previous one."""
        old = self.timeout_s
        if seconds is None or seconds == old:
            yield
            return
        self.set_timeout(seconds)
        try:
            yield
        finally:
            if old is not None:
                self.set_timeout(old)

    def _run(self, op: str, axes: tuple[str, ...], fn, async_op: bool, result: torch.Tensor, nbytes: int, post=None):
        if self.faults is not None and self.faults.hit(f"{op}:{'+'.join(axes)}", self.rank):
            return Handle(None, result, "") if async_op else result  # AXO4D_FAULT=skip:...: not entered
        trace, rec = self.trace, None
        if trace is not None:
            rec = trace.start(self._names.get(axes, "+".join(axes)), op, nbytes)
        try:
            work = fn()
        except Exception as e:
            raise self._failed(f"{self.describe(op, axes)} failed or timed out: {first_line(e)}", rec) from None
        h = Handle(work, result, self.describe(op, axes), post, rec, trace)
        return h if async_op else h.wait()

    def _pair(self, axes: tuple[str, ...], g, t: torch.Tensor) -> tuple[int, int] | None:
        """:func:`axo4d.dist.pairwise.pair_of` ``axes``' group where ``t`` is on the CPU (gloo's)."""
        if t.device.type != "cpu" or self.size(axes) != 2:
            return None
        key = self._alias(axes)
        if key not in self._pairs:
            self._pairs[key] = pairwise.pair_of(g)
        return self._pairs[key]

    # ---- collectives (no autograd) ------------------------------------------
    def all_reduce(self, t: torch.Tensor, axes: Iterable[str] | str, async_op: bool = False, op: str = "sum"):
        """Reduce ``t`` in place over the ``axes`` group (``op``: 'sum' or 'max'); axes with an
        expert sub-axis and others (the norm's ``x, y, z, ep``) reduce over each part in turn."""
        axes = _key(axes)
        if axes not in self._ranks and any(a in ("ep", "edp") for a in axes):
            rest = tuple(a for a in axes if a not in ("ep", "edp"))
            for part in [rest] * bool(rest) + [(a,) for a in axes if a in ("ep", "edp")]:
                t = self.all_reduce(t, part, op=op)
            return Handle(None, t, "") if async_op else t
        g = self.group(axes)
        if g is None:
            return Handle(None, t, "") if async_op else t
        n = self._count("all_reduce", axes, t)
        rop = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op]
        return self._run(
            "all_reduce", axes, lambda: dist.all_reduce(t, op=rop, group=g, async_op=async_op), async_op, t, n
        )

    def all_gather(
        self, t: torch.Tensor, axes: Iterable[str] | str, async_op: bool = False, out: torch.Tensor | None = None
    ):
        """Concatenate the flat ``t`` of every rank of the group (group order), into the flat
        ``out`` when given (``t`` may be this rank's piece of it: nothing is copied then)."""
        axes = _key(axes)
        g = self.group(axes)
        if g is None:
            return Handle(None, t, "") if async_op else t
        t = t.contiguous().reshape(-1)
        if out is None:
            out = torch.empty(t.numel() * self.size(axes), dtype=t.dtype, device=t.device)
        n = self._count("all_gather", axes, out)
        pair = self._pair(axes, g, t)
        if pair is not None:  # two gloo ranks: one exchange in chunks (axo4d.dist.pairwise)
            fn = lambda: pairwise.all_gather(t, out, pair, g, self.timeout_s)  # noqa: E731
            return self._run("all_gather", axes, fn, async_op, out, n)
        if t.device.type == "cpu" and t.untyped_storage().data_ptr() == out.untyped_storage().data_ptr():
            t = t.clone()  # gloo's own all-gather gets an input apart from its output
        return self._run("all_gather", axes, lambda: _all_gather(out, t, group=g, async_op=async_op), async_op, out, n)

    def is_pair(self, axes: Iterable[str] | str, t: torch.Tensor) -> bool:
        """Whether ``axes``' group is two gloo ranks and ``t`` a CPU tensor: :meth:`gather_runs` and
        :meth:`reduce_scatter_runs` apply."""
        axes = _key(axes)
        g = self.group(axes)
        return g is not None and self._pair(axes, g, t) is not None

    def _count_runs(self, op: str, axes: tuple[str, ...], runs: list[torch.Tensor]) -> int:
        n = 2 * sum(r.numel() * r.element_size() for r in runs)  # the gathered flat, the full input
        self.bytes[("+".join(axes), op)] += n
        self.calls[("+".join(axes), op)] += 1
        return n

    def gather_runs(self, mine: list[torch.Tensor], theirs: list[torch.Tensor], axes: Iterable[str] | str) -> Handle:
        """An all-gather over two gloo ranks (:meth:`is_pair`) straight between the tensors that
        hold the pieces (:func:`axo4d.dist.pairwise.exchange_runs`): send the flat runs ``mine``
        (this rank's piece, in order) and receive the peer's piece into the runs ``theirs``; the
        peer cuts both pieces at the same places. The handle's result is an empty tensor."""
        axes = _key(axes)
        g = self.group(axes)
        me, peer = self._pair(axes, g, mine[0])
        n = self._count_runs("all_gather", axes, mine)
        fn = lambda: pairwise.exchange_runs(mine, theirs, peer, g, self.timeout_s)  # noqa: E731
        return self._run("all_gather", axes, fn, True, mine[0].new_empty(0), n)

    def reduce_scatter_runs(self, keep: list[torch.Tensor], send: list[torch.Tensor], axes: Iterable[str] | str):
        """A reduce-scatter over two gloo ranks (:meth:`is_pair`) straight from the tensors that
        hold the addends: send the runs ``send`` (the peer's piece of this rank's addend), and once
        waited for, the handle's result is this rank's piece of the sum, flat: the runs ``keep``
        (this rank's piece of its addend) plus the peer's (:func:`axo4d.dist.pairwise.reduce_scatter_runs`)."""
        axes = _key(axes)
        g = self.group(axes)
        me, peer = self._pair(axes, g, keep[0])
        out = torch.empty(sum(r.numel() for r in keep), dtype=keep[0].dtype)
        n = self._count_runs("reduce_scatter", axes, keep)
        fn = lambda: pairwise.reduce_scatter_runs(keep, send, out, peer, g, self.timeout_s, self.buffers)  # noqa: E731
        return self._run("reduce_scatter", axes, fn, True, out, n)

    def reduce_scatter(self, t: torch.Tensor, axes: Iterable[str] | str, async_op: bool = False):
        """Sum the flat ``t`` over the group; keep this rank's 1/size piece."""
        axes = _key(axes)
        g = self.group(axes)
        if g is None:
            return Handle(None, t.reshape(-1), "") if async_op else t.reshape(-1)
        t = t.contiguous().reshape(-1)
        n = self.size(axes)
        if t.numel() % n:
            raise CommError(f"{self.describe('reduce_scatter', axes)}: {t.numel()} elements not divisible by {n}")
        out = torch.empty(t.numel() // n, dtype=t.dtype, device=t.device)
        n = self._count("reduce_scatter", axes, t)
        pair = self._pair(axes, g, t)
        if pair is not None:  # two gloo ranks: one exchange in chunks, then own half + the peer's
            fn = lambda: pairwise.reduce_scatter(t, out, pair, g, self.timeout_s, self.buffers)  # noqa: E731
            return self._run("reduce_scatter", axes, fn, async_op, out, n)
        return self._run(
            "reduce_scatter", axes, lambda: _reduce_scatter(out, t, group=g, async_op=async_op), async_op, out, n
        )

    def all_to_all(
        self, t: torch.Tensor, axes: Iterable[str] | str, send: Sequence[int], recv: Sequence[int] | None = None
    ) -> tuple[torch.Tensor, list[int]]:
        """Rows ``send[i]`` of ``t`` (in order, dimension 0) to the group's rank ``i``, rows from
        every rank back: ``(received rows in group order, recv)``. ``recv`` (rows from each rank)
        unknown (None): the counts are exchanged first (an all-to-all of ``size`` integers). Blocking;
        bytes counted are this rank's sent rows."""
        axes = _key(axes)
        g, n = self.group(axes), self.size(axes)
        if len(send) != n or sum(send) != t.shape[0]:
            raise CommError(f"{self.describe('all_to_all', axes)}: splits {list(send)} of {t.shape[0]} rows")
        if g is None:
            return t, list(send)
        if recv is None:
            counts = torch.tensor(list(send), dtype=torch.int64, device=t.device)
            got = torch.empty_like(counts)
            nb = self._count("all_to_all", axes, counts)
            self._run("all_to_all", axes, lambda: dist.all_to_all_single(got, counts, group=g), False, got, nb)
            recv = got.tolist()
        t = t.contiguous()
        out = t.new_empty((sum(recv), *t.shape[1:]))
        nb = self._count("all_to_all", axes, t)
        fn = lambda: dist.all_to_all_single(out, t, list(recv), list(send), group=g)  # noqa: E731
        return self._run("all_to_all", axes, fn, False, out, nb), list(recv)
