"""The value of one grid's estimate (:class:`Estimate`), its order in a ranking, and the entry of a
grid listed without an estimate."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Iterable

from axo4d.facts.grid import Grid
from axo4d.facts.spec import Coll

from .machine import GIB, Machine


@dataclass
class Estimate:
    """Predicted cost of one training step on one grid (per GPU).

    ``comm_s``: seconds per axis ('x', 'y', 'z', 'data'; the (data, z)
    reduction of replicated parameters counts under 'data'). ``bytes_per_rank``:
    ``(group, kind) -> bytes`` per rank per step under the convention of
    :func:`perfmodel.collectives.counted_bytes` (group 'x', 'y', 'z', 'data'
    or 'data,z'; groups of size one are omitted; the bookkeeping scalars of
    :func:`perfmodel.costs.bookkeeping_colls` are included, e.g. under
    'x,y,z'). ``calls_per_rank``: the number of calls behind each of those
    byte counts. ``memory_bytes``: params,
    grads, optimizer, activations, buffers (gathered weight blocks), total.
    ``flops_per_step``: docs/design.md section 5 (96 instead of 72 with
    checkpointing), whole job; ``model_flops_per_step``: the same without
    recomputation.
    """

    grid: Grid
    step_time_s: float
    compute_s: float
    comm_s: dict[str, float]
    comm_total_s: float
    exposed_comm_s: float
    memory_bytes: dict[str, float]
    feasible: bool
    reason: str
    checkpointing: bool
    flops_per_step: float
    model_flops_per_step: float
    bytes_per_rank: dict[tuple[str, str], float]
    global_batch: int = 0
    machine: str = ""
    overlap: bool = True
    gemm_tflops: float = 0.0
    memory_limit_bytes: float = 0.0
    compute_detail: dict[str, float] = field(default_factory=dict)
    details: list[tuple[Coll, int, float]] = field(default_factory=list, repr=False)
    calls_per_rank: dict[tuple[str, str], int] = field(default_factory=dict)
    grad_accum: int = 1
    exposed_by_axis: dict[str, float] = field(default_factory=dict)
    """Seconds the compute stream waited for each axis's collectives."""
    contention_s: float = 0.0
    """What overlap cost: compute slowed by concurrent collectives (``step - compute - exposed``)."""
    cached_blocks: int = 0
    """Blocks (the last ones, and the LM head) whose gathered weights are kept for backward."""
    tie: bool = False
    """Within the machine's ``uncertainty`` of the best feasible grid of a ranking."""
    uncertainty: float = 0.0
    z_split: str = "batch"
    """What z splits (``parallel.z_split``): 'batch' (whole samples) or 'sequence' (every sample's
    sequence: K/V all-gathered over z, the micro-batch divided by G_data only)."""
    vendor_tflops: float = 0.0
    """The machine's vendor dense bf16 peak per GPU (:attr:`mfu`, :attr:`hfu`; 0: unknown)."""
    z_split_note: str = ""
    """Why ``z_split='auto'`` chose the sequence split: the only feasible choice, or faster."""
    expert: int = 1
    """The expert-group size G_ep (``parallel.expert``; 1: every expert on every batch rank)."""
    runs_as: str = ""
    """The grid and order the model runs on where x and y are exchanged
    (:func:`axo4d.facts.run.derive.run_grid`; '' where it runs on ``grid``): the same ranks, the
    same estimate as that grid given directly, reported on ``grid``'s axes."""
    bound_only: bool = False
    """``step_time_s`` is only a lower bound (:mod:`perfmodel.pruning`): a grid a ranking listed
    without simulating it, its feasibility, reason and memory exact."""

    @property
    def gpus(self) -> int:
        return self.grid.world_size

    @property
    def tflops_per_gpu(self) -> float:
        """Hardware TFLOP/s per GPU: ``flops_per_step`` (recomputation counted) / step time / GPUs."""
        return self.flops_per_step / self.step_time_s / self.gpus / 1e12 if self.step_time_s > 0 else 0.0

    @property
    def model_tflops_per_gpu(self) -> float:
        """Model TFLOP/s per GPU: ``model_flops_per_step`` (no recomputation) / step time / GPUs."""
        return self.model_flops_per_step / self.step_time_s / self.gpus / 1e12 if self.step_time_s > 0 else 0.0

    @property
    def mfu(self) -> float:
        """Model FLOP utilisation: model TFLOP/s per GPU over the vendor's dense peak (0: no peak known)."""
        return self.model_tflops_per_gpu / self.vendor_tflops if self.vendor_tflops else 0.0

    @property
    def hfu(self) -> float:
        """Hardware FLOP utilisation: hardware TFLOP/s per GPU (recomputation counted) over the vendor's
        dense peak (0: no peak known)."""
        return self.tflops_per_gpu / self.vendor_tflops if self.vendor_tflops else 0.0

    @property
    def ceiling_fraction(self) -> float:
        """Hardware TFLOP/s per GPU as a share of the machine's measured GEMM ceiling ``gemm_tflops``."""
        return self.tflops_per_gpu / self.gemm_tflops if self.gemm_tflops else 0.0

    @property
    def peak_fraction(self) -> float:
        """The former name of :attr:`ceiling_fraction` (not MFU: the ceiling is measured, not the vendor's)."""
        return self.ceiling_fraction

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready summary (no per-collective details)."""
        return {
            "grid": self.grid.spec(),
            "order": ",".join(self.grid.order),
            "gpus": self.gpus,
            "machine": self.machine,
            "global_batch": self.global_batch,
            "step_time_s": self.step_time_s,
            "compute_s": self.compute_s,
            "comm_s": dict(self.comm_s),
            "comm_total_s": self.comm_total_s,
            "exposed_comm_s": self.exposed_comm_s,
            "overlap": self.overlap,
            "memory_bytes": dict(self.memory_bytes),
            "memory_gib": self.memory_bytes["total"] / GIB,
            "memory_limit_gib": self.memory_limit_bytes / GIB,
            "feasible": self.feasible,
            "reason": self.reason,
            "checkpointing": self.checkpointing,
            "flops_per_step": self.flops_per_step,
            "model_flops_per_step": self.model_flops_per_step,
            "tflops_per_gpu": self.tflops_per_gpu,
            "model_tflops_per_gpu": self.model_tflops_per_gpu,
            "mfu": self.mfu,
            "hfu": self.hfu,
            "vendor_tflops": self.vendor_tflops,
            "ceiling_fraction": self.ceiling_fraction,
            "peak_fraction": self.peak_fraction,
            "exposed_by_axis": dict(self.exposed_by_axis),
            "contention_s": self.contention_s,
            "cached_blocks": self.cached_blocks,
            "tie": self.tie,
            "uncertainty": self.uncertainty,
            "z_split": self.z_split,
            "z_split_note": self.z_split_note,
            "runs_as": self.runs_as,
            "bytes_per_rank": {f"{g}:{k}": v for (g, k), v in sorted(self.bytes_per_rank.items())},
        }


def only_memory(reason: str) -> bool:
    """Whether every one of ``reason``'s '; '-separated reasons is the memory limit."""
    return all(r.startswith("memory ") for r in reason.split("; "))


def sort_estimates(ests: Iterable[Estimate]) -> list[Estimate]:
    """Feasible by step time, then grids failing only on memory, then the rest."""
    return sorted(ests, key=lambda e: (0 if e.feasible else 1 if only_memory(e.reason) else 2, e.step_time_s))


def unestimated(grid: Grid, reason: str, machine: Machine, global_batch: int) -> Estimate:
    """An infeasible grid listed without an estimate (:data:`perfmodel.model.FULL_SEARCH_MAX`)."""
    return Estimate(
        grid=grid,
        step_time_s=math.inf,
        compute_s=0.0,
        comm_s={},
        comm_total_s=0.0,
        exposed_comm_s=0.0,
        memory_bytes={"total": 0.0},
        feasible=False,
        reason=reason + " (not estimated)",
        checkpointing=False,
        flops_per_step=0.0,
        model_flops_per_step=0.0,
        bytes_per_rank={},
        global_batch=global_batch,
        machine=machine.name,
        gemm_tflops=machine.gemm_tflops,
        vendor_tflops=machine.vendor_tflops,
        memory_limit_bytes=machine.usable_memory_bytes,
    )


__all__ = ["Estimate", "only_memory", "sort_estimates", "unestimated"]
