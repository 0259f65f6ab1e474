"""This run's memory: predicted at start-up by the memory model (:mod:`axo4d.facts.memory`), checked
against the budget before anything is allocated, and measured once training runs.

:func:`plan_memory` prices the run's model, grid, batch and settings (checkpointing, the sharded
optimizer, offload), fixes how much optimizer state stays on the device for ``train.offload:
auto``, and raises :class:`~axo4d.config.errors.MemoryBudgetError` -- one line naming the number that
does not fit, by how much, the largest term and the settings that would fit -- when the device
(``train.memory_budget_gb``, else the GPU's memory) or, with offload, the host
(``train.host_memory_gb``, else the node's available memory per rank) cannot hold it. On CPU ranks
without ``train.memory_budget_gb`` the budget is the node's available host memory per rank, for
everything the rank holds (its "device" tensors live there too). Every rank prices the same model;
the budgets are agreed by a collective, so all ranks stop alike.

Asynchronous checkpoints (``checkpoint.async``) keep a host copy of the saved state
(``staging`` in the host terms); with ``checkpoint.async: auto`` they stay off, with a note, when
that copy is what would not fit.
"""

from __future__ import annotations

import dataclasses
import math
import os
import resource
from dataclasses import dataclass

import torch
import torch.distributed as dist

from axo4d.config import RunConfig
from axo4d.config.errors import MemoryBudgetError
from axo4d.facts.grid import Grid
from axo4d.facts.memory import GIB, Memory, Setup, auto_fraction
from axo4d.facts.moe_memory import expert_setting, memory_with_experts
from axo4d.facts.run import RunFacts, derive, shard_optimizer_on
from axo4d.facts.spec import Dtypes, ModelSpec
from axo4d.training.optim.offload import available_host_bytes

#: what a GPU keeps outside PyTorch's allocator (CUDA context, NCCL buffers): not in the budget
GPU_RESERVE_BYTES = 2 * GIB


def fmt_bytes(v: float) -> str:
    """``12.3 GiB``, or MiB below a GiB."""
    return f"{v / GIB:.3g} GiB" if abs(v) >= GIB else f"{v / 2**20:.3g} MiB"


def fmt_count(n: float) -> str:
    return next(f"{n / d:.3g}{u}" for d, u in ((1e9, "B"), (1e6, "M"), (1e3, "K"), (1, "")) if n >= d or d == 1)


def rss_bytes() -> int:
    """This process's resident memory now."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


@dataclass
class MemoryPlan:
    """The prediction for this rank and the budgets it was checked against."""

    memory: Memory
    device_budget: float
    device_source: str
    host_budget: float
    host_source: str
    gpu: bool
    ram_budget: float = math.inf
    """CPU ranks without ``train.memory_budget_gb``: the host memory all of the rank's bytes share."""
    ram_source: str = ""
    note: str = ""
    """Why ``checkpoint.async: auto`` is off ('' when it is not)."""
    spec: ModelSpec | None = None
    """The model's spec on the grid (the run's, reused when a variant of the settings is priced)."""

    @property
    def async_checkpoints(self) -> bool:
        """Whether saves may run in the background (the staging copy is in the prediction)."""
        return self.memory.setup.staging

    @property
    def device_state_bytes(self) -> float:
        """Optimizer state the device keeps (``train.offload: auto`` fills up to it)."""
        return self.memory.device_state_bytes if self.memory.device_fraction < 1 else math.inf

    def summary(self) -> str:
        """The start-up line: predicted device and host bytes, term by term."""
        m, g = self.memory, fmt_bytes
        dev = ", ".join(f"{k} {g(v)}" for k, v in m.device.items() if k != "total" and v)
        host = ", ".join(f"{k} {g(v)}" for k, v in m.host.items() if k != "total" and v)
        budget = f" of {g(self.device_budget)} ({self.device_source})" if math.isfinite(self.device_budget) else ""
        state = f"; optimizer state {100 * m.device_fraction:.0f}% on the device" if m.setup.offload != "none" else ""
        ram = f"; both within {g(self.ram_budget)} ({self.ram_source})" if math.isfinite(self.ram_budget) else ""
        return (
            f"memory per rank (predicted, axo4d.facts.memory): device {g(m.device['total'])}{budget} "
            f"[{dev}]; host {g(m.host['total'])} [{host}]{state}{ram}"
        )

    def measured(self, device: torch.device) -> str:
        """Measured peaks beside the prediction (after a step)."""
        m = self.memory
        rss = peak_rss_bytes()
        g = fmt_bytes
        if device.type == "cuda":
            peak = torch.cuda.max_memory_allocated(device)
            return (
                f"memory per rank (measured): device peak {g(peak)} allocated (predicted {g(m.device['total'])}, "
                f"ratio {peak / m.device['total']:.2f}); host peak RSS {g(rss)} (predicted {g(m.host['total'])})"
            )
        both = m.device["total"] + m.host["total"]
        return (
            f"memory per rank (measured): peak RSS {g(rss)} (predicted device + host {g(both)}, ratio {rss / both:.2f})"
        )


def async_saves(cfg: RunConfig) -> bool:
    """Whether ``cfg`` asks for background saves that need the host copy: ``checkpoint.async``
    not 'false' and a ``checkpoint.interval`` (the final save, and one on a signal, end the run:
    nothing to overlap them with)."""
    return cfg.checkpoint.async_ != "false" and cfg.checkpoint.interval > 0


def run_setup(cfg: RunConfig, grid: Grid, gpu: bool, runtime: float = 0.0, facts: RunFacts | None = None) -> tuple:
    """``(spec, rows per micro-step, dtypes, Setup)`` of ``cfg`` on ``grid``; ``facts``: the run's
    derived numbers (:func:`axo4d.facts.run.derive`), derived here when not given."""
    t = cfg.train
    f = derive(cfg, grid) if facts is None else facts
    spec = f.split_spec  # with the sequence split: same rows per rank, plus the gathered K/V
    b = t.global_batch / t.grad_accum * cfg.model.seq_len / grid.size("data", "z")
    dt = Dtypes.for_compute("bf16" if (t.dtype == "bf16" or (t.dtype == "auto" and gpu)) else "fp32")
    setup = Setup(
        t.activation_checkpointing,
        True,
        f.shard_optimizer,
        t.offload,
        bucket_bytes=f.largest_bucket_bytes,
        accumulate=t.grad_accum > 1,
        gpu=gpu,
        runtime_bytes=runtime,
        staging=async_saves(cfg),
    )
    return spec, b, dt, setup


def _budgets(cfg: RunConfig, device: torch.device, local_ranks: int) -> tuple[float, str, float, str, float]:
    """(device budget, its source, host budget, its source, one-memory budget of a CPU rank)."""
    t, ram = cfg.train, math.inf
    if t.memory_budget_gb > 0:
        dev, dsrc = t.memory_budget_gb * GIB, "train.memory_budget_gb"
    elif device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        dev, dsrc = (
            total - GPU_RESERVE_BYTES,
            f"{torch.cuda.get_device_name(device)} minus {GPU_RESERVE_BYTES / GIB:.0f} GiB",
        )
    else:
        dev, dsrc = math.inf, "none on CPU"
    per_rank = available_host_bytes() / max(1, local_ranks)
    if t.host_memory_gb > 0:
        host, hsrc = t.host_memory_gb * GIB, "train.host_memory_gb"
    else:
        host, hsrc = per_rank, f"available memory / {max(1, local_ranks)} ranks"
    if device.type != "cuda" and t.memory_budget_gb <= 0 and per_rank > 0:
        ram = per_rank
    return dev, dsrc, host, hsrc, ram


def _agree(values: list[float], world: int) -> list[float]:
    """The smallest of each value over every rank (so every rank decides alike)."""
    if world <= 1 or not dist.is_initialized() or dist.get_world_size() != world:
        return values
    t = torch.tensor([v if math.isfinite(v) else 1e300 for v in values], dtype=torch.float64)
    if dist.get_backend() == "nccl":
        t = t.cuda()
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return [v if v < 1e299 else math.inf for v in t.cpu().tolist()]


def plan_memory(
    cfg: RunConfig, grid: Grid, device: torch.device, local_ranks: int = 1, facts: RunFacts | None = None
) -> MemoryPlan:
    """Predict this rank's memory, choose the 'auto' offload split, and stop when it cannot fit
    (``facts``: the run's derived numbers, derived here when not given)."""
    gpu = device.type == "cuda"
    facts = derive(cfg, grid) if facts is None else facts
    spec, b, dt, setup = run_setup(cfg, grid, gpu, float(rss_bytes()), facts)
    dev, dsrc, host, hsrc, ram = _budgets(cfg, device, local_ranks)
    dev, host, ram = _agree([dev, host, ram], grid.world_size)
    ram_src = f"available host memory / {max(1, local_ranks)} ranks: a CPU rank's tensors are in host memory"
    plan = MemoryPlan(_predict(spec, b, dt, setup, grid), dev, dsrc, host, hsrc, gpu, ram, ram_src, spec=facts.spec)
    plan = _try(cfg, grid, plan)  # offload 'auto' fills the device budget
    if plan.async_checkpoints and cfg.checkpoint.async_ == "auto" and not _fits(plan):
        off = dataclasses.replace(cfg, checkpoint=dataclasses.replace(cfg.checkpoint, async_="false"))
        alt = _try(off, grid, plan)
        if _fits(alt):
            copy = plan.memory.host["staging"]
            plan = dataclasses.replace(
                alt, note=f"checkpoint.async=auto: saves block training (no room for the {fmt_bytes(copy)} host copy)"
            )
            cfg = off
    check_plan(plan, cfg, grid)
    return plan


# ---- does it fit, and what would ------------------------------------------------------------------------
def _variants(cfg: RunConfig, grid: Grid) -> list[tuple[str, RunConfig]]:
    """Single changes that lower memory, as ``--set`` strings with the config they give."""
    t, p, out = cfg.train, cfg.parallel, []
    rep = dataclasses.replace
    if not t.activation_checkpointing:
        out.append(("train.activation_checkpointing=true", rep(cfg, train=rep(t, activation_checkpointing=True))))
    if not shard_optimizer_on(p, grid) and grid.size("data", "z") > 1:
        out.append(("parallel.shard_optimizer=true", rep(cfg, parallel=rep(p, shard_optimizer="true"))))
    if t.offload != "auto":
        out.append(("train.offload=auto", rep(cfg, train=rep(t, offload="auto"))))
    if async_saves(cfg):
        out.append(("checkpoint.async=false", rep(cfg, checkpoint=rep(cfg.checkpoint, async_="false"))))
    micro = t.global_batch // t.grad_accum
    if micro % (2 * grid.size("data", "z")) == 0:
        out.append((f"train.grad_accum={2 * t.grad_accum}", rep(cfg, train=rep(t, grad_accum=2 * t.grad_accum))))
    return out


def _needs(plan: MemoryPlan) -> tuple[float, float, float]:
    """(device bytes reserved, host bytes beyond the runtime, both together) of ``plan``."""
    host_need = plan.memory.host["total"] - plan.memory.host["runtime"]
    return plan.memory.reserved(), host_need, plan.memory.device["total"] + host_need


def _fits(plan: MemoryPlan) -> bool:
    need, host_need, both = _needs(plan)
    return need <= plan.device_budget and host_need <= plan.host_budget and both <= plan.ram_budget


def _try(cfg: RunConfig, grid: Grid, plan: MemoryPlan) -> MemoryPlan:
    facts = derive(cfg, grid, plan.spec)  # the same model on the same grid: its spec is reused
    spec, b, dt, setup = run_setup(cfg, grid, plan.gpu, plan.memory.setup.runtime_bytes, facts)
    if setup.offload == "auto":
        setup = dataclasses.replace(setup, device_fraction=auto_fraction(spec, b, dt, setup, plan.device_budget))
    return dataclasses.replace(plan, memory=_predict(spec, b, dt, setup, grid))


def _predict(spec: ModelSpec, b: float, dt: Dtypes, setup: Setup, grid: Grid) -> Memory:
    """:func:`~axo4d.facts.memory.memory`; for a mixture of experts with the experts this rank
    holds and the rows they multiply (:func:`~axo4d.facts.moe_memory.memory_with_experts`)."""
    return memory_with_experts(spec, b, dt, setup, expert_setting(grid.expert))


def fitting_settings(cfg: RunConfig, grid: Grid, plan: MemoryPlan, limit: int = 3) -> list[str]:
    """Up to ``limit`` settings (one change each, else all together) under which the run fits."""
    variants = _variants(cfg, grid)
    out = []
    for text, alt in variants:
        p = _try(alt, grid, plan)
        if _fits(p):
            out.append(
                f"{text} (device {fmt_bytes(p.memory.reserved())}"
                + (f", host {fmt_bytes(p.memory.host['optimizer'])}" if p.memory.host["optimizer"] else "")
                + ")"
            )
    if out or not variants:
        return out[:limit]
    t, p = cfg.train, cfg.parallel
    every = dataclasses.replace(
        cfg,
        checkpoint=dataclasses.replace(cfg.checkpoint, async_="false"),
        train=dataclasses.replace(t, activation_checkpointing=True, offload="auto"),
        parallel=dataclasses.replace(p, shard_optimizer="true" if grid.size("data", "z") > 1 else p.shard_optimizer),
    )
    if _fits(_try(every, grid, plan)):
        return [
            "train.activation_checkpointing=true with train.offload=auto"
            + (" and parallel.shard_optimizer=true" if grid.size("data", "z") > 1 else "")
        ]
    return []


def check_plan(plan: MemoryPlan, cfg: RunConfig, grid: Grid) -> None:
    """Raise :class:`MemoryBudgetError` when the device or the host cannot hold the prediction."""
    m = plan.memory
    need, host_need, both = _needs(plan)
    if _fits(plan):
        return
    fixes = fitting_settings(cfg, grid, plan)
    fix = (
        ("; fits with " + " or ".join(fixes))
        if fixes
        else ("; it fits nowhere on this grid with any memory setting: use more ranks (x, y and z split the weights)")
    )
    if both > plan.ram_budget:
        name, v = max(
            ((k, x) for d in (m.device, m.host) for k, x in d.items() if k not in ("total", "runtime")),
            key=lambda kv: kv[1],
        )
        raise MemoryBudgetError(
            f"the run does not fit this machine's memory: {fmt_bytes(both)} per rank predicted (grid {grid.spec()}, "
            f"{fmt_count(spec_params(plan))} parameters) > {fmt_bytes(plan.ram_budget)} ({plan.ram_source}), "
            f"over by {fmt_bytes(both - plan.ram_budget)}; largest term: {name} {fmt_bytes(v)}{fix}; "
            f"train.memory_budget_gb sets the budget"
        )
    if need > plan.device_budget:
        name, v = m.largest()
        raise MemoryBudgetError(
            f"the model does not fit the device: {fmt_bytes(need)} per rank predicted (grid {grid.spec()}, "
            f"{fmt_count(spec_params(plan))} parameters) > {fmt_bytes(plan.device_budget)} budget "
            f"({plan.device_source}), over by {fmt_bytes(need - plan.device_budget)}; largest term: {name} "
            f"{fmt_bytes(v)}{fix}"
        )
    what = "offloaded optimizer state" if m.host["optimizer"] >= m.host["staging"] else "the checkpoint staging copy"
    raise MemoryBudgetError(
        f"{what} needs {fmt_bytes(host_need)} of host memory per rank > "
        f"{fmt_bytes(plan.host_budget)} ({plan.host_source}), over by {fmt_bytes(host_need - plan.host_budget)}{fix}"
    )


def spec_params(plan: MemoryPlan) -> int:
    return plan.spec.param_count() if plan.spec is not None else 0


__all__ = ["MemoryPlan", "plan_memory", "check_plan", "fitting_settings", "run_setup", "rss_bytes", "peak_rss_bytes"]
