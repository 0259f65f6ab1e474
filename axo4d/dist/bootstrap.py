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
"""
from __future__ import annotations

import datetime
import os
import re
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist

from axo4d.dist.net import free_port as _free_port
from axo4d.errors import LaunchError

_MPI_ENV = ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "MPI_LOCALRANKID", "MV2_COMM_WORLD_RANK")
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
    return WorldInfo(_int_env(env, "RANK"), ws, _int_env(env, "LOCAL_RANK", 0),
                     _int_env(env, "LOCAL_WORLD_SIZE", ws), env.get("MASTER_ADDR", "127.0.0.1"),
                     _int_env(env, "MASTER_PORT", 29500), "env")


def _from_slurm(env: dict) -> WorldInfo:
    ws = _int_env(env, "SLURM_NTASKS")
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_NODELIST") or env.get("SLURM_JOB_NODELIST")
    if not nodelist:
        raise LaunchError("SLURM_NODELIST is missing: cannot find rank 0's host")
    port = _int_env(env, "MASTER_PORT", 0) or 20000 + _int_env(env, "SLURM_JOB_ID", 0) % 20000
    tasks_per_node = env.get("SLURM_NTASKS_PER_NODE", "").split("(")[0]
    local_ws = int(tasks_per_node) if tasks_per_node.isdigit() else ws
    return WorldInfo(_int_env(env, "SLURM_PROCID"), ws, _int_env(env, "SLURM_LOCALID", 0), local_ws,
                     env.get("MASTER_ADDR", first_host(nodelist)), port, "slurm")


def _from_mpi() -> WorldInfo:
    try:
        from mpi4py import MPI
    except Exception as e:  # ImportError, or a broken MPI library
        raise LaunchError(
            f"MPI launch requested but mpi4py/MPI is not usable ({type(e).__name__}: {e}); "
            "install it with `pip install mpi4py mpich` or launch with torchrun/srun") from None
    comm = MPI.COMM_WORLD
    local = comm.Split_type(MPI.COMM_TYPE_SHARED)
    addr_port = (_host_address(), int(os.environ.get("MASTER_PORT", 0)) or _free_port()) \
        if comm.Get_rank() == 0 else None
    addr, port = comm.bcast(addr_port, root=0)
    info = WorldInfo(comm.Get_rank(), comm.Get_size(), local.Get_rank(), local.Get_size(), addr, port, "mpi")
    local.Free()
    return info


def discover(launcher: str = "auto", env: dict | None = None) -> WorldInfo:
    """Find rank, size, local rank and rank 0's address for ``launcher``."""
    env = dict(os.environ) if env is None else env
    if launcher not in LAUNCHERS:
        raise LaunchError(f"unknown launcher {launcher!r}; valid: {', '.join(LAUNCHERS)}")
    kind = detect_launcher(env) if launcher == "auto" else launcher
    if kind == "env":
        return _from_env(env)
    if kind == "mpi":
        return _from_mpi()
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


def init_distributed(backend: str = "auto", timeout_s: float = 300.0, launcher: str = "auto") -> DistInfo:
    """Discover the world and initialise ``torch.distributed`` (idempotent).

    Also sets the CUDA device to the local rank when CUDA is present.
    """
    backend = os.environ.get("AXO4D_BACKEND", backend)
    w = discover(launcher)
    be = pick_backend(backend)
    if torch.cuda.is_available():
        device = torch.device("cuda", w.local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():
        kwargs = dict(backend=be, timeout=datetime.timedelta(seconds=timeout_s))
        if be != "mpi":
            kwargs.update(init_method=f"tcp://{w.master_addr}:{w.master_port}", rank=w.rank,
                          world_size=w.world_size)
        try:
            dist.init_process_group(**kwargs)
        except Exception as e:
            raise LaunchError(f"rank {w.rank}: cannot initialise torch.distributed ({be}) at "
                              f"{w.master_addr}:{w.master_port}: {e}") from None
    return DistInfo(dist.get_rank(), dist.get_world_size(), w.local_rank, w.local_world_size,
                    device, be, w.launcher)


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
