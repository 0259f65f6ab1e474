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
(:mod:`axo4d.dist.threads`).
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import os
import re
import signal
import socket
import sys
import tempfile
import time
import weakref
from dataclasses import dataclass
from typing import Iterator

import torch
import torch.distributed as dist

from axo4d.config.errors import CommError, LaunchError
from axo4d.dist import faults
from axo4d.dist.net import free_port as _free_port
from axo4d.dist.threads import set_default_threads

_MPI_ENV = ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "MPI_LOCALRANKID", "MV2_COMM_WORLD_RANK")
#: (local rank, local size) variables of MPICH/Hydra, Open MPI, MVAPICH and Slurm: read instead of a
#: blocking communicator split, so that a hung rank 0 cannot block start-up without a timeout
_MPI_LOCAL_ENV = (
    ("MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
    ("OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"),
    ("MV2_COMM_WORLD_LOCAL_RANK", "MV2_COMM_WORLD_LOCAL_SIZE"),
    ("SLURM_LOCALID", "SLURM_NTASKS_PER_NODE"),
)
_ADDR_BYTES = 256
#: objects with a ``close()`` that must run before the world group is destroyed (every live Comm)
_closables: weakref.WeakSet = weakref.WeakSet()
#: seconds between a start-up watchdog's line and its kill (so that every rank's line is out)
_WATCHDOG_GRACE_S = 10.0
LAUNCHERS = ("auto", "env", "mpi", "slurm", "single")
BACKENDS = ("auto", "nccl", "gloo", "mpi")


@dataclass(frozen=True)
class WorldInfo:
    """Where this rank is, before any process group exists."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int
    launcher: str


@dataclass(frozen=True)
class DistInfo:
    """This rank once ``torch.distributed`` is initialised."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device
    backend: str
    launcher: str
    faults: faults.Faults | None = None
    """The fault ``AXO4D_FAULT`` arms (tests), handed to the job's :class:`~axo4d.dist.comm.Comm`."""


def detect_launcher(env: dict | None = None) -> str:
    env = os.environ if env is None else env
    if "RANK" in env and "WORLD_SIZE" in env:
        return "env"
    if any(k in env for k in _MPI_ENV):
        return "mpi"
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        return "slurm"
    return "single"


def first_host(nodelist: str) -> str:
    """First host of a Slurm hostlist: ``'nid[001-004,010],gpu7'`` -> ``'nid001'``."""
    m = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist.strip())
    if not m:
        raise LaunchError(f"cannot parse SLURM_NODELIST {nodelist!r}")
    prefix, ranges = m.group(1), m.group(2)
    if not ranges:
        return prefix
    return prefix + ranges.split(",")[0].split("-")[0]


def _host_address() -> str:
    if "MASTER_ADDR" in os.environ:
        return os.environ["MASTER_ADDR"]
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def _int_env(env: dict, key: str, default: int | None = None) -> int:
    """``int(env[key])``; ``default`` when absent (required when ``default`` is None)."""
    if key not in env and default is not None:
        return default
    try:
        return int(env[key])
    except KeyError:
        raise LaunchError(f"environment variable {key} is missing (needed by this launcher)") from None
    except ValueError:
        raise LaunchError(f"environment variable {key}={env[key]!r} is not an integer") from None


def _from_env(env: dict) -> WorldInfo:
    ws = _int_env(env, "WORLD_SIZE")
    return WorldInfo(
        _int_env(env, "RANK"),
        ws,
        _int_env(env, "LOCAL_RANK", 0),
        _int_env(env, "LOCAL_WORLD_SIZE", ws),
        env.get("MASTER_ADDR", "127.0.0.1"),
        _int_env(env, "MASTER_PORT", 29500),
        "env",
    )


def _from_slurm(env: dict) -> WorldInfo:
    ws = _int_env(env, "SLURM_NTASKS")
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_NODELIST") or env.get("SLURM_JOB_NODELIST")
    if not nodelist:
        raise LaunchError("SLURM_NODELIST is missing: cannot find rank 0's host")
    port = _int_env(env, "MASTER_PORT", 0) or 20000 + _int_env(env, "SLURM_JOB_ID", 0) % 20000
    tasks_per_node = env.get("SLURM_NTASKS_PER_NODE", "").split("(")[0]
    local_ws = int(tasks_per_node) if tasks_per_node.isdigit() else ws
    return WorldInfo(
        _int_env(env, "SLURM_PROCID"),
        ws,
        _int_env(env, "SLURM_LOCALID", 0),
        local_ws,
        env.get("MASTER_ADDR", first_host(nodelist)),
        port,
        "slurm",
    )


def _mpi_local(comm) -> tuple[int, int]:
    """(local rank, ranks on this node): from the MPI library's environment, else a shared-memory split."""
    for k_rank, k_size in _MPI_LOCAL_ENV:
        r, n = os.environ.get(k_rank, ""), os.environ.get(k_size, "").split("(")[0]
        if r.isdigit() and n.isdigit():
            return int(r), int(n)
    from mpi4py import MPI

    local = comm.Split_type(MPI.COMM_TYPE_SHARED)
    out = (local.Get_rank(), local.Get_size())
    local.Free()
    return out


def _mpi_bcast_address(comm, timeout_s: float) -> tuple[str, int]:
    """Rank 0's address and a free port, broadcast without blocking past ``timeout_s``."""
    import numpy as np

    buf = np.zeros(_ADDR_BYTES, np.uint8)
    if comm.Get_rank() == 0:
        text = f"{_host_address()} {int(os.environ.get('MASTER_PORT', 0)) or _free_port()}".encode()
        buf[: len(text)] = np.frombuffer(text, np.uint8)
    req, deadline = comm.Ibcast(buf, root=0), time.monotonic() + timeout_s
    while not req.Test():
        if time.monotonic() > deadline:
            raise CommError(
                f"rank {comm.Get_rank()}: start-up: rank 0 did not send its address over MPI within "
                f"parallel.init_timeout_s={timeout_s:g} s (rank 0 dead, hung or still busy)"
            )
        time.sleep(0.01)
    addr, port = bytes(buf).rstrip(b"\0").decode().split()
    return addr, int(port)


def _from_mpi(timeout_s: float = 600.0) -> WorldInfo:
    try:
        from mpi4py import MPI
    except Exception as e:  # ImportError, or a broken MPI library
        raise LaunchError(
            f"MPI launch requested but mpi4py/MPI is not usable ({type(e).__name__}: {e}); "
            "install it with `pip install mpi4py mpich` or launch with torchrun/srun"
        ) from None
    comm = MPI.COMM_WORLD
    local_rank, local_size = _mpi_local(comm)
    addr, port = _mpi_bcast_address(comm, timeout_s)
    return WorldInfo(comm.Get_rank(), comm.Get_size(), local_rank, local_size, addr, port, "mpi")


def discover(launcher: str = "auto", env: dict | None = None, timeout_s: float = 600.0) -> WorldInfo:
    """Find rank, size, local rank and rank 0's address for ``launcher`` (MPI: within ``timeout_s``)."""
    env = dict(os.environ) if env is None else env
    if launcher not in LAUNCHERS:
        raise LaunchError(f"unknown launcher {launcher!r}; valid: {', '.join(LAUNCHERS)}")
    kind = detect_launcher(env) if launcher == "auto" else launcher
    if kind == "env":
        return _from_env(env)
    if kind == "mpi":
        return _from_mpi(timeout_s)
    if kind == "slurm":
        return _from_slurm(env)
    return WorldInfo(0, 1, 0, 1, "127.0.0.1", _free_port(), "single")


def pick_backend(backend: str = "auto") -> str:
    if backend not in BACKENDS:
        raise LaunchError(f"unknown backend {backend!r}; valid: {', '.join(BACKENDS)}")
    if backend == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl" and not torch.cuda.is_available():
        raise LaunchError("backend 'nccl' needs CUDA GPUs but none is visible; use --set parallel.backend=gloo")
    return backend


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
    node's cores unless ``OMP_NUM_THREADS`` is set.
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
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():  # its store gives up by itself (after about 2.5 x timeout_s)
        _init_process_group(w, be, timeout_s)
    return DistInfo(
        dist.get_rank(), dist.get_world_size(), w.local_rank, w.local_world_size, device, be, w.launcher, armed
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
    Safe to call when nothing is initialised.
    """
    for obj in list(_closables):
        try:
            obj.close()
        except Exception:
            pass
    gc.collect()
    if dist.is_initialized():
        dist.destroy_process_group()
    gc.collect()
