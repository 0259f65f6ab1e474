"""How a command line of a multi-rank job ends: exit status, one line of report, shutdown order.

==========  ==================================================================================
status      meaning
==========  ==================================================================================
0           done
1           the run failed: a rank died or hung (:class:`~axo4d.config.errors.CommError`), training
            cannot go on (:class:`~axo4d.config.errors.TrainError`: a non-finite loss, a diverged
            model, a checkpoint that could not be written), or an internal error (traceback)
2           bad input (:data:`~axo4d.config.errors.USER_ERRORS`): config, grid, data, a checkpoint that
            is missing, corrupt or of another model, too little disk space, ``--out`` in use
75          stopped cleanly, resume me: a stop signal (``checkpoint.signals``: SIGUSR1, SIGTERM, SIGHUP;
            or a first Ctrl-C) made every rank finish the same step and save a checkpoint;
            ``--resume auto`` continues (:mod:`axo4d.training.lifecycle`; job scripts requeue on it)
130         interrupted (a second Ctrl-C: stopped at once)
==========  ==================================================================================

An error every rank met alike (``agreed``, :mod:`axo4d.config.errors`) is printed once, by rank 0, and
every rank ends in order: live process groups destroyed before the world group
(:func:`axo4d.dist.bootstrap.shutdown`), then what a normal interpreter exit does that anyone can
see -- non-daemon threads joined, exit handlers, and under ``mpiexec`` ``MPI_Finalize`` on every
rank -- and ``os._exit``, skipping the seconds of tearing down torch's objects (:func:`_finish`);
so the launcher reports the status itself (2, not the 9 of a
rank it had to kill). The other ranks wait :data:`GRACE_S` first, so that rank 0's line is out
before a launcher that stops the job on the first failed rank acts. An error that only some ranks
met (a peer died or hangs) is printed by each rank that met it, which then leaves at once
(``os._exit``), never waiting on peers that may be stuck. A watchdog bounds the orderly end too.
"""

from __future__ import annotations

import argparse
import atexit
import os
import sys
import threading
import time
import traceback
from typing import Callable

from axo4d.config.errors import USER_ERRORS, CommError, ConfigError, TrainError
from axo4d.dist import rankfiles
from axo4d.dist.bootstrap import shutdown
from axo4d.dist.faults import env_rank
from axo4d.training.lifecycle import EXIT_RESUME

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130
__all__ = [
    "EXIT_OK",
    "EXIT_FAILED",
    "EXIT_USAGE",
    "EXIT_INTERRUPTED",
    "EXIT_RESUME",
    "ArgParser",
    "run_and_exit",
    "orderly_exit",
]
#: seconds the ranks other than 0 wait before ending on an agreed error
GRACE_S = 2.0
#: seconds an orderly end may take before the process leaves anyway
SHUTDOWN_WATCHDOG_S = 60.0


class ArgParser(argparse.ArgumentParser):
    """argparse whose errors are a :class:`~axo4d.config.errors.ConfigError` (one line, status 2, printed
    by rank 0 only: every rank of a job parses the same command line), not each rank's usage text."""

    def error(self, message: str):
        raise ConfigError(f"{message} (see: {self.prog} --help)")


def report(prog: str, e: BaseException, code: int) -> bool:
    """Print ``e`` as one line where it belongs; returns whether every rank met it alike."""
    rank, msg = env_rank(), str(e)
    shared = bool(getattr(e, "agreed", False))
    if shared and rank != 0:
        return True
    msg = msg[len(f"rank {rank}: ") :] if msg.startswith(f"rank {rank}: ") else msg
    where = "" if shared else f"[rank {rank}] "
    print(f"{prog}: error: {where}{msg}", file=sys.stderr, flush=True)
    return shared


def orderly_exit(code: int, wait_s: float = 0.0) -> int:
    """End this rank in order (see the module docstring); returns ``code`` for ``sys.exit`` only on
    an interpreter without ``atexit._run_exitfuncs`` (else :func:`_finish` ends the process)."""
    watchdog = threading.Timer(SHUTDOWN_WATCHDOG_S + wait_s, lambda: _leave(code))
    watchdog.daemon = True
    watchdog.start()
    if wait_s:
        time.sleep(wait_s)
    shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    rankfiles.record_exit(code)
    _finish(code)
    return code


def _finish(code: int) -> None:
    """What a normal interpreter exit does that anyone can see, then ``os._exit(code)``: wait for
    non-daemon threads, run the exit handlers (logging, ...), ``MPI_Finalize`` (mpi4py's, which a
    normal exit runs last) -- but not the teardown of every module and object, which for torch's
    takes seconds (docs/faults.md, "The end of a run")."""
    run_exitfuncs = getattr(atexit, "_run_exitfuncs", None)
    if run_exitfuncs is None:
        return
    me = threading.current_thread()
    for t in threading.enumerate():
        if t is not me and not t.daemon:
            t.join()
    run_exitfuncs()
    finalized = _mpi_finalize()
    sys.stdout.flush()
    sys.stderr.flush()
    if finalized:
        _c_exit(code)
    os._exit(code)


def _mpi_finalize() -> bool:
    """``MPI_Finalize`` (mpi4py's, unless its ``rc.finalize`` is off); whether MPI is now finalized."""
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is None or not mpi.Is_initialized():
        return False
    if sys.modules["mpi4py"].rc.finalize is not False and not mpi.Is_finalized():
        mpi.Finalize()
    return bool(mpi.Is_finalized())


def _c_exit(code: int) -> None:
    """The C library's ``exit(code)``: its exit handlers and the shared libraries' destructors run,
    the interpreter's teardown does not. MPICH 5 ends its PMI connection to Hydra's proxy there,
    after ``MPI_Finalize``: ``os._exit`` closed the connection unannounced, and the proxy took that
    for a dead rank and SIGKILLed every rank of the node still alive -- ``mpiexec`` then exited 9
    ("BAD TERMINATION") after a run that had finished (docs/faults.md, "The end of a run").
    Called through ``PyDLL``, which keeps the GIL: no other Python thread runs meanwhile."""
    import ctypes

    ctypes.PyDLL(None).exit(code)


def whole_lines(stream) -> None:
    """Each line printed to ``stream`` (a text stream) reaches its file in one write: a piped
    ``sys.stderr`` writes through, so ``print`` wrote the text and its newline apart, and a rank
    killed between the two left half a line that the next line (another rank's, the launcher's)
    was glued to."""
    if getattr(stream, "write_through", False) and hasattr(stream, "reconfigure"):
        stream.reconfigure(line_buffering=True, write_through=False)


def run_and_exit(run: Callable[[list[str] | None], int], argv: list[str] | None, prog: str) -> int:
    """Call ``run(argv)`` and turn its outcome into an exit status (module docstring)."""
    rankfiles.register()  # for launch.local under mpiexec: this rank's pid (axo4d.dist.rankfiles)
    whole_lines(sys.stderr)
    try:
        code = run(argv)
        return orderly_exit(code)
    except USER_ERRORS as e:
        code, shared = EXIT_USAGE, report(prog, e, EXIT_USAGE)
    except (CommError, TrainError) as e:
        code, shared = EXIT_FAILED, report(prog, e, EXIT_FAILED)
    except KeyboardInterrupt:
        code, shared = EXIT_INTERRUPTED, False
    except Exception:
        print(f"{prog}: internal error on rank {env_rank()}:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        code, shared = EXIT_FAILED, False
    if shared:
        return orderly_exit(code, GRACE_S if env_rank() != 0 else 0.0)
    sys.stdout.flush()
    sys.stderr.flush()
    _leave(code)  # do not wait on peers that may be stuck in a collective
    return code  # not reached


def _leave(code: int) -> None:
    """``os._exit(code)``, recorded first for the launcher (:mod:`axo4d.dist.rankfiles`)."""
    rankfiles.record_exit(code)
    os._exit(code)
