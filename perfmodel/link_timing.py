"""Timing collectives, GEMMs and the host on every rank at once (``perfmodel profile``,
:mod:`perfmodel.startup_profile`; needs an initialised torch.distributed): each figure is the
slowest rank's, with all ranks busy together (shared cores and links included)."""

from __future__ import annotations

import math
import os
import statistics
import time
from typing import Any, Callable

from .collectives import ALL_GATHER, ALL_REDUCE, KINDS, REDUCE_SCATTER
from .groups import shape_groups as _shape_groups
from .profile_fit import fit_alpha_beta

MIN_WINDOW_S = 0.5
"""Shortest timing window on CPU: several scheduler time slices."""


def _sync(device: Any) -> None:
    import torch

    if getattr(device, "type", str(device)) == "cuda":
        torch.cuda.synchronize(device)


class Work:
    """Compute placed before every timed collective (``--interleave-gemms``): on shared
    cores a collective issued after compute waits for ranks the scheduler left behind,
    which back-to-back calls never see. What the collective adds to a loop of it is timed."""

    def __init__(self, device: Any, gemms: int, n: int, iters: int) -> None:
        import torch

        self.gemms = gemms
        self.a = torch.randn(n, n, device=device)
        self.seconds = _timed(self, device, iters, 2, window=False) if gemms else 0.0

    def __call__(self) -> None:
        for _ in range(self.gemms):
            self.a @ self.a


def _time_collective(
    kind: str,
    group: Any,
    p: int,
    nbytes: int,
    device: Any,
    iters: int,
    warmup: int,
    work: Work | None = None,
    window: float | bool = True,
) -> float:
    """Seconds per call of ``kind`` with logical size ``nbytes``, slowest rank (issued
    after ``work`` when given)."""
    import torch
    import torch.distributed as dist

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32  # what training moves there
    esize = torch.tensor([], dtype=dtype).element_size()
    numel = max(p, nbytes // esize // p * p)
    full = torch.ones(numel, dtype=dtype, device=device)
    shard = full[: numel // p].clone()
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    ops: dict[str, Callable[[], Any]] = {
        ALL_GATHER: lambda: gather(full, shard, group=group),
        REDUCE_SCATTER: lambda: scatter(shard, full, group=group),
        ALL_REDUCE: lambda: dist.all_reduce(full, group=group),
    }
    ops.update(_pairwise_ops(group, p, device, full, shard))
    op = ops[kind]
    if work is None or not work.gemms:
        return _timed(op, device, iters, warmup, window)
    return _timed_after(op, work, device, iters, warmup)


def _pairwise_ops(group: Any, p: int, device: Any, full: Any, shard: Any) -> dict[str, Callable[[], Any]]:
    """The all-gather and reduce-scatter axo4d's ``Comm`` runs on two gloo ranks (one exchange of
    halves in chunks, :mod:`axo4d.dist.pairwise`), so the profile prices what runs; else none."""
    from axo4d.dist.pairwise import all_gather, pair_of, reduce_scatter

    pair = pair_of(group) if p == 2 and device.type == "cpu" else None
    if pair is None:
        return {}
    return {
        ALL_GATHER: lambda: all_gather(shard, full, pair, group, None).wait(),
        REDUCE_SCATTER: lambda: reduce_scatter(full, shard, pair, group, None).wait(),
    }


def _timed_after(op: Callable[[], Any], work: Work, device: Any, iters: int, warmup: int) -> float:
    """Seconds ``op`` adds to a loop of ``work``: the mean of ``work; op`` minus the mean of
    ``work`` alone, the latter timed just before (load from elsewhere drifts slowly)."""
    alone = _timed(work, device, iters, 1, window=False)

    def both() -> None:
        work()
        op()

    return max(1e-6, _timed(both, device, iters, warmup, window=False) - alone)


def _timed(op: Callable[[], Any], device: Any, iters: int, warmup: int, window: float | bool = True) -> float:
    """Mean seconds per call of ``op`` on this rank, then the slowest rank's. All ranks run
    it at once: on shared cores that contention is part of the figure (a mean, not a
    median: time slicing shows up as a few long calls, not as uniformly slower ones; on
    CPU at least ``MIN_WINDOW_S`` long, or the ranks would take turns instead). Every rank
    makes the same number of calls -- ``op`` may be a collective -- so the extra calls that fill
    the window are agreed over the ranks (the most any rank needs)."""
    import torch
    import torch.distributed as dist

    for _ in range(warmup):
        op()
    _sync(device)
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        op()
    n = max(1, iters)
    least = MIN_WINDOW_S if window is True else float(window or 0.0)
    if device.type == "cpu" and least > 0:
        _sync(device)
        spent = time.perf_counter() - t0
        extra = torch.tensor([max(0, math.ceil((least - spent) / max(spent / max(1, iters), 1e-9)))], dtype=torch.int64)
        dist.all_reduce(extra, op=dist.ReduceOp.MAX)  # CPU only: a CPU tensor on gloo
        for _ in range(int(extra.item())):
            op()
        n += int(extra.item())
    _sync(device)
    dt = torch.tensor([(time.perf_counter() - t0) / n], dtype=torch.float64, device=device)
    dist.all_reduce(dt, op=dist.ReduceOp.MAX)
    return float(dt.item())


def measure_gemm(device: Any, n: int, iters: int = 10) -> float:
    """Achieved TFLOP/s of an ``n^3`` matmul (bf16 on GPU, fp32 on CPU), all ranks at once."""
    import torch

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    return 2 * n**3 / _timed(lambda: a @ b, device, iters, 2) / 1e12


def measure_host(device: Any, iters: int = 20) -> dict[str, float]:
    """CPU-host figures, all ranks at once: ``op_overhead_us`` (a small forward+backward
    chain of 8 operators, per operator) and ``memory_gbps`` (streaming add, bytes moved)."""
    import torch

    x = torch.randn(64, device=device, requires_grad=True)

    def chain() -> None:
        ((x * 2 + 1).relu() * x).sum().backward()

    per_op = _timed(chain, device, iters * 5, 5) / 8
    n = 4 * 2**20
    a, b, c = (torch.randn(n, device=device) for _ in range(3))
    stream = 3 * n * 4 / _timed(lambda: torch.add(a, b, out=c), device, iters, 2)
    return {"op_overhead_us": per_op * 1e6, "memory_gbps": stream / 1e9}


def measure_links(
    world: int,
    rank: int,
    device: Any,
    sizes_mb: list[float],
    iters: int,
    warmup: int,
    log: Callable[[str], None],
    work: Work | None = None,
    repeats: int = 1,
    shapes: list[tuple[int, int]] | None = None,
    window: float | bool = True,
) -> dict[tuple[int, int], tuple]:
    """Fit per (stride, size): ``(gbps, alpha, {kind: (gbps, alpha)})``, the first two the
    median over the three collectives (all groups of the shape run at once). With
    ``repeats`` > 1 every shape is measured that many times, in turn, and each point is
    the median (a burst of load elsewhere then spoils one repeat, not the figure).
    ``shapes``: only these (stride, size) shapes; ``window``: least seconds per timing on CPU."""
    groups = _shape_groups(world, rank, shapes)
    nb = [int(mb * 1e6) for mb in sizes_mb]
    raw: dict[tuple, list[list[float]]] = {}
    for _ in range(repeats):
        for (stride, size), g in groups.items():
            for kind in KINDS:
                ts = [_time_collective(kind, g, size, n, device, iters, warmup, work, window) for n in nb]
                raw.setdefault((stride, size, kind), []).append(ts)
    points = {}
    for stride, size in groups:
        fits = {}
        for kind in KINDS:
            ts = [statistics.median(rep[i] for rep in raw[(stride, size, kind)]) for i in range(len(nb))]
            fits[kind] = fit_alpha_beta(kind, size, nb, ts)[::-1]  # (gbps, alpha)
            if os.environ.get("PERFMODEL_PROFILE_DEBUG"):
                log(
                    f"  {kind} stride {stride} size {size}: "
                    + ", ".join(f"{n / 1e6:g} MB {t * 1e3:.2f} ms" for n, t in zip(nb, ts))
                )
        gbps = statistics.median(f[0] for f in fits.values())
        alpha = statistics.median(f[1] for f in fits.values())
        points[(stride, size)] = (gbps, alpha, fits)
        log(
            f"stride {stride:5d} size {size:5d}: {gbps:9.3g} GB/s, alpha {alpha * 1e6:8.1f} us  ("
            + ", ".join(f"{k} {g:.3g} GB/s {a * 1e6:.0f} us" for k, (g, a) in fits.items())
            + ")"
        )
    return points


__all__ = ["Work", "measure_gemm", "measure_host", "measure_links", "MIN_WINDOW_S"]
