"""Planning a job script (:mod:`launch.job`): the request, its checks, and the grid with the perf
model's prediction.

With ``--grid auto`` the grid is chosen exactly as ``python -m perfmodel rank`` ranks them
(:func:`perfmodel.model.rank_grids` with the rank order searched and the z split searched,
``z_split='auto'``, unless the config or ``--set`` fixes them); the chosen ``parallel.z_split`` and
``parallel.order`` are written into the job's ``--set`` options, so the run trains on the grid
that was priced. The run's derived numbers on that grid (micro-batch and accumulation, z split,
optimizer mode, bucket limits, FP8 layers) are :func:`axo4d.facts.run.derive`'s, the function the
trainer's start-up calls: the job prints what the run will do, and warns when the trainer would
refuse the grid.
"""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from axo4d.config import ConfigError, ParallelConfig, RunConfig, load_config, parse_overrides
from axo4d.facts.grid import Grid, GridError
from axo4d.facts.run import RunFacts, derive
from launch.walltime import warning_time

LAUNCHERS = ("slurm", "mpirun")
_SAFE_PATH = re.compile(r"[A-Za-z0-9._/+=,@%-]+")
#: ``--set`` keys whose value is a path: made absolute when it names something here, so the job
#: finds it whatever its working directory
_PATH_KEYS = ("data.source", "data.val_source", "data.tokenizer", "data.cache_dir")


class JobError(ValueError):
    """A job that cannot be generated; the message says why and what would work."""


@dataclass(frozen=True)
class JobRequest:
    """What the user asked for (the command-line options of ``launch.job``)."""

    machine: str
    model: str
    nodes: int
    grid: str = "auto"
    batch: int | None = None
    launcher: str = "slurm"
    time: str = "00:30:00"
    account: str | None = None
    sets: tuple[str, ...] = ()
    run_dir: str | None = None
    job_name: str | None = None
    command: str = ""
    init_from: str | None = None
    """A Hugging Face folder or axo4d checkpoint to fine-tune from (``axo4d.train --init-from``)."""
    run_root: str | None = None
    """The folder under which the run folder goes (default: the machine's scratch file system)."""


@dataclass
class JobPlan:
    """A resolved job: machine, model, grid and the perf model's prediction for it."""

    request: JobRequest
    machine: Any
    model_cfg: Any
    config_arg: str
    grid: Grid
    global_batch: int
    checkpointing: bool
    sets: tuple[str, ...]
    estimate: Any = None
    runners_up: list = field(default_factory=list)
    n_grids: int = 0
    n_feasible: int = 0
    warnings: list[str] = field(default_factory=list)
    perf_kw: dict = field(default_factory=dict)
    expert: int = 1
    """``parallel.expert`` as configured (a ranking of grids chooses its own for a mixture of experts)."""
    signal: tuple[int, str] = (0, "")
    """Seconds before the time limit Slurm signals the job, and how they were found (:mod:`launch.walltime`)."""
    init_arg: str | None = None
    """``--init-from`` as the job passes it (an absolute path)."""
    facts: RunFacts | None = None
    """The run's derived numbers on :attr:`grid` (:func:`axo4d.facts.run.derive`, as ``axo4d.train``
    derives them at start-up); None when the trainer would refuse the grid (then a warning says why)."""

    @property
    def gpus_per_node(self) -> int:
        return self.machine.gpus_per_node

    @property
    def ntasks(self) -> int:
        return self.request.nodes * self.machine.gpus_per_node

    @property
    def job_name(self) -> str:
        m = self.request.model
        model = Path(m).stem if m.endswith((".yaml", ".yml")) else Path(m).name
        return self.request.job_name or f"axo4d-{model}-{self.request.nodes}n"


def _load_machine(name: str) -> Any:
    try:
        from perfmodel.machine import MachineError, load_machine
    except ImportError as e:  # pragma: no cover - perfmodel is part of this repo
        raise JobError(f"the performance model (perfmodel) cannot be imported: {e}") from None
    try:
        return load_machine(name)
    except MachineError as e:
        raise JobError(str(e)) from None


def _config_arg(model: str) -> str:
    """Named configs stay names; YAML paths become absolute so the job finds them."""
    p = Path(model)
    return str(p.resolve()) if (p.suffix in (".yaml", ".yml") or os.sep in model) else model


def _absolute_sets(sets: tuple[str, ...]) -> tuple[str, ...]:
    """``--set data.source=corpus.jsonl`` with the path made absolute when it exists here."""
    out = []
    for s in sets:
        key, _, value = s.partition("=")
        if key.strip() in _PATH_KEYS and value and Path(value).exists() and not Path(value).is_absolute():
            s = f"{key}={Path(value).resolve()}"
        out.append(s)
    return tuple(out)


def _check_request(req: JobRequest) -> None:
    if req.nodes < 1:
        raise JobError(f"--nodes {req.nodes}: a job needs at least 1 node")
    if req.launcher not in LAUNCHERS:
        raise JobError(f"unknown launcher {req.launcher!r}; valid: {', '.join(LAUNCHERS)}")
    if req.batch is not None and req.batch < 1:
        raise JobError(f"--batch {req.batch}: the global batch must be >= 1 sample")
    if not re.fullmatch(r"(\d+-)?\d{1,3}:\d{2}:\d{2}", req.time):
        raise JobError(f"--time {req.time!r}: expected HH:MM:SS or D-HH:MM:SS, e.g. 01:30:00")
    for flag, value in (("--run-dir", req.run_dir), ("--run-root", req.run_root), ("--init-from", req.init_from)):
        if value is not None and not _SAFE_PATH.fullmatch(value):
            raise JobError(f"{flag} {value!r}: use letters, digits and ._/+=,@%- only")
    if req.job_name is not None and not re.fullmatch(r"[A-Za-z0-9._-]+", req.job_name):
        raise JobError(f"--job-name {req.job_name!r}: use letters, digits and ._- only")
    if req.init_from is not None and not Path(req.init_from).exists():
        raise JobError(
            f"--init-from {req.init_from!r} does not exist (give a Hugging Face model folder or an axo4d "
            f"checkpoint on a file system the job's nodes see)"
        )


def _run_config(req: JobRequest, sets: tuple[str, ...]) -> RunConfig:
    """The config the job will train with (the model of ``--init-from`` included)."""
    try:
        cfg = load_config(req.model, list(sets))
        if req.init_from is not None:
            from axo4d.training.init_from import config_with_init

            cfg = config_with_init(cfg, req.init_from, list(sets), req.model)
    except ConfigError as e:
        raise JobError(str(e)) from None
    except (OSError, ValueError) as e:  # a checkpoint or Hugging Face folder that cannot be read
        raise JobError(f"--init-from {req.init_from!r}: {e}") from None
    return cfg


def _searched(cfg: RunConfig, sets: tuple[str, ...]) -> dict[str, Any]:
    """What the grid search decides: the rank order and the z split, unless fixed by the config
    (a value other than the default) or by ``--set``."""
    given = parse_overrides(list(sets)).get("parallel", {})
    default = ParallelConfig()
    out: dict[str, Any] = {}
    if "order" not in given and cfg.parallel.order == default.order:
        out["order"] = "search"
    if "z_split" not in given and cfg.parallel.z_split == default.z_split:
        out["z_split"] = "auto"
    return out


def plan_job(req: JobRequest) -> JobPlan:
    """Resolve machine, model and grid; estimate the step with the perf model."""
    _check_request(req)
    machine = _load_machine(req.machine)
    sets = _absolute_sets(tuple(req.sets)) + ((f"train.global_batch={req.batch}",) if req.batch is not None else ())
    cfg = _run_config(req, sets)
    gpus = req.nodes * machine.gpus_per_node
    ckpt = (
        cfg.train.activation_checkpointing
        if "activation_checkpointing" in parse_overrides(list(sets)).get("train", {})
        else None
    )
    plan = JobPlan(
        req,
        machine,
        cfg.model,
        _config_arg(req.model),
        Grid(data=gpus, order=cfg.parallel.order),
        cfg.train.global_batch,
        bool(ckpt),
        sets,
        init_arg=None if req.init_from is None else str(Path(req.init_from).resolve()),
    )
    plan.perf_kw, plan.expert = _perf_kw(cfg), cfg.parallel.expert
    if req.grid == "auto":
        _choose_grid(plan, ckpt, _searched(cfg, sets))
    else:
        _explicit_grid(plan, ckpt)
    if ckpt is None:
        plan.sets += (f"train.activation_checkpointing={str(plan.checkpointing).lower()}",)
    _derive_facts(plan, cfg)
    plan.signal = warning_time(cfg.model, req.nodes, machine, plan.estimate, req.run_dir)
    limit = _seconds(req.time)
    if req.launcher == "slurm" and limit <= 2 * plan.signal[0]:
        plan.warnings.append(
            f"--time {req.time} leaves {max(0, limit - plan.signal[0])} s of training before the warning signal "
            f"({plan.signal[0]} s before the end, to save and requeue); ask for more time"
        )
    return plan


def _derive_facts(plan: JobPlan, cfg: RunConfig) -> None:
    """``plan.facts``: ``cfg`` on the chosen grid with the z split that was priced, derived as the
    trainer's start-up derives it; a warning naming the reason when the trainer would refuse it."""
    run_cfg = dataclasses.replace(
        cfg, parallel=dataclasses.replace(cfg.parallel, z_split=plan.perf_kw.get("z_split", cfg.parallel.z_split))
    )
    try:
        plan.facts = derive(run_cfg, plan.grid)
    except (ConfigError, GridError) as e:
        plan.warnings.append(f"axo4d.train will refuse this run at start-up: {e}")


def _perf_kw(cfg: RunConfig) -> dict[str, Any]:
    """The perf model's settings of this run on the machine's GPUs: what ``--grid auto`` prices in
    the trainer (:func:`perfmodel.run_settings.settings_of`, the same function; bf16 compute under
    ``train.dtype=auto``, fused attention)."""
    from perfmodel.run_settings import settings_of

    return settings_of(cfg, "cuda")


def _seconds(hms: str) -> int:
    """``[D-]HH:MM:SS`` in seconds."""
    days, _, rest = hms.rpartition("-")
    h, m, sec = (int(x) for x in rest.split(":"))
    return (int(days) if days else 0) * 86400 + h * 3600 + m * 60 + sec


def _choose_grid(plan: JobPlan, ckpt: bool | None, searched: dict[str, Any]) -> None:
    """The best feasible grid of :func:`perfmodel.model.rank_grids` (the ranking ``perfmodel rank``
    prints), with ``searched`` order and z split; their chosen values go into ``plan.sets``."""
    from perfmodel.model import rank_grids

    req, m = plan.request, plan.machine
    kw = {**plan.perf_kw, **({"z_split": searched["z_split"]} if "z_split" in searched else {})}
    ranked = rank_grids(
        plan.model_cfg,
        plan.ntasks,
        m.gpus_per_node,
        plan.global_batch,
        m,
        checkpointing=ckpt,
        order=searched.get("order", plan.grid.order),
        **kw,
    )
    feasible = [e for e in ranked if e.feasible]
    plan.n_grids, plan.n_feasible = len(ranked), len(feasible)
    if not feasible:
        lines = "\n".join(f"  {e.grid.spec()}: {e.reason}" for e in ranked[:4])
        raise JobError(
            f"no feasible grid for {req.model} on {req.nodes} {m.name} node(s) "
            f"({plan.ntasks} GPUs, global batch {plan.global_batch}); the closest of "
            f"{len(ranked)} candidates:\n{lines}\n"
            f"try more nodes, another global batch (--batch), or a smaller model"
        )
    best = feasible[0]
    plan.estimate, plan.runners_up = best, feasible[1:4]
    plan.grid, plan.checkpointing = dataclasses.replace(best.grid, expert=best.expert), best.checkpointing
    if best.expert != plan.expert:  # a mixture of experts: the ranking chose the expert group
        plan.sets += (f"parallel.expert={best.expert}",)
    if "order" in searched:
        plan.sets += (f"parallel.order={','.join(best.grid.order)}",)
    if "z_split" in searched:
        plan.sets += (f"parallel.z_split={best.z_split}",)
    plan.perf_kw = {**plan.perf_kw, "z_split": best.z_split}


def _explicit_grid(plan: JobPlan, ckpt: bool | None) -> None:
    from perfmodel.model import estimate_auto

    req = plan.request
    try:
        grid = Grid.parse(req.grid, plan.grid.order, plan.expert)
    except GridError as e:
        raise JobError(f"--grid {req.grid!r}: {e}") from None
    if grid.world_size != plan.ntasks:
        raise JobError(
            f"--grid {grid.spec()} has {grid.world_size} ranks but {req.nodes} {plan.machine.name} "
            f"node(s) x {plan.gpus_per_node} GPUs per node = {plan.ntasks} ranks; choose sizes "
            f"whose product is {plan.ntasks}, or --grid auto"
        )
    est = estimate_auto(
        plan.model_cfg,
        grid,
        plan.global_batch,
        plan.machine,
        ckpt,
        gpus_per_node=plan.gpus_per_node,
        expert=plan.expert,
        **plan.perf_kw,
    )
    plan.grid, plan.estimate, plan.checkpointing = grid, est, est.checkpointing
    plan.n_grids, plan.n_feasible = 1, int(est.feasible)
    if not est.feasible:
        plan.warnings.append(f"the perf model predicts grid {grid.spec()} will not work: {est.reason}")
