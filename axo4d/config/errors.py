"""Every error axo4d raises on purpose, in one place.

Two families:

* **user errors** (:data:`USER_ERRORS`): bad input that every rank meets alike -- a config key,
  a grid that does not fit the model, a missing file, an unusable checkpoint. Command lines print
  them as one line and exit with status 2.
* **run failures**: a collective that failed or timed out (:class:`CommError`), training that
  cannot go on (:class:`TrainError`), a checkpoint that could not be written
  (:class:`CheckpointWriteError`). Exit status 1, with the rank named.

All derive from :class:`Axo4dError`, so ``except Axo4dError`` catches exactly what axo4d meant
to raise. An error's ``agreed`` says whether every rank met it alike (bad input every rank reads,
or a decision shared by a collective): command lines report those once, from rank 0, and end
every rank in order; the others each rank reports itself (docs/faults.md).
"""

from __future__ import annotations


class Axo4dError(Exception):
    """Base class of every error axo4d raises on purpose."""

    agreed: bool = False
    """True when every rank raised this same error (set on an instance after a collective shared it)."""


def agreed(e: Axo4dError) -> Axo4dError:
    """Mark ``e`` as met by every rank alike (see :attr:`Axo4dError.agreed`); returns it."""
    e.agreed = True
    return e


class ConfigError(Axo4dError, ValueError):
    """A configuration key, value or file that cannot be used."""

    agreed = True


class GridError(Axo4dError, ValueError):
    """A grid spec, size or order that cannot be used, or a model/batch that does not divide by it."""

    agreed = True


class DataError(Axo4dError, ValueError):
    """A dataset, token file or tokenizer that cannot be used."""

    agreed = True


class CheckpointError(Axo4dError, ValueError):
    """A checkpoint (or model folder) that cannot be found, read or used by this run."""

    agreed = True


class MemoryBudgetError(Axo4dError, ValueError):
    """A run the memory model predicts not to fit the device (or host) memory it may use: every
    rank predicts alike (budgets agreed by a collective), before anything is allocated."""

    agreed = True


class LaunchError(Axo4dError, RuntimeError):
    """The world cannot be discovered or the process group cannot start."""


class CommError(Axo4dError, RuntimeError):
    """A collective failed or timed out."""


class TrainError(Axo4dError, RuntimeError):
    """Training cannot go on (for example a non-finite loss)."""


class CheckpointWriteError(TrainError):
    """Saving a checkpoint failed on this rank (disk full, I/O error ...)."""


#: errors that every rank meets identically: reported once, exit status 2
USER_ERRORS: tuple[type[Exception], ...] = (
    ConfigError,
    GridError,
    DataError,
    LaunchError,
    CheckpointError,
    MemoryBudgetError,
)

__all__ = [
    "Axo4dError",
    "agreed",
    "ConfigError",
    "GridError",
    "DataError",
    "CheckpointError",
    "MemoryBudgetError",
    "LaunchError",
    "CommError",
    "TrainError",
    "CheckpointWriteError",
    "USER_ERRORS",
]
