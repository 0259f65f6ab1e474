"""The run plan: everything start-up derives from the config and the grid, computed once and
handed to what needs it (issue 30 item 2).

:func:`make_plan` takes the torch-free :class:`~axo4d.facts.run.RunFacts` (model spec,
micro-batch and accumulation, sequence split, FP8 layers, buckets, optimizer mode, weight-cache
blocks: :func:`axo4d.facts.run.derive`, the function ``perfmodel`` calls too) and adds what
needs the device and the world: the memory plan and whether it fits
(:func:`axo4d.training.memory_plan.plan_memory`, a collective), and the model and hardware FLOPs
of a step (MFU and HFU, docs/design.md section 5). Rank 0 prints :meth:`RunPlan.summary` once
and writes :meth:`RunPlan.to_dict` as ``plan.yaml`` beside ``config.yaml`` in ``--out``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import yaml

from axo4d.config import RunConfig
from axo4d.facts.grid import Grid
from axo4d.facts.run import RunFacts, derive
from axo4d.facts.spec import ModelSpec
from axo4d.training.memory_plan import MemoryPlan, fmt_bytes, plan_memory


@dataclass(frozen=True)
class RunPlan:
    """One run on one grid, derived once (module docstring)."""

    grid: str
    """The grid, ``data=2,x=2,...``."""
    facts: RunFacts
    """The torch-free derived numbers (spec, micro-batch, z split, FP8 layers, buckets, optimizer mode)."""
    memory: MemoryPlan
    """The memory prediction, its budgets, and how much optimizer state stays on the device."""
    model_flops: float
    """Model FLOPs of one step (no recomputation): MFU's numerator."""
    hardware_flops: float
    """FLOPs the hardware runs in one step (with activation checkpointing's recomputation): HFU's."""

    @property
    def spec(self) -> ModelSpec:
        return self.facts.spec

    @property
    def micro_batch(self) -> int:
        return self.facts.micro_batch

    def summary(self) -> str:
        """The compact start-up block (rank 0 prints it once)."""
        f, m = self.facts, self.memory.memory
        cache = f"{f.cache_blocks} blocks ({f.cache_layers} layers)" if f.cache_blocks else "off"
        bucket = ", ".join(f"{axes} {fmt_bytes(b)}" for axes, b in f.buckets) or "none"
        return "\n".join(
            [
                f"run plan (grid {self.grid}; written to plan.yaml):",
                f"  batch      micro-batch {f.micro_batch} x grad_accum {f.grad_accum}; z splits the {f.z_split} "
                f"({f.z_split_why})",
                f"  optimizer  {f.optimizer}; dp buckets {bucket}; weight cache {cache}",
                f"  fp8        {', '.join(f.fp8_layers) or 'off'}",
                f"  flops      model {self.model_flops:.4g} / hardware {self.hardware_flops:.4g} per step",
                f"  memory     device {fmt_bytes(m.device['total'])}, host {fmt_bytes(m.host['total'])} per rank: fits",
            ]
        )

    def to_dict(self) -> dict:
        """Plain values for ``plan.yaml``."""
        m = self.memory.memory
        return {
            "grid": self.grid,
            **self.facts.to_dict(),
            "model_flops_per_step": self.model_flops,
            "hardware_flops_per_step": self.hardware_flops,
            "memory": {
                "fits": True,
                "device_bytes": float(m.device["total"]),
                "host_bytes": float(m.host["total"]),
                "device_budget": _finite(self.memory.device_budget),
                "host_budget": _finite(self.memory.host_budget),
                "optimizer_state_on_device": float(m.device_fraction),
                "async_checkpoints": self.memory.async_checkpoints,
            },
        }

    def write(self, path: Path) -> None:
        """``plan.yaml`` (rank 0, beside ``config.yaml``)."""
        Path(path).write_text(yaml.safe_dump(self.to_dict(), sort_keys=False))


def _finite(v: float) -> float | None:
    return float(v) if v != float("inf") else None


def make_plan(
    cfg: RunConfig, grid: Grid, device: torch.device, local_ranks: int = 1, facts: RunFacts | None = None
) -> RunPlan:
    """The run plan of ``cfg`` on ``grid`` (collective: the memory budgets are agreed by every rank);
    ``facts``: :func:`axo4d.facts.run.derive`'s, already checked at start-up (derived here
    when not given). Raises the memory check's error when the run cannot fit."""
    facts = derive(cfg, grid) if facts is None else facts
    memory = plan_memory(cfg, grid, device, local_ranks, facts)
    gb = cfg.train.global_batch
    return RunPlan(
        grid=grid.spec(),
        facts=facts,
        memory=memory,
        model_flops=facts.spec.flops_per_step(gb, False),
        hardware_flops=facts.spec.flops_per_step(gb, cfg.train.activation_checkpointing),
    )


__all__ = ["RunPlan", "make_plan"]
