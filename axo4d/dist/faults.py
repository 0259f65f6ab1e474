"""Fault injection for tests: one rank dies, hangs, skips a collective, meets a full disk or
receives a signal at a named point.

    AXO4D_FAULT=ACTION:POINT:RANK[:N]        (in the environment of every rank)

``ACTION`` is ``kill`` (the rank SIGKILLs itself: a dead rank), ``stop`` (SIGSTOP: a hung rank),
``skip`` (a collective point only: the rank does not enter that collective, as a rank on a wrong
code path would not), ``enospc`` (raise ``OSError(ENOSPC)``, as a full disk would), or ``usr1``,
``term``, ``int`` (the rank sends itself SIGUSR1, SIGTERM or SIGINT there and goes on: a signal
arriving at exactly that moment); ``RANK`` the global rank it happens on; ``N`` the how-many-th
time that rank reaches ``POINT`` (default 1). Points:

=====================  ==========================================================================
``start``              before the process group exists (:func:`axo4d.dist.bootstrap.init_distributed`)
``<op>:<axes>``        a collective of :class:`axo4d.dist.comm.Comm`, e.g. ``all_reduce:data`` (the
                       data-parallel reduction), ``all_gather:z``, ``broadcast_object:world``,
                       ``all_reduce:world`` (the step boundary's agreement, once per step)
``stage``              a checkpoint save, after this rank copied its state for writing
``save``               a checkpoint save, after this rank wrote its shards, before ``COMPLETE`` (in
                       the background writer with ``checkpoint.async``)
``finalize``           rank 0's checkpoint finalisation, after ``COMPLETE``, before the rename
``load``               a resume, before this rank reads its shards
=====================  ==========================================================================

The variable is read once, at start-up (:func:`armed`): without it there is no :class:`Faults`
object at all, and a :class:`~axo4d.dist.comm.Comm` built without one does nothing more per
collective than test that its ``faults`` is ``None``.
"""

from __future__ import annotations

import errno
import os
import signal
from collections import Counter
from dataclasses import dataclass, field

from axo4d.config.errors import ConfigError

ACTIONS = ("kill", "stop", "skip", "enospc", "usr1", "term", "int")
_SIGNALS = {"usr1": signal.SIGUSR1, "term": signal.SIGTERM, "int": signal.SIGINT}


@dataclass
class Faults:
    """One armed fault: ``action`` at the ``n``-th time rank ``rank`` reaches ``point``."""

    action: str
    point: str
    rank: int
    n: int = 1
    counts: Counter = field(default_factory=Counter)

    @classmethod
    def parse(cls, raw: str) -> Faults:
        parts = raw.split(":")
        # the point may hold one colon itself ('all_reduce:data')
        if len(parts) in (4, 5) and not parts[2].lstrip("-").isdigit():
            parts = [parts[0], f"{parts[1]}:{parts[2]}", *parts[3:]]
        try:
            action, point, rank = parts[0], parts[1], int(parts[2])
            n = int(parts[3]) if len(parts) > 3 else 1
        except (IndexError, ValueError):
            raise ConfigError(
                f"AXO4D_FAULT={raw!r} must look like ACTION:POINT:RANK[:N], e.g. kill:all_reduce:data:1 or stop:start:0"
            ) from None
        if action not in ACTIONS or len(parts) > 4:
            raise ConfigError(f"AXO4D_FAULT={raw!r}: action {action!r}; valid: {', '.join(ACTIONS)}")
        return cls(action, point, rank, n)

    def hit(self, point: str, rank: int) -> bool:
        """``point`` reached on ``rank``: do what the fault asks there, if anything; True when the
        caller is to skip the collective (``skip``)."""
        if point != self.point or rank != self.rank:
            return False
        self.counts[point] += 1
        if self.counts[point] != self.n:
            return False
        if self.action == "enospc":
            raise OSError(errno.ENOSPC, f"No space left on device (AXO4D_FAULT at {point})")
        did = {"kill": "killed", "stop": "stopped", "skip": "skips the collective"}.get(self.action)
        print(f"AXO4D_FAULT: rank {rank} {did or 'sent SIG' + self.action.upper()} at {point}", flush=True)
        if self.action == "skip":
            return True
        sig = _SIGNALS.get(self.action) or (signal.SIGKILL if self.action == "kill" else signal.SIGSTOP)
        os.kill(os.getpid(), sig)
        return False


_ARMED: dict[str, Faults | None] = {}


def armed() -> Faults | None:
    """The fault ``AXO4D_FAULT`` arms in this process (one object per value, so its counts run
    across every Comm of the process), or ``None``."""
    raw = os.environ.get("AXO4D_FAULT", "")
    if raw not in _ARMED:
        _ARMED[raw] = Faults.parse(raw) if raw else None
    return _ARMED[raw]


def env_rank() -> int:
    """This process's rank from the launcher's environment (before any process group exists)."""
    for k in ("RANK", "PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "SLURM_PROCID"):
        v = os.environ.get(k, "")
        if v.isdigit():
            return int(v)
    return 0


__all__ = ["Faults", "armed", "env_rank", "ACTIONS"]
