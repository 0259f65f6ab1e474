"""Discover the world a rank lives in and initialise ``torch.distributed``.

Supported launchers (``launcher='auto'`` picks the first that applies):

* ``env``   -- torchrun-style: ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``
  (and ``MASTER_PORT``);
* ``mpi``   -- ``mpiexec``/``mpirun``/``srun --mpi``: rank and size from
  ``MPI.COMM_WORLD``, local rank from a shared-memory split, rank 0's address
  and a free port broadcast over MPI;
* ``slurm`` -- ``srun`` without MPI: ``SLURM_PROCID``, ``SLURM_NTASKS``,
  ``SLURM_LOCALID``, the first host of ``SLURM_NODELIST``;
* ``single`` -- none of the above: one process.

Start-up has its own timeout (``parallel.init_timeout_s``), longer than the one of training
collectives (:meth:`axo4d.dist.comm.Comm.set_timeout`). When rank 0 is dead, hung or unreachable at
start-up, every other rank fails with one line (:class:`~axo4d.config.errors.CommError`) once that
timeout has passed; the native log lines of the failed attempt are not printed unless
``TORCH_CPP_LOG_LEVEL`` or ``TORCH_DISTRIBUTED_DEBUG`` is set. :func:`shutdown` ends in an order
that leaves no communication thread alive when the interpreter exits. Each rank's intra-op thread
count, unless ``OMP_NUM_THREADS`` says it, is its share of the node's cores
(:mod:`axo4d.dist.threads`); a CPU rank keeps the host memory it frees for its next step
(:mod:`axo4d.dist.heap`). Finding the world and the backend: :mod:`axo4d.dist.discovery`.
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import os
import signal
import sys
import tempfile
import time
import weakref
from typing import Iterator

import torch
import torch.distributed as dist

from axo4d.config.errors import CommError, LaunchError
from axo4d.dist import faults
from axo4d.dist.discovery import DistInfo, WorldInfo, detect_launcher, discover, pick_backend
from axo4d.dist.heap import NOT_CPU, keep_freed_memory
from axo4d.dist.threads import set_default_threads

#: objects with a ``close()`` that must run before the world group is destroyed (every live Comm)
_closables: weakref.WeakSet = weakref.WeakSet()
#: seconds between a start-up watchdog's line and its kill (so that every rank's line is out)
_WATCHDOG_GRACE_S = 10.0


@contextlib.contextmanager
def native_stderr_captured() -> Iterator[list[str]]:
    """Send what native code writes to stderr (c10d's log lines and C++ frames) to a temporary
    file; the yielded list holds it afterwards. The caller replays it or drops it."""
    sys.stderr.flush()
    saved, out = os.dup(2), []
    with tempfile.TemporaryFile(mode="w+b") as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield out
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            out.append(tmp.read().decode(errors="replace"))


class _StartupWatchdog:
    """Ends this rank with one line when MPI start-up blocks past ``timeout_s`` (+5 s): ``MPI_Init``
    waits without a timeout for a rank 0 that hangs, holding the GIL, so no Python thread could
    act. A forked child waits, prints the line and kills this process; closing the pipe (or this
    process ending) cancels it. Forked before ``MPI_Init``, never after.

    The deadline counts from the process's start (the same moment on every rank, whatever their
    import times), and the kill comes :data:`_WATCHDOG_GRACE_S` after the line: the launcher stops
    the whole job at the first rank that dies, so every rank prints before any dies."""

    def __init__(self, timeout_s: float, stage: str) -> None:
        rank, parent = faults.env_rank(), os.getpid()
        wait = max(timeout_s + 5.0 - _process_age(), min(timeout_s, 30.0))
        read, self.write = os.pipe()
        sys.stderr.flush()
        self.child = os.fork()
        if self.child == 0:  # the watchdog: os-level calls only, never returns
            os.close(self.write)
            _watch(read, parent, rank, timeout_s, stage, wait)
        os.close(read)

    def cancel(self) -> None:
        os.close(self.write)
        os.waitpid(self.child, 0)


def _watch(read: int, parent: int, rank: int, timeout_s: float, stage: str, wait: float) -> None:
    import select

    def wait_for(seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if select.select([read], [], [], min(1.0, max(0.0, deadline - time.monotonic())))[0]:
                os._exit(0)  # the pipe closed: cancelled, or the rank ended
            if os.getppid() != parent:
                os._exit(0)

    wait_for(wait)
    who = "another rank" if rank == 0 else "rank 0 or another rank"
    os.write(
        2,
        (
            f"axo4d: error: [rank {rank}] start-up: {stage} did not finish within parallel.init_timeout_s="
            f"{timeout_s:g} s ({who} dead, hung or unreachable); stopping this rank\n"
        ).encode(),
    )
    wait_for(_WATCHDOG_GRACE_S)
    os.kill(parent, signal.SIGKILL)
    os._exit(0)


def _process_age() -> float:
    """Seconds since this process started (Linux /proc; 0 elsewhere)."""
    try:
        start_ticks = int(open("/proc/self/stat").read().rsplit(")", 1)[1].split()[19])
        uptime = float(open("/proc/uptime").read().split()[0])
        return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return 0.0


def _mpi_started() -> bool:
    mod = sys.modules.get("mpi4py.MPI")
    return mod is not None and bool(mod.Is_initialized())


def _native_log_wanted() -> bool:
    return bool(os.environ.get("TORCH_CPP_LOG_LEVEL") or os.environ.get("TORCH_DISTRIBUTED_DEBUG"))


def first_line(e: BaseException) -> str:
    """The first line of an exception's message (native errors append C++ frames)."""
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def _start_error(w: WorldInfo, be: str, timeout_s: float, e: BaseException) -> Exception:
    why = first_line(e)
    if "time" in why.lower():
        who = (
            f"not every one of the {w.world_size} ranks joined"
            if w.rank == 0
            else f"no answer from rank 0 at {w.master_addr}:{w.master_port}"
        )
        return CommError(
            f"rank {w.rank}: start-up: {who} within parallel.init_timeout_s={timeout_s:g} s "
            f"({'a rank' if w.rank == 0 else 'rank 0'} dead, hung or unreachable): {why}"
        )
    return LaunchError(
        f"rank {w.rank}: cannot initialise torch.distributed ({be}) at {w.master_addr}:{w.master_port}: {why}"
    )


def init_distributed(backend: str = "auto", timeout_s: float = 600.0, launcher: str = "auto") -> DistInfo:
    """Discover the world and initialise ``torch.distributed`` (idempotent).

    ``timeout_s`` bounds start-up (``parallel.init_timeout_s``) and is the process group's
    timeout until :meth:`axo4d.dist.comm.Comm.set_timeout` changes it. Also sets the CUDA device
    to the local rank when CUDA is present, and the intra-op threads to this rank's share of the
    node's cores unless ``OMP_NUM_THREADS`` is set, and on a CPU rank glibc's allocator to keep
    freed memory (:func:`axo4d.dist.heap.keep_freed_memory`).
    """
    backend = os.environ.get("AXO4D_BACKEND", backend)
    armed = faults.armed()
    if armed is not None:
        armed.hit("start", faults.env_rank())
    mpi = (detect_launcher() if launcher == "auto" else launcher) == "mpi" and not _mpi_started()
    dog = _StartupWatchdog(timeout_s, "MPI start-up (MPI_Init, rank 0's address)") if mpi else None
    try:
        w = discover(launcher, timeout_s=timeout_s)
    finally:
        if dog is not None:
            dog.cancel()
    be = pick_backend(backend)
    set_default_threads(w.local_world_size)
    if torch.cuda.is_available():
        device = torch.device("cuda", w.local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
        heap = NOT_CPU
    else:
        device = torch.device("cpu")
        heap = keep_freed_memory()
    if not dist.is_initialized():  # its store gives up by itself (after about 2.5 x timeout_s)
        _init_process_group(w, be, timeout_s)
    return DistInfo(
        dist.get_rank(), dist.get_world_size(), w.local_rank, w.local_world_size, device, be, w.launcher, armed, heap
    )


def _init_process_group(w: WorldInfo, be: str, timeout_s: float) -> None:
    """``init_process_group`` with one clear error; native log lines only on success (or on request)."""
    kwargs = dict(backend=be, timeout=datetime.timedelta(seconds=timeout_s))
    if be != "mpi":
        kwargs.update(init_method=f"tcp://{w.master_addr}:{w.master_port}", rank=w.rank, world_size=w.world_size)
    err = None
    with native_stderr_captured() as log:
        try:
            dist.init_process_group(**kwargs)
        except Exception as e:
            err = _start_error(w, be, timeout_s, e)
    if err is None or _native_log_wanted():
        sys.stderr.write(log[0])
    if err is not None:
        raise err


def register_closable(obj) -> None:
    """Have :func:`shutdown` call ``obj.close()`` before it destroys the world group (held weakly)."""
    _closables.add(obj)


def shutdown() -> None:
    """End ``torch.distributed`` so that no communication thread outlives the interpreter.

    ``destroy_process_group()`` alone stops nothing while Python objects (a Comm, a model
    holding one) still refer to the groups: gloo's worker threads then end during interpreter
    shutdown, and one that frees a finished work object there aborts the process ("terminate
    called without an active exception"). So: close every live Comm (destroying its groups and
    dropping them), collect what refers to them in cycles, destroy the world group, collect again.
    Safe to call when nothing is initialised, and then immediate (a collection costs a few tenths
    of a second in a process holding torch's modules, paid by every rejected command line).
    """
    if not _closables and not dist.is_initialized():
        return
    for obj in list(_closables):
        try:
            obj.close()
        except Exception:
            pass
    gc.collect()
    if dist.is_initialized():
        dist.destroy_process_group()
    gc.collect()
