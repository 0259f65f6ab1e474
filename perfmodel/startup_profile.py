"""A short profile of a job's own ranks taken at start-up (``--grid auto`` without
``parallel.machine``): the collectives of the world's group shapes within two nodes, the local GEMM
shapes of the candidate grids, attention and streaming rates; a few seconds. Every rank returns the
same :class:`~perfmodel.machine.Machine`.
"""

from __future__ import annotations

import os
import time
from typing import Any, Callable

from axo4d.config import RunConfig
from axo4d.facts.run import micro_batch

from .machine import Machine

#: start-up profile: message sizes (MB) and calls per timing
STARTUP_SIZES_MB = {"cpu": (0.004, 0.5), "cuda": (1.0, 16.0)}
STARTUP_ITERS = 3
STARTUP_GEMM_SHAPES = 12
#: overlap figures of a start-up profile are not measured there: CPU ranks share their cores
#: (perfmodel.profile_fit.CPU_SLOWDOWNS: nothing hides); a GPU's collectives take a few SMs (1.1, the
#: shipped machine files' documented default)


def startup_profile(
    world: int, rank: int, gpus_per_node: int, device: Any, cfg: RunConfig, log: Callable[[str], None] = lambda s: None
) -> Machine:
    """A machine measured now on this job's ranks (module docstring); every rank returns the same."""
    import torch

    from . import measure as M
    from .groups import group_shapes
    from .link_timing import measure_host, measure_links
    from .profile_fit import build_machine

    kind = "cuda" if device.type == "cuda" else "cpu"
    t0 = time.perf_counter()
    shapes = [s for s in group_shapes(world) if s[0] * s[1] <= 2 * gpus_per_node] or group_shapes(world)[:1]
    points = measure_links(
        world, rank, device, list(STARTUP_SIZES_MB[kind]), STARTUP_ITERS, 1, log, shapes=shapes, window=0.05
    )
    micro = micro_batch(cfg.train.global_batch, cfg.train.grad_accum)  # as the run plan derives it
    shapes = M.gemm_shapes(cfg.model, world, micro, STARTUP_GEMM_SHAPES)
    table = M.measure_gemm_table(device, shapes, 2, 0.02)
    if cfg.train.fp8 != "off":  # FP8 layers: their GEMMs timed too (grids are priced, and refused, with them)
        table += M.measure_fp8_table(device, shapes, 2, 0.02)
    from .compute import fit_half_dim

    dense = [p for p in table if p.dtype != "float8"]  # the shape curve: the compute dtype's GEMMs
    half, rate = fit_half_dim(dense) if dense else (0.0, 1e12)
    host = measure_host(device, 4) if kind == "cpu" else {"memory_gbps": M.measure_memory(device, 256.0, 3)}
    from .profile_fit import CPU_SLOWDOWNS

    slow = dict(CPU_SLOWDOWNS) if kind == "cpu" else {"compute_slowdown": 1.1, "comm_slowdown": 1.1}
    mem = (
        torch.cuda.get_device_properties(device).total_memory
        if kind == "cuda"
        else os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / max(1, gpus_per_node)
    ) / 2**30
    m = build_machine(
        points,
        name="start-up profile",
        gpus_per_node=gpus_per_node,
        device_memory_gb=mem,
        gemm_tflops=rate / 1e12,
        gemm_efficiency=1.0,
        host=host,
        extra={"gemm_table": [p.to_dict() for p in table], "gemm_half_dim": half, **slow},
    )
    log(f"start-up profile: {len(points)} group shapes, {len(table)} GEMM shapes in {time.perf_counter() - t0:.1f} s")
    return m


__all__ = ["startup_profile"]
