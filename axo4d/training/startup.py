"""The one start-up path of every command line (training, generation, the memorization study).

:func:`start`: discover the world and initialise ``torch.distributed`` (``parallel.backend``,
start-up timeout ``parallel.init_timeout_s``), let the command line settle what needs the world
(``resolve``: ``--grid auto``, a default grid of ``data=<ranks>``), build the grid and its
communicator (start-up timeout; the fault ``AXO4D_FAULT`` arms, if any; the collective trace of
``parallel.trace_collectives``, :mod:`axo4d.dist.flight`).

:func:`build_model_on`: the model of a run config on a communicator, as training builds it --
its schedule (overlapped or eager, data-parallel buckets of ``parallel.dp_bucket_mb``: 'auto' sized
from the model and grid, :func:`axo4d.facts.schedule_rules.bucket_limit`; sharded
for the sharded optimizer, local buckets for offload, weight caching), the GEMM tuner (none where
compilation takes the layouts), the model, then the features that wrap it (activation
checkpointing, compilation), and the FP8 plan (``train.fp8``: which layers run FP8 GEMMs, checked against the
device and the shapes first: :func:`fp8_plan_for`). Generation and the study build theirs here
too, so every command line runs the same layers with the same settings.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

import torch

from axo4d.config import RunConfig, default_cache_dir
from axo4d.config.errors import ConfigError
from axo4d.dist.bootstrap import init_distributed
from axo4d.dist.comm import Comm
from axo4d.dist.discovery import DistInfo
from axo4d.dist.flight import CollectiveTrace
from axo4d.facts.archs import model_spec
from axo4d.facts.fp8_rule import fp8_layer_names, shape_problems
from axo4d.facts.grid import Grid
from axo4d.facts.schedule_rules import bucket_limit
from axo4d.models import DecoderLM, apply_activation_checkpointing, apply_compile, build_model
from axo4d.nn.blas_tuner import GemmTuner
from axo4d.nn.context import LayerContext
from axo4d.nn.fp8 import Fp8Plan, device_problem, plan
from axo4d.nn.overlap_schedule import make_schedule
from axo4d.nn.seqsplit import resolve_z_split
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


def fp8_rows(cfg: RunConfig, grid: Grid) -> int:
    """Rows of every linear layer's input on one rank and micro-step: ``micro-batch/(G_data*G_z) * seq_len``."""
    t = cfg.train
    return max(1, t.global_batch // max(1, t.grad_accum) * cfg.model.seq_len // grid.size("data", "z"))


def check_fp8_shapes(cfg: RunConfig, grid: Grid) -> None:
    """``train.fp8`` against the shapes on ``grid`` (every FP8 GEMM dimension a multiple of 16):
    one :class:`ConfigError` naming the setting and what would work (no-op when FP8 is off)."""
    if cfg.train.fp8 == "off":
        return
    bad = shape_problems(model_spec(cfg.model, grid), cfg.train.fp8, cfg.train.fp8_layers, fp8_rows(cfg, grid))
    if bad:
        raise ConfigError(bad[0] + (f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""))


def fp8_plan_for(cfg: RunConfig, grid: Grid, device: torch.device) -> Fp8Plan | None:
    """The FP8 plan of ``train.fp8`` / ``train.fp8_layers`` on ``grid`` (:mod:`axo4d.facts.fp8_rule`),
    None when off; :class:`ConfigError` when the device has no FP8 GEMMs or a shape does not divide."""
    t = cfg.train
    if t.fp8 == "off":
        return None
    why = device_problem(device)
    if why:
        raise ConfigError(f"train.fp8={t.fp8}: {why}; set train.fp8=off")
    check_fp8_shapes(cfg, grid)
    return plan(t.fp8, fp8_layer_names(model_spec(cfg.model, grid), t.fp8, t.fp8_layers))


def z_split_of(cfg: RunConfig, grid: Grid) -> tuple[str, str]:
    """``('batch' | 'sequence', why)``: ``parallel.z_split`` resolved for ``cfg``'s micro-batch on ``grid``."""
    micro = max(1, cfg.train.global_batch // max(1, cfg.train.grad_accum))
    return resolve_z_split(cfg.parallel.z_split, micro, grid.size("data"), grid.size("z"), cfg.model.seq_len)


def build_model_on(
    cfg: RunConfig, comm: Comm, device: torch.device, *, seed: int | None, tuner: GemmTuner | None = None
) -> DecoderLM:
    """``cfg``'s model on ``comm``'s grid, on ``device``, as training builds it (module docstring);
    ``seed=None``: zeros, for a caller that loads weights next; ``tuner``: :func:`make_tuner`'s."""
    offload = cfg.train.offload
    schedule = make_schedule(
        comm,
        cfg.parallel.overlap,
        bucket_limit(cfg.parallel.dp_bucket_mb, model_spec(cfg.model, comm.grid)),
        shard=shard_optimizer_on(cfg.parallel, comm.grid),
        local_buckets=offload != "none",
        cache_layers=cache_layers_for(cfg, comm.grid),
    )
    fp8 = fp8_plan_for(cfg, comm.grid, device)
    ctx = LayerContext(comm, schedule, tuner, fp8, z_split_of(cfg, comm.grid)[0])
    model = build_model(cfg.model, ctx, seed=seed).to(device)
    if cfg.train.activation_checkpointing:
        apply_activation_checkpointing(model)
    if cfg.train.compile:
        apply_compile(model)
    return model


__all__ = [
    "World",
    "start",
    "with_grid",
    "make_tuner",
    "build_model_on",
    "fp8_plan_for",
    "check_fp8_shapes",
    "z_split_of",
]
