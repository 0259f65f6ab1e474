"""A small discrete-event simulator of one rank: a compute stream and one queue per process group.

The program is what one rank does, in order (:mod:`perfmodel.timeline` writes it):
``Compute(seconds)`` runs on the compute stream; ``Issue(task)`` starts a collective (after the
collectives issued earlier on the same process group: a group runs its collectives one at a time,
like an NCCL communicator's stream or a gloo process group); ``Wait(task)`` stalls the compute
stream until the collective is done -- the stall is that collective's *exposed* time, counted
under its axis.

A collective takes ``latency + work`` seconds as priced alone (ring steps times alpha, and the
bytes over the bandwidth). Resources are shared as a fluid: while a collective is in flight, a
GEMM progresses at ``1/compute_slowdown`` of its speed and the collective at ``1/comm_slowdown``
of its own -- each a number, or per link class of the collective (``{'intra': .., 'inter': ..}``;
with several in flight the compute takes the largest of theirs); a collective in flight with
others of different groups progresses at
``1/(1 + (s_class - 1) * same + (s_mixed - 1) * other)``, ``same`` the others on its class of link
(both inside a node, or both across nodes), ``other`` those on the other class (links that are
separate in hardware share the cores or SMs that drive them). The latency is
not free waiting: a collective in flight holds what it runs on (an NCCL kernel's SMs, a gloo
thread's core) for its whole time, so the measured slowdowns apply to all of it. With every
slowdown 1 the step is the classic "max(compute, comm)"; with slowdowns of 2 (two processes
sharing one core) nothing hides and the step is the sum.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import NamedTuple

EPS = 1e-15


@dataclass(eq=False, slots=True)
class Task:
    """One collective call: ``group`` (its process group), ``axis`` (where its exposed time is
    counted), ``link`` ('intra' or 'inter'), ``latency`` and ``work`` in seconds alone."""

    group: tuple[str, ...]
    axis: str
    link: str
    latency: float
    work: float
    name: str = ""
    done: float | None = None
    _left: float = 0.0


class Compute(NamedTuple):
    """Run ``seconds`` of compute on the compute stream."""

    seconds: float
    tag: str = ""


class Issue(NamedTuple):
    """Start ``task`` (behind the tasks issued earlier on its group)."""

    task: Task


class Wait(NamedTuple):
    """Stall the compute stream until ``task`` is done."""

    task: Task


@dataclass
class Result:
    """``time`` of the whole program; ``compute``: compute seconds as priced alone; ``stalls``:
    seconds the compute stream waited, per axis; ``comm_busy``: seconds some collective was in
    flight; ``contention``: what slowed compute cost (``time - compute - sum(stalls)``)."""

    time: float = 0.0
    compute: float = 0.0
    stalls: dict[str, float] = field(default_factory=dict)
    comm_busy: float = 0.0

    @property
    def contention(self) -> float:
        return max(0.0, self.time - self.compute - sum(self.stalls.values()))


class _Rates:
    """The slowdown settings of :func:`simulate`: the compute stream's rate and each collective's."""

    def __init__(self, compute_slowdown, comm_slowdown, concurrent: dict[str, float] | None) -> None:
        self.conc = concurrent or {}
        self.mixed = self.conc.get("mixed", 1.0)
        self.g_of = compute_slowdown if isinstance(compute_slowdown, dict) else {}
        self.c_of = comm_slowdown if isinstance(comm_slowdown, dict) else {}
        self.g_all = 1.0 if self.g_of else float(compute_slowdown)
        self.c_all = 1.0 if self.c_of else float(comm_slowdown)
        self._alone: dict[str, float] = {}  # per link class: a collective's rate beside compute
        self._extra: dict[str, float] = {}  # per link class: its concurrent slowdown - 1

    def compute(self, active: list[Task], computing: bool) -> float:
        """The compute stream's rate while ``active`` collectives are in flight."""
        if not (computing and active):
            return 1.0
        if not self.g_of:
            return 1.0 / self.g_all
        g_of = self.g_of
        slow = g_of.get(active[0].link, 1.0)
        for x in active[1:]:
            v = g_of.get(x.link, 1.0)
            if v > slow:
                slow = v
        return 1.0 / slow

    def comms(self, active: list[Task], computing: bool) -> list[float]:
        """Each active collective's rate (slowed by compute and by the others in flight)."""
        if computing:
            alone = self._alone
            rates = [alone.get(x.link) or self._alone_rate(x.link) for x in active]
        else:
            rates = [1.0] * len(active)
        n_active = len(active)
        if n_active == 1:
            return rates
        if n_active == 2:  # each has one other: on its class of link or not
            moving = {active[0].link: 2} if active[0].link == active[1].link else {active[0].link: 1, active[1].link: 1}
        else:
            moving = {}
            for x in active:
                moving[x.link] = moving.get(x.link, 0) + 1
        extra, mixed = self._extra, self.mixed - 1.0
        for i, x in enumerate(active):
            same = moving[x.link] - 1
            e = extra.get(x.link)
            if e is None:
                e = extra[x.link] = self.conc.get(x.link, 1.0) - 1.0
            rates[i] /= 1.0 + e * same + mixed * (n_active - 1 - same)
        return rates

    def _alone_rate(self, link: str) -> float:
        r = self._alone[link] = 1.0 / self.c_of.get(link, self.c_all)
        return r


def _start(task: Task, active: list[Task]) -> None:
    task._left = task.latency + task.work
    active.append(task)


def _issue(task: Task, queues: dict[tuple[str, ...], deque], active: list[Task]) -> None:
    """Queue ``task`` behind its group's earlier ones; start it if it is the first."""
    q = queues.get(task.group)
    if q is None:
        q = queues[task.group] = deque()
    q.append(task)
    if len(q) == 1:
        _start(task, active)


def _finish(finished: list[Task], t: float, queues: dict[tuple[str, ...], deque], active: list[Task]) -> None:
    """Mark ``finished`` done at ``t`` and start the next task of each one's group."""
    for x in finished:
        x.done = t
        active.remove(x)
        q = queues[x.group]
        q.popleft()
        if q:
            _start(q[0], active)


def simulate(
    program: list,
    compute_slowdown: float | dict[str, float] = 1.0,
    comm_slowdown: float | dict[str, float] = 1.0,
    concurrent: dict[str, float] | None = None,
) -> Result:
    """Run ``program`` (a list of :class:`Compute`, :class:`Issue`, :class:`Wait`); module docstring."""
    rates_of = _Rates(compute_slowdown, comm_slowdown, concurrent)
    queues: dict[tuple[str, ...], deque] = {}
    active: list[Task] = []
    res = Result()
    t, pc, n = 0.0, 0, len(program)
    comp_left: float | None = None
    stalled: Task | None = None
    stall_from = 0.0
    while True:
        while comp_left is None and stalled is None and pc < n:  # zero-time actions
            a = program[pc]
            kind = type(a)
            if kind is Compute:
                if a.seconds > 0:
                    comp_left = a.seconds
                    res.compute += a.seconds
                pc += 1
            elif kind is Issue:
                _issue(a.task, queues, active)
                pc += 1
            elif a.task.done is not None:
                pc += 1
            else:
                stalled, stall_from = a.task, t
        if comp_left is None and stalled is None:
            break  # end of the program
        if not active and comp_left is None:
            raise RuntimeError(f"the program waits for {stalled.name or stalled.group}, which was never issued")
        t, comp_left = _advance(rates_of, active, comp_left, t, res, queues)
        if stalled is not None and stalled.done is not None:
            res.stalls[stalled.axis] = res.stalls.get(stalled.axis, 0.0) + t - stall_from
            stalled = None
            pc += 1
    res.time = t
    return res


def _advance(
    rates_of: _Rates, active: list[Task], comp_left: float | None, t: float, res: Result, queues: dict
) -> tuple[float, float | None]:
    """Run to the next event (a compute action or a collective done): the new time and compute left."""
    computing = comp_left is not None
    if not active:  # compute alone, at full rate, to its end
        return t + comp_left, None
    if len(active) == 1:  # one collective in flight: the same arithmetic, without the lists
        return _advance_one(rates_of, active, comp_left, t, res, queues)
    comp_rate = rates_of.compute(active, computing)
    rates = rates_of.comms(active, computing)
    dt = comp_left / comp_rate if computing else float("inf")
    for x, r in zip(active, rates):
        if x._left / r < dt:
            dt = x._left / r
    dt = max(dt, 0.0)
    t += dt
    res.comm_busy += dt
    tiny = EPS * max(1.0, t)  # below this, a piece of work is done
    if computing:
        comp_left -= dt * comp_rate
        if comp_left <= tiny:
            comp_left = None
    finished = None
    for x, r in zip(active, rates):
        x._left -= dt * r
        if x._left <= tiny:
            if finished is None:
                finished = [x]
            else:
                finished.append(x)
    if finished is not None:
        _finish(finished, t, queues, active)
    return t, comp_left


def _advance_one(
    rates_of: _Rates, active: list[Task], comp_left: float | None, t: float, res: Result, queues: dict
) -> tuple[float, float | None]:
    """:func:`_advance` with one collective in flight (:meth:`_Rates.compute` and
    :meth:`_Rates.comms` of one task, inlined)."""
    x = active[0]
    if comp_left is None:
        r = 1.0
        dt = x._left / r
    else:
        comp_rate = 1.0 / (rates_of.g_of.get(x.link, 1.0) if rates_of.g_of else rates_of.g_all)
        r = rates_of._alone.get(x.link) or rates_of._alone_rate(x.link)
        dt = comp_left / comp_rate
        if x._left / r < dt:
            dt = x._left / r
    dt = max(dt, 0.0)
    t += dt
    res.comm_busy += dt
    tiny = EPS * max(1.0, t)
    if comp_left is not None:
        comp_left -= dt * comp_rate
        if comp_left <= tiny:
            comp_left = None
    x._left -= dt * r
    if x._left <= tiny:
        _finish([x], t, queues, active)
    return t, comp_left


__all__ = ["Task", "Compute", "Issue", "Wait", "Result", "simulate"]
