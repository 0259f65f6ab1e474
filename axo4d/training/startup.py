"""The one start-up path of every command line (training, generation, the memorization study).

:func:`start`: discover the world and initialise ``torch.distributed`` (``parallel.backend``,
start-up timeout ``parallel.init_timeout_s``), let the command line settle what needs the world
(``resolve``: ``--grid auto``, a default grid of ``data=<ranks>``), build the grid and its
communicator (start-up timeout; the fault ``AXO4D_FAULT`` arms, if any; the collective trace of
``parallel.trace_collectives``, :mod:`axo4d.dist.flight`). On a grid with ``G_x > G_y > 1`` whose x
groups cross nodes the model may run with x and y exchanged (:func:`axo4d.facts.run.derive.run_grid`:
the same ranks in every group, fewer tensor-axis bytes); ``World.asked`` keeps the grid of the config.

:func:`build_model_on`: the model of a run config on a communicator, as training builds it --
its schedule (overlapped or eager, the run plan's data-parallel buckets, sharded for the sharded
optimizer, local buckets for offload, the weight cache's layers: :class:`axo4d.facts.run.RunFacts`),
the GEMM tuner (none where compilation takes the layouts), the model, then the features that wrap it
(activation checkpointing, compilation), and the FP8 plan (``train.fp8``: the run plan's FP8 layers,
checked against the device first: :func:`fp8_plan_for`). Generation and the study build theirs here
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
from axo4d.facts.fp8_rule import shape_problems
from axo4d.facts.grid import Grid
from axo4d.facts.run import RunFacts, derive, fp8_rows, micro_batch, resolve_z_split, run_grid
from axo4d.models import DecoderLM, apply_activation_checkpointing, apply_compile, build_model
from axo4d.models.moe import apply_expert_gemm
from axo4d.nn.blas_tuner import GemmTuner
from axo4d.nn.context import LayerContext
from axo4d.nn.fp8_plan import Fp8Plan, device_problem, plan
from axo4d.nn.overlap_schedule import make_schedule


@dataclass(frozen=True)
class World:
    """This rank of a started job: the resolved config, the process, and the grid's communicator."""

    cfg: RunConfig
    info: DistInfo
    comm: Comm
    asked: Grid | None = None
    """The grid of ``parallel.grid``; ``comm.grid`` is it, or it with x and y exchanged
    (:func:`axo4d.facts.run.derive.run_grid`)."""

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
    asked = Grid.parse(cfg.parallel.grid, cfg.parallel.order, cfg.parallel.expert)
    asked.check_world(info.world_size)
    grid = run_grid(cfg.model, asked, info.local_world_size)  # x and y exchanged where that sends fewer bytes
    n = cfg.parallel.trace_collectives
    trace = CollectiveTrace(info.rank, info.world_size, n, grid.spec()) if n > 0 and info.world_size > 1 else None
    comm = Comm(grid, info.rank, timeout_s=cfg.parallel.init_timeout_s, faults=info.faults, trace=trace)
    return World(cfg, info, comm, asked)


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


def check_fp8_shapes(cfg: RunConfig, grid: Grid) -> None:
    """``train.fp8`` against the shapes on ``grid`` (every FP8 GEMM dimension a multiple of 16):
    one :class:`ConfigError` naming the setting and what would work (no-op when FP8 is off)."""
    if cfg.train.fp8 == "off":
        return
    t = cfg.train
    rows = fp8_rows(micro_batch(t.global_batch, t.grad_accum), cfg.model.seq_len, grid)
    bad = shape_problems(model_spec(cfg.model, grid), t.fp8, t.fp8_layers, rows)
    if bad:
        raise ConfigError(bad[0] + (f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""))


def fp8_plan_for(cfg: RunConfig, facts: RunFacts, device: torch.device) -> Fp8Plan | None:
    """The FP8 plan of ``train.fp8`` over the run plan's FP8 layers (checked against the shapes
    there), None when off; :class:`ConfigError` when the device has no FP8 GEMMs."""
    t = cfg.train
    if t.fp8 == "off":
        return None
    why = device_problem(device)
    if why:
        raise ConfigError(f"train.fp8={t.fp8}: {why}; set train.fp8=off")
    return plan(t.fp8, facts.fp8_layers)


def z_split_of(cfg: RunConfig, grid: Grid) -> tuple[str, str]:
    """``('batch' | 'sequence', why)``: ``parallel.z_split`` resolved for ``cfg``'s micro-batch on ``grid``."""
    micro = micro_batch(cfg.train.global_batch, cfg.train.grad_accum)
    return resolve_z_split(cfg.parallel.z_split, micro, grid.size("data"), grid.size("z"), cfg.model.seq_len)


def build_model_on(
    cfg: RunConfig,
    comm: Comm,
    device: torch.device,
    *,
    seed: int | None,
    tuner: GemmTuner | None = None,
    facts: RunFacts | None = None,
) -> DecoderLM:
    """``cfg``'s model on ``comm``'s grid, on ``device``, as training builds it (module docstring);
    ``seed=None``: zeros, for a caller that loads weights next; ``tuner``: :func:`make_tuner`'s;
    ``facts``: the run plan's derived numbers (derived here when not given, without the training
    batch's check: generation and the study build models on grids of their own)."""
    f = derive(cfg, comm.grid, batch=False) if facts is None else facts
    schedule = make_schedule(
        comm,
        cfg.parallel.overlap,
        f.bucket_limit,
        shard=f.shard_optimizer,
        local_buckets=cfg.train.offload != "none",
        cache_layers=f.cache_layers,
    )
    ctx = LayerContext(comm, schedule, tuner, fp8_plan_for(cfg, f, device), f.z_split)
    model = build_model(cfg.model, ctx, seed=seed, spec=f.spec).to(device)
    apply_expert_gemm(model, cfg.train.expert_gemm)  # MoE: grouped expert GEMMs where the experts are whole
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
