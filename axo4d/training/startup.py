"""The one start-up path of every command line (training, generation, the memorization study).

:func:`start`: discover the world and initialise ``torch.distributed`` (``parallel.backend``,
start-up timeout ``parallel.init_timeout_s``), let the command line settle what needs the world
(``resolve``: ``--grid auto``, a default grid of ``data=<ranks>``), build the grid and its
communicator (start-up timeout; the fault ``AXO4D_FAULT`` arms, if any; the collective trace of
``parallel.trace_collectives``, :mod:`axo4d.dist.trace`).

:func:`build_model_on`: the model of a run config on a communicator, as training builds it --
its schedule (overlapped or eager, data-parallel buckets of ``parallel.dp_bucket_mb``, sharded
for the sharded optimizer, local buckets for offload, weight caching), the GEMM tuner (none where
compilation takes the layouts), the model, then the features that wrap it (activation
checkpointing, compilation). Generation and the study build theirs here too, so every command
line runs the same layers with the same settings.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

import torch

from axo4d.config import RunConfig, default_cache_dir
from axo4d.dist.bootstrap import DistInfo, init_distributed
from axo4d.dist.comm import Comm
from axo4d.dist.grid import Grid
from axo4d.dist.trace import CollectiveTrace
from axo4d.models import DecoderLM, apply_activation_checkpointing, apply_compile, build_model
from axo4d.nn.context import LayerContext
from axo4d.nn.schedule import make_schedule
from axo4d.nn.tuner import GemmTuner
from axo4d.nn.weight_cache import cache_layers_for
from axo4d.training.optim.sharded import shard_optimizer_on


@dataclass(frozen=True)
class World:
    """This rank of a started job: the resolved config, the process, and the grid's communicator."""

    cfg: RunConfig
    info: DistInfo
    comm: Comm

    @property
    def rank(self) -> int:
        return self.info.rank

    @property
    def device(self) -> torch.device:
        return self.info.device

    @property
    def grid(self) -> Grid:
        return self.comm.grid


def start(
    cfg: RunConfig, launcher: str = "auto", resolve: Callable[[RunConfig, DistInfo], RunConfig] | None = None
) -> World:
    """Bootstrap, then (``resolve``) settle what needs the world, then the grid and its
    communicator with the start-up timeout (module docstring). Collective."""
    info = init_distributed(cfg.parallel.backend, cfg.parallel.init_timeout_s, launcher)
    if resolve is not None:
        cfg = resolve(cfg, info)
    grid = Grid.parse(cfg.parallel.grid, cfg.parallel.order)
    grid.check_world(info.world_size)
    n = cfg.parallel.trace_collectives
    trace = CollectiveTrace(info.rank, info.world_size, n, grid.spec()) if n > 0 and info.world_size > 1 else None
    comm = Comm(grid, info.rank, timeout_s=cfg.parallel.init_timeout_s, faults=info.faults, trace=trace)
    return World(cfg, info, comm)


def with_grid(cfg: RunConfig, spec: str) -> RunConfig:
    """``cfg`` with ``parallel.grid = spec``."""
    return dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, grid=spec))


def make_tuner(cfg: RunConfig, comm: Comm) -> GemmTuner | None:
    """The GEMM layout tuner when ``parallel.tuner`` is on (cache: ``parallel.tuner_cache``, else
    ``<data cache dir>/blas_tuner.json``); none when the model is compiled on a grid whose x, y
    and z are of one rank (every layer is then ``F.linear`` and the compiler picks the layouts)."""
    g = comm.grid
    if not cfg.parallel.tuner or (cfg.train.compile and g.x == g.y == g.z == 1):
        return None
    path = cfg.parallel.tuner_cache or default_cache_dir(cfg.data) / "blas_tuner.json"
    return GemmTuner(comm, path)


def build_model_on(
    cfg: RunConfig, comm: Comm, device: torch.device, *, seed: int | None, tuner: GemmTuner | None = None
) -> DecoderLM:
    """``cfg``'s model on ``comm``'s grid, on ``device``, as training builds it (module docstring);
    ``seed=None``: zeros, for a caller that loads weights next; ``tuner``: :func:`make_tuner`'s."""
    offload = cfg.train.offload
    schedule = make_schedule(
        comm,
        cfg.parallel.overlap,
        cfg.parallel.dp_bucket_mb,
        shard=shard_optimizer_on(cfg.parallel, comm.grid),
        local_buckets=offload != "none",
        cache_layers=cache_layers_for(cfg, comm.grid),
    )
    model = build_model(cfg.model, LayerContext(comm, schedule, tuner), seed=seed).to(device)
    if cfg.train.activation_checkpointing:
        apply_activation_checkpointing(model)
    if cfg.train.compile:
        apply_compile(model)
    return model


__all__ = ["World", "start", "with_grid", "make_tuner", "build_model_on"]
