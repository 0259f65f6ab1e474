"""``python -m axo4d.train --grid auto``: the performance model picks this job's grid.

:func:`plan_run` runs on every rank after ``torch.distributed`` is up and before the model is
built. With ``--grid auto`` it ranks every grid (and rank order) of the job's world size, ranks
per node, model, batch and every setting the trainer obeys (:func:`perfmodel.run_settings.settings_of`:
accumulation, recomputation, dtype, optimizer mode, FP8, z split; :func:`perfmodel.model.rank_grids`
with ``order='search'``), prints the best three with their predicted step times on rank 0, and
returns the config with the first one, its rank order, z split and expert group (for a mixture of
experts the ranking chooses ``parallel.expert`` too). perfmodel refuses the grids the trainer's
start-up refuses (the same rules: :func:`axo4d.facts.run.fp8_of` for FP8), and the start-up checks
the chosen grid again (:func:`axo4d.train_args.check_run_config`). ``parallel.cache_weights=auto`` becomes the number of
blocks the memory model fits on the chosen grid. The machine is ``parallel.machine`` (a bundled
name or a machine YAML) or, when that is empty, a short profile of this job's own groups taken
now (:func:`startup_profile`: the collectives of the world's group shapes within two nodes, the
local GEMM shapes of the candidate grids, attention and streaming rates; a few seconds).

Rank 0 decides and broadcasts the decision, so every rank builds the same grid.
"""

from __future__ import annotations

import dataclasses
import statistics
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from axo4d.config import RunConfig
from axo4d.config.errors import ConfigError, GridError
from axo4d.facts.grid import Grid
from perfmodel.machine import Machine, MachineError, load_machine
from perfmodel.model import Estimate, estimate_auto, rank_grids
from perfmodel.run_settings import dtypes_of, settings_of
from perfmodel.startup_profile import startup_profile

TOP = 3


@dataclass
class Plan:
    """The decision: ``grid`` (with its order), the estimate of the run as configured, the ranked
    estimates shown, and where the machine came from."""

    grid: Grid
    estimate: Estimate
    top: list[Estimate]
    machine: Machine
    source: str
    n_feasible: int = 0

    def banner(self, world: int, gpn: int, batch: int) -> str:
        lines = [
            f"grid auto: {self.n_feasible} feasible grid(s) of {world} ranks ({gpn} per node), batch {batch}; "
            f"perfmodel with {self.source}; best {len(self.top)}:"
        ]
        for i, e in enumerate(self.top):
            lines.append(
                f"  {i + 1}. {e.grid.spec():28s} order {','.join(e.grid.order):12s} "
                f"{e.step_time_s:.4g} s/step predicted (compute {e.compute_s:.3g} s, exposed "
                f"communication {e.exposed_comm_s:.3g} s, {e.memory_bytes['total'] / 2**30:.2f} GiB)"
                + ("  [tie: within the model's uncertainty of the best]" if e.tie and i else "")
            )
        e = self.estimate
        lines.append(f"using {self.grid.spec()} order {','.join(self.grid.order)}")
        also = ([f"z splits the {e.z_split}"] if self.grid.z > 1 else []) + (
            [f"expert groups of {e.expert} ranks (parallel.expert={e.expert})"] if e.expert > 1 else []
        )
        if also:
            lines.append("  with " + "; ".join(also))
        return "\n".join(lines)


def machine_for(cfg: RunConfig, info: Any, log: Callable[[str], None]) -> tuple[Machine, str]:
    """``parallel.machine``, else a start-up profile of this job."""
    if cfg.parallel.machine:
        try:
            m = load_machine(cfg.parallel.machine)
        except MachineError as e:
            raise ConfigError(f"parallel.machine: {e}") from None
        return m, f"machine {m.name!r}"
    return (
        startup_profile(info.world_size, info.rank, info.local_world_size, info.device, cfg, log),
        "a start-up profile of this job (no parallel.machine)",
    )


def _gpn(machine: Machine, local: int, log: Callable[[str], None]) -> int:
    if local > machine.gpus_per_node:
        log(
            f"note: this job runs {local} ranks per node but machine {machine.name!r} has "
            f"{machine.gpus_per_node}; predicting with {machine.gpus_per_node} per node"
        )
        return machine.gpus_per_node
    return max(1, local)


def run_config_on(cfg: RunConfig, e: Estimate, cache_weights: str | None = None) -> RunConfig:
    """``cfg`` on the grid of ``e``: its sizes, rank order, z split and expert group (and
    ``cache_weights`` when given), what the trainer then builds."""
    par = dataclasses.replace(
        cfg.parallel,
        grid=e.grid.spec(),
        order=",".join(e.grid.order),
        z_split=e.z_split,
        expert=e.expert,
        cache_weights=cfg.parallel.cache_weights if cache_weights is None else cache_weights,
    )
    return dataclasses.replace(cfg, parallel=par)


def choose(cfg: RunConfig, world: int, gpn: int, machine: Machine, device_type: str, source: str) -> Plan:
    """Rank every grid and order of ``world`` ranks for ``cfg`` (module docstring)."""
    ests = rank_grids(
        cfg.model,
        world,
        gpn,
        cfg.train.global_batch,
        machine,
        checkpointing=cfg.train.activation_checkpointing,
        order="search",
        **settings_of(cfg, device_type),
    )
    feas = [e for e in ests if e.feasible]
    if not feas:
        why = "; ".join(sorted({e.reason for e in ests[:3]}))
        raise GridError(
            f"--grid auto: no grid of {world} ranks fits model {cfg.name} with batch "
            f"{cfg.train.global_batch} (grad_accum {cfg.train.grad_accum}): {why}"
        )
    return Plan(feas[0].grid, feas[0], feas[:TOP], machine, source, len(feas))


def _estimate_on(cfg: RunConfig, grid: Grid, machine: Machine, gpn: int, cache_weights: str, dev: str) -> Estimate:
    """The estimate of ``cfg`` on ``grid`` with ``cache_weights`` (and the config's expert group)."""
    kw = {**settings_of(cfg, dev), "cache_weights": cache_weights}
    return estimate_auto(
        cfg.model,
        grid,
        cfg.train.global_batch,
        machine,
        cfg.train.activation_checkpointing,
        gpus_per_node=gpn,
        expert=cfg.parallel.expert,
        **kw,
    )


def _decide(
    cfg: RunConfig, world: int, gpn: int, machine: Machine, dev: str, source: str, say: Callable[[str], None]
) -> tuple[Any, ...]:
    """Rank 0's decision ``(the parallel config to build, error)`` for :func:`plan_run`: the grid, rank
    order, z split, expert group and cached blocks chosen (or the config's own where not 'auto')."""
    auto_grid = cfg.parallel.grid.strip().lower() == "auto"
    auto_cache = cfg.parallel.cache_weights.strip().lower() == "auto"
    try:
        if auto_grid:
            plan = choose(cfg, world, gpn, machine, dev, source)
            say(plan.banner(world, gpn, cfg.train.global_batch))
        else:
            grid = Grid.parse(cfg.parallel.grid, cfg.parallel.order, cfg.parallel.expert)
            e = _estimate_on(cfg, grid, machine, gpn, cfg.parallel.cache_weights, dev)
            plan = Plan(grid, e, [e], machine, source, 1)
        cache = str(plan.estimate.cached_blocks) if auto_cache else cfg.parallel.cache_weights
        if auto_cache:
            say(
                f"cache_weights auto: {cache} block(s) (and the LM head) keep their gathered weights "
                f"({plan.estimate.memory_bytes.get('weight_cache', 0.0) / 2**30:.2f} GiB predicted)"
            )
        return (run_config_on(cfg, plan.estimate, cache).parallel, None)
    except (ConfigError, GridError, MachineError, ValueError) as e:
        return (None, f"{type(e).__name__}: {e}")


def plan_run(cfg: RunConfig, info: Any, log: Callable[[str], None] = print) -> tuple[RunConfig, Plan | None]:
    """Resolve ``--grid auto`` and ``parallel.cache_weights=auto`` (every rank; rank 0 decides and
    prints); returns the config to build and the plan (its estimate is the predicted step)."""
    import torch.distributed as dist

    say = log if info.rank == 0 else (lambda s: None)
    auto_grid = cfg.parallel.grid.strip().lower() == "auto"
    auto_cache = cfg.parallel.cache_weights.strip().lower() == "auto"
    if not (auto_grid or auto_cache or cfg.parallel.machine):
        return cfg, None
    machine, source = machine_for(cfg, info, say)
    gpn = _gpn(machine, info.local_world_size, say)
    dev = info.device.type
    decision: list[Any] = [None]
    if info.rank == 0:
        decision[0] = _decide(cfg, info.world_size, gpn, machine, dev, source, say)
    if info.world_size > 1:
        dist.broadcast_object_list(decision, src=0)
    par, err = decision[0]
    if err is not None:
        raise (GridError if err.startswith("GridError") else ConfigError)(err.split(": ", 1)[1])
    new = dataclasses.replace(cfg, parallel=par)
    grid = Grid.parse(par.grid, par.order, par.expert)
    e = _estimate_on(new, grid, machine, gpn, par.cache_weights, dev)
    return new, Plan(grid, e, [e], machine, source, 1)


WARMUP_STEPS = 1
"""Steps left out of the measured step time: the first compiles, tunes and warms the caches."""


def measured_line(plan: Plan, step_times_s: Sequence[float]) -> str:
    """The median measured step time after the :data:`WARMUP_STEPS` warm-up step(s) beside the
    prediction (the warm-up step alone is not a step time: it says so)."""
    p = plan.estimate.step_time_s
    steady = list(step_times_s[WARMUP_STEPS:])
    if not steady:
        return (
            f"step time: predicted {p:.4g} s; not measured: only {len(step_times_s)} warm-up step(s) ran "
            f"(the median of the steps after the first {WARMUP_STEPS} is compared; {plan.source})"
        )
    m = statistics.median(steady)
    return (
        f"step time: measured {m:.4g} s (median of {len(steady)} step(s) after {WARMUP_STEPS} warm-up), "
        f"predicted {p:.4g} s (measured/predicted {m / p:.2f}; {plan.source})"
    )


__all__ = ["Plan", "plan_run", "choose", "machine_for", "measured_line", "WARMUP_STEPS", "dtypes_of", "run_config_on"]
