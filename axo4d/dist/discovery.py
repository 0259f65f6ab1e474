"""Where a rank is before any process group exists: the launcher that started it and the world
it belongs to (:func:`discover`), and the backend it will talk over (:func:`pick_backend`).
:mod:`axo4d.dist.bootstrap` (module docstring: the launchers) uses them to initialise
``torch.distributed``.
"""

from __future__ import annotations

import os
import re
import socket
import time
from dataclasses import dataclass

import torch

from axo4d.config.errors import CommError, LaunchError
from axo4d.dist import faults
from axo4d.dist.heap import NOT_CPU
from axo4d.dist.net import free_port as _free_port

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
    heap: str = NOT_CPU
    """What start-up did to the C library's allocator (:func:`axo4d.dist.heap.keep_freed_memory`)."""


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
