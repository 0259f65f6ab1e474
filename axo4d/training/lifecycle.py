"""The life of a training job around its steps: signals, the step boundary, stopping to be resumed.

A job on a supercomputer ends by walltime, announced by a signal (Slurm's ``--signal=B:USR1@T``,
then SIGTERM before the kill), by a person (Ctrl-C, ``scancel``) or by a failure
(docs/design.md section 12). :class:`StopSignals` catches the signals of ``checkpoint.signals``
(default SIGUSR1, SIGTERM and SIGHUP -- a dropped SSH session ends the run like a
walltime signal, saved) and SIGINT on any rank: the handler only notes the signal (it runs
between two Python bytecodes of the main thread; a signal during a save lets that save finish).
A second SIGINT raises :class:`KeyboardInterrupt` at once (exit status 130).

At every step boundary :func:`at_boundary` runs **one all-reduce of one int64 (max) over the
world group**: each rank contributes whether it caught a signal (and which), and whether its
background checkpoint save failed (:mod:`axo4d.training.checkpointing.background`). Every rank gets
the same answer at the same step, so all stop at the same step: they save a checkpoint and leave
with :data:`EXIT_RESUME` (75, ``EX_TEMPFAIL``: "stopped cleanly, resume me"; the job script then
requeues itself and the next job continues with ``--resume auto``). Its cost per step is one
latency of an 8-byte all-reduce (tens of microseconds on a GPU network; ``python -m
bench.async_checkpoint`` prints the step time with it), and no host synchronisation the step
does not already make (it reads its loss).
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass

from axo4d.config import signal_names
from axo4d.config.errors import TrainError
from axo4d.dist.comm import Comm

#: exit status of a run that stopped cleanly on a signal and saved: resume it (sysexits' EX_TEMPFAIL)
EXIT_RESUME = 75
_FAILED = 1 << 40
_SIG_SHIFT = 24


@dataclass(frozen=True)
class Stop:
    """Why the ranks agreed to stop at a boundary."""

    signum: int
    rank: int
    """A rank that caught it (the highest one that caught the highest signal number)."""

    @property
    def name(self) -> str:
        try:
            return signal.Signals(self.signum).name
        except ValueError:
            return f"signal {self.signum}"


class StopSignals:
    """Note the stop signals this rank receives (module docstring); ``install`` in the main thread."""

    def __init__(self, names: str, rank: int = 0) -> None:
        self.signals = [getattr(signal, n) for n in signal_names(names)]
        self.rank = rank
        self.signum, self.at, self.interrupts = 0, 0.0, 0
        self._old: dict = {}

    def install(self) -> StopSignals:
        for s in {*self.signals, signal.SIGINT}:
            self._old[s] = signal.signal(s, self._handle)
        return self

    def uninstall(self) -> None:
        for s, h in self._old.items():
            signal.signal(s, h)
        self._old.clear()

    def _handle(self, signum: int, frame) -> None:
        if signum == signal.SIGINT:
            self.interrupts += 1
            if self.interrupts >= 2:
                raise KeyboardInterrupt
        if not self.signum:
            self.signum, self.at = signum, time.time()
            if self.rank != 0:  # one line per job, not per rank (launchers signal every rank)
                return
            note = "; Ctrl-C again stops at once" if signum == signal.SIGINT else ""
            os.write(
                2,
                f"axo4d: [rank {self.rank}] {signal.Signals(signum).name}: finishing this step, then saving a "
                f"checkpoint and stopping{note}\n".encode(),
            )


def encode(signum: int, rank: int, failed: bool) -> int:
    """One rank's word at the boundary: a failed background save above any signal, then the signal
    number, then the rank (so the all-reduce's max names one rank that has it)."""
    return (_FAILED if failed else 0) | (signum << _SIG_SHIFT) | (rank + 1)


def decode(v: int) -> tuple[bool, int, int]:
    """(a background save failed, signal number, rank) of an agreed word."""
    return bool(v & _FAILED), (v & (_FAILED - 1)) >> _SIG_SHIFT, (v & ((1 << _SIG_SHIFT) - 1)) - 1


def at_boundary(comm: Comm, signals: StopSignals | None, ckpt) -> Stop | None:
    """The ranks' agreement after a step (collective, module docstring): raises the failure of a
    background save on every rank alike; returns a :class:`Stop` when some rank caught a signal."""
    failed = ckpt is not None and ckpt.failed()
    word = comm.max_over_world(encode(signals.signum if signals else 0, comm.rank, failed))
    bad, signum, rank = decode(word)
    if bad:
        if ckpt is not None:
            ckpt.wait()  # raises this rank's failure (every rank's, when the ranks agreed on it)
        raise TrainError(f"the background checkpoint save failed on rank {rank} (its error is in that rank's log)")
    return Stop(signum, rank) if signum else None


__all__ = ["EXIT_RESUME", "Stop", "StopSignals", "at_boundary", "encode", "decode"]
