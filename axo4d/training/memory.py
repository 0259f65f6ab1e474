"""This run's memory: predicted at start-up by the memory model (:mod:`axo4d.memory_model`), checked
against the budget before anything is allocated, and measured once training runs.

:func:`plan_memory` prices the run's model, grid, batch and settings (checkpointing, the sharded
optimizer, offload), fixes how much optimizer state stays on the device for ``train.offload:
auto``, and raises :class:`~axo4d.errors.MemoryBudgetError` -- one line naming the number that
does not fit, by how much, the largest term and the settings that would fit -- when the device
(``train.memory_budget_gb``, else the GPU's memory) or, with offload, the host
(``train.host_memory_gb``, else the node's available memory per rank) cannot hold it. Every rank
prices the same model; the budgets are agreed by a collective, so all ranks stop alike.
"""

from __future__ import annotations

import dataclasses
import math
import os
import resource
from dataclasses import dataclass

import torch
import torch.distributed as dist

from axo4d.archs import model_spec
from axo4d.config import RunConfig
from axo4d.dist.grid import Grid
from axo4d.errors import MemoryBudgetError
from axo4d.memory_model import GIB, Memory, Setup, auto_fraction, memory
from axo4d.schedule_facts import largest_bucket_limit
from axo4d.spec import Dtypes
from axo4d.training.optim.offload import available_host_bytes
from axo4d.training.optim.sharded import shard_optimizer_on

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
        return (
            f"memory per rank (predicted, axo4d.memory_model): device {g(m.device['total'])}{budget} "
            f"[{dev}]; host {g(m.host['total'])} [{host}]{state}"
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


def run_setup(cfg: RunConfig, grid: Grid, gpu: bool, runtime: float = 0.0) -> tuple:
    """``(spec, rows per micro-step, dtypes, Setup)`` of ``cfg`` on ``grid``."""
    t = cfg.train
    spec = model_spec(cfg.model, grid)
    b = t.global_batch / t.grad_accum * cfg.model.seq_len / grid.size("data", "z")
    dt = Dtypes.for_compute("bf16" if (t.dtype == "bf16" or (t.dtype == "auto" and gpu)) else "fp32")
    setup = Setup(
        t.activation_checkpointing,
        True,
        shard_optimizer_on(cfg.parallel, grid),
        t.offload,
        bucket_bytes=largest_bucket_limit(cfg.parallel.dp_bucket_mb, spec),
        accumulate=t.grad_accum > 1,
        gpu=gpu,
        runtime_bytes=runtime,
    )
    return spec, b, dt, setup


def _budgets(cfg: RunConfig, device: torch.device, local_ranks: int) -> tuple[float, str, float, str]:
    t = cfg.train
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
    if t.host_memory_gb > 0:
        host, hsrc = t.host_memory_gb * GIB, "train.host_memory_gb"
    else:
        host, hsrc = available_host_bytes() / max(1, local_ranks), f"available memory / {max(1, local_ranks)} ranks"
    return dev, dsrc, host, hsrc


def _agree(values: list[float], world: int) -> list[float]:
    """The smallest of each value over every rank (so every rank decides alike)."""
    if world <= 1 or not dist.is_initialized() or dist.get_world_size() != world:
        return values
    t = torch.tensor([v if math.isfinite(v) else 1e300 for v in values], dtype=torch.float64)
    if dist.get_backend() == "nccl":
        t = t.cuda()
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return [v if v < 1e299 else math.inf for v in t.cpu().tolist()]


def plan_memory(cfg: RunConfig, grid: Grid, device: torch.device, local_ranks: int = 1) -> MemoryPlan:
    """Predict this rank's memory, choose the 'auto' offload split, and stop when it cannot fit."""
    gpu = device.type == "cuda"
    spec, b, dt, setup = run_setup(cfg, grid, gpu, float(rss_bytes()))
    dev, dsrc, host, hsrc = _budgets(cfg, device, local_ranks)
    dev, host = _agree([dev, host], grid.world_size)
    if setup.offload == "auto":
        setup = dataclasses.replace(setup, device_fraction=auto_fraction(spec, b, dt, setup, dev))
    plan = MemoryPlan(memory(spec, b, dt, setup), dev, dsrc, host, hsrc, gpu)
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
    micro = t.global_batch // t.grad_accum
    if micro % (2 * grid.size("data", "z")) == 0:
        out.append((f"train.grad_accum={2 * t.grad_accum}", rep(cfg, train=rep(t, grad_accum=2 * t.grad_accum))))
    return out


def _fits(plan: MemoryPlan) -> bool:
    host_need = plan.memory.host["total"] - plan.memory.host["runtime"]
    return plan.memory.reserved() <= plan.device_budget and host_need <= plan.host_budget


def _try(cfg: RunConfig, grid: Grid, plan: MemoryPlan) -> MemoryPlan:
    spec, b, dt, setup = run_setup(cfg, grid, plan.gpu, plan.memory.setup.runtime_bytes)
    if setup.offload == "auto":
        setup = dataclasses.replace(setup, device_fraction=auto_fraction(spec, b, dt, setup, plan.device_budget))
    return dataclasses.replace(plan, memory=memory(spec, b, dt, setup))


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
    need, host_need = m.reserved(), m.host["total"] - m.host["runtime"]
    if need <= plan.device_budget and host_need <= plan.host_budget:
        return
    fixes = fitting_settings(cfg, grid, plan)
    fix = (
        ("; fits with " + " or ".join(fixes))
        if fixes
        else ("; it fits nowhere on this grid with any memory setting: use more ranks (x, y and z split the weights)")
    )
    if need > plan.device_budget:
        name, v = m.largest()
        raise MemoryBudgetError(
            f"the model does not fit the device: {fmt_bytes(need)} per rank predicted (grid {grid.spec()}, "
            f"{fmt_count(spec_params(cfg, grid))} parameters) > {fmt_bytes(plan.device_budget)} budget "
            f"({plan.device_source}), over by {fmt_bytes(need - plan.device_budget)}; largest term: {name} "
            f"{fmt_bytes(v)}{fix}"
        )
    raise MemoryBudgetError(
        f"offloaded optimizer state needs {fmt_bytes(host_need)} of host memory per rank > "
        f"{fmt_bytes(plan.host_budget)} ({plan.host_source}), over by {fmt_bytes(host_need - plan.host_budget)}{fix}"
    )


def spec_params(cfg: RunConfig, grid: Grid) -> int:
    return model_spec(cfg.model, grid).param_count()


__all__ = ["MemoryPlan", "plan_memory", "check_plan", "fitting_settings", "run_setup", "rss_bytes", "peak_rss_bytes"]
