"""``python -m perfmodel profile``: measure this machine, write a machine YAML.

Run on every rank of a job (``torchrun``, ``srun``, ``mpirun``). For every
group shape the world allows -- stride ``s`` and size ``p`` with ``s*p``
dividing the world size, the groups built by :class:`axo4d.facts.grid.Grid` -- it
times all-gather, reduce-scatter and all-reduce at a few message sizes (the
slowest rank's time), fits the ring alpha-beta model of
:mod:`perfmodel.collectives` (``t = steps*alpha + factor*n/BW``), measures the
local GEMM rate, and rank 0 writes a file that :func:`perfmodel.machine.load_machine`
reads. Each measured (stride, size) also covers the unmeasured keys below it
(the next larger measured key's figure, as in the bundled files).
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import statistics
import sys
import time
from typing import Any, Callable

import numpy as np

from .collectives import ALL_GATHER, ALL_REDUCE, KINDS, REDUCE_SCATTER, latency_steps, volume_factor
from .groups import group_shapes, shape_grid
from .groups import shape_groups as _shape_groups
from .machine import GIB, BandwidthEntry, Machine, dump_machine, machine_from_dict


def fit_alpha_beta(kind: str, p: int, nbytes: list[float], seconds: list[float]) -> tuple[float, float]:
    """Fit ``t = steps*alpha + factor*n/BW`` through the smallest and the largest message
    (robust on noisy, shared hosts: both end points are reproduced, so neither the latency
    nor the bandwidth can collapse); returns ``(alpha_s, gbps)``, alpha clamped at 0."""
    n = np.asarray(nbytes, dtype=float)
    t = np.asarray(seconds, dtype=float)
    lo, hi = int(np.argmin(n)), int(np.argmax(n))
    slope = (t[hi] - t[lo]) / (n[hi] - n[lo]) if n[hi] > n[lo] else 0.0
    icpt = t[lo] - slope * n[lo]
    if slope <= 0 or icpt < 0:  # noise: all of the largest message's time is bandwidth
        slope, icpt = float(t[hi] / n[hi]), (max(0.0, float(t[lo])) if slope <= 0 else 0.0)
    gbps = volume_factor(kind, p) / slope / 1e9
    return max(0.0, float(icpt)) / latency_steps(kind, p), float(gbps)


CPU_SLOWDOWNS = {
    "compute_slowdown": 2.0,
    "comm_slowdown": 2.0,
    "concurrent_slowdown": {"intra": 2.0, "inter": 2.0, "mixed": 2.0},
}
"""CPU ranks without an overlap measurement (``--no-overlap``, or one rank): processor sharing --
gloo moves and reduces data on the cores that compute, so nothing hides. A rule, not a
measurement, and wrong for a collective that waits for a wire: over a link between nodes most of
a collective's time takes no processor, and charging it as shared over-priced every grid whose
collectives run behind compute (the z prefetch and background reduce-scatters: grids with z > 1,
docs/perfmodel_validation.md). So CPU ranks are measured like GPUs, per link class
(:func:`perfmodel.measure.measure_overlap_fields`)."""

MIN_WINDOW_S = 0.5
"""Shortest timing window on CPU: several scheduler time slices."""


def _sig(v: float, digits: int = 4) -> float:
    """``v`` rounded to ``digits`` significant digits (CPU rates are far below 1 TFLOP/s)."""
    return float(f"{v:.{digits}g}")


def coverage_table(points: dict[tuple[int, int], tuple]) -> tuple[BandwidthEntry, ...]:
    """Bandwidth entries from measured ``(stride, size) -> (gbps, alpha_s[, {kind: (gbps, alpha_s)}])``:
    each measured key covers the keys between it and the next smaller one;
    the largest stride and size extend without bound."""
    strides = sorted({s for s, _ in points})
    out = []
    lo_s = 1
    for i, s in enumerate(strides):
        hi_s = None if i == len(strides) - 1 else s
        sizes = sorted(p for ss, p in points if ss == s)
        lo_p = 2
        for j, p in enumerate(sizes):
            gbps, alpha, *rest = points[(s, p)]
            kinds = tuple((k, _sig(g), _sig(a * 1e6)) for k, (g, a) in (rest[0] if rest else {}).items())
            hi_p = None if j == len(sizes) - 1 else p
            out.append(BandwidthEntry((lo_s, hi_s), (lo_p, hi_p), _sig(gbps), _sig(alpha * 1e6), kinds))
            lo_p = p + 1
        lo_s = s + 1
    return tuple(out)


# ---- measurement (needs torch.distributed) ------------------------------------
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
    op = ops[kind]
    if work is None or not work.gemms:
        return _timed(op, device, iters, warmup, window)
    return _timed_after(op, work, device, iters, warmup)


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


def build_machine(
    points: dict[tuple[int, int], tuple],
    *,
    name: str,
    gpus_per_node: int,
    device_memory_gb: float,
    gemm_tflops: float,
    gemm_efficiency: float = 0.7,
    host: dict[str, float] | None = None,
    extra: dict | None = None,
) -> Machine:
    """A validated :class:`Machine` from measurements (``host``: the CPU-host fields
    ``op_overhead_us``, ``memory_gbps``, ``overlap_efficiency``; ``extra``: further machine-file
    keys as measured -- ``gemm_table``, ``gemm_half_dim``, ``attention_tflops``, the slowdowns)."""
    inter = [v[0] for (s, _), v in points.items() if s >= gpus_per_node]
    data = {
        "name": name,
        "description": f"measured by perfmodel profile on {datetime.date.today()}",
        "source": "perfmodel profile"
        + ("" if points else " (one rank: no collectives measured; the link table is a placeholder)"),
        "gpus_per_node": gpus_per_node,
        "device_memory_gb": round(device_memory_gb, 2),
        "gemm_tflops": _sig(gemm_tflops),
        "gemm_efficiency": gemm_efficiency,
        "latency_us": _sig(statistics.median(v[1] for v in points.values()) * 1e6) if points else 0.0,
        "bandwidth": [],
    }
    if inter:
        data["inter_node_gbps"] = _sig(min(inter))
    data.update({k: _sig(v) for k, v in (host or {}).items()})
    data.update(extra or {})
    data["bandwidth"] = [
        {
            "stride": list(e.stride),
            "size": list(e.size),
            "gbps": e.gbps,
            "latency_us": e.latency_us,
            **({"by_kind": {k: {"gbps": g, "latency_us": a} for k, g, a in e.by_kind}} if e.by_kind else {}),
        }
        for e in coverage_table(points)
    ] or [{"stride": [1, None], "size": [2, None], "gbps": 1e6}]
    return machine_from_dict(data, "<profile>")


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="perfmodel profile", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="machine_profile.yaml", help="YAML written by rank 0")
    ap.add_argument("--name", default="profiled", help="machine name in the file")
    ap.add_argument("--sizes-mb", default="4,16,64", help="message sizes in MB (logical n), comma separated")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="measure every shape (and the GEMM and host figures) this many times, keep medians",
    )
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--gemm-n", type=int, default=8192, help="GEMM size n for the n^3 rate (CPU: use ~1024)")
    ap.add_argument(
        "--gemm-efficiency",
        type=float,
        default=None,
        help="fraction of the measured GEMM rate reached in training (default 0.7 GPU, 1.0 CPU: "
        "measure CPUs at training-like --gemm-n)",
    )
    ap.add_argument(
        "--interleave-gemms",
        type=int,
        default=None,
        help="GEMMs of --gemm-n run before every timed collective (what it adds is timed) "
        "(default 4 on CPU: ranks sharing cores; 0 on GPU)",
    )
    ap.add_argument("--gpus-per-node", type=int, default=None, help="default: LOCAL_WORLD_SIZE or CUDA devices")
    ap.add_argument("--device-memory-gb", type=float, default=None, help="default: the device's memory")
    ap.add_argument("--backend", default="auto")
    ap.add_argument(
        "--model",
        default=None,
        help="named config or YAML: time the local GEMM shapes of every grid of this world "
        "(default: a generic set around --gemm-n)",
    )
    ap.add_argument("--batch", type=int, default=None, help="global batch (samples) for --model's shapes")
    ap.add_argument("--gemm-shapes", type=int, default=24, help="at most this many GEMM shapes (default 24)")
    ap.add_argument(
        "--tuner-cache",
        default=None,
        help="also import the GEMM timings of this BLAS tuner cache (axo4d.nn.blas_tuner JSON)",
    )
    ap.add_argument(
        "--no-overlap", action="store_true", help="skip the overlap and concurrency measurements (keep defaults)"
    )
    return ap


def _device_memory_gb(device: Any) -> float:
    import torch

    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory / GIB
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GIB


def run(opts: argparse.Namespace, rank: int, world: int, device: Any) -> Machine | None:
    """Measure and (rank 0) write ``opts.out``; returns the machine on rank 0."""
    import torch

    log = (lambda s: print(s, flush=True)) if rank == 0 else (lambda s: None)
    sizes = [float(v) for v in opts.sizes_mb.split(",") if v.strip()]
    gemms = opts.interleave_gemms if opts.interleave_gemms is not None else (4 if device.type == "cpu" else 0)
    work = Work(device, gemms, opts.gemm_n, opts.iters) if gemms and world > 1 else None
    if work:
        log(f"collectives timed right after {gemms} GEMMs of {opts.gemm_n}^3 each ({work.seconds * 1e3:.2f} ms)")
    if world < 2:
        log("one rank: no collectives to measure (the file's link table is a placeholder)")
        points = {}
    else:
        points = measure_links(world, rank, device, sizes, opts.iters, opts.warmup, log, work, opts.repeats)
    reps = max(1, opts.repeats)
    tflops = statistics.median(measure_gemm(device, opts.gemm_n) for _ in range(reps))
    log(f"GEMM {opts.gemm_n}^3: {tflops:.4g} TFLOP/s per rank")
    host = None
    if device.type == "cpu":  # ranks share cores: operator overheads, memory traffic, no real overlap
        runs = [measure_host(device) for _ in range(reps)]
        host = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        log(f"host: {host['op_overhead_us']:.1f} us per operator, {host['memory_gbps']:.2f} GB/s streaming per rank")
    eff = opts.gemm_efficiency if opts.gemm_efficiency is not None else (0.7 if device.type == "cuda" else 1.0)
    gpn = opts.gpus_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", 0)) or max(1, torch.cuda.device_count())
    mem = opts.device_memory_gb or _device_memory_gb(device)
    from .measure import measure_compute, measure_overlap_fields

    extra = measure_compute(opts, world, device, log)
    if not opts.no_overlap and world > 1:
        extra.update(measure_overlap_fields(world, rank, device, min(gpn, world), opts, log))
    elif device.type == "cpu":
        extra.update(CPU_SLOWDOWNS)
    m = build_machine(
        points,
        name=opts.name,
        gpus_per_node=min(gpn, world),
        device_memory_gb=mem,
        gemm_tflops=tflops,
        gemm_efficiency=eff,
        host=host,
        extra=extra,
    )
    if rank != 0:
        return None
    header = (
        f"Measured by `python -m perfmodel profile` on {datetime.datetime.now():%Y-%m-%d %H:%M}: "
        f"{world} ranks, device {device}, message sizes {opts.sizes_mb} MB, {opts.iters} iterations, "
        f"{opts.repeats} repeat(s).\n"
        f"gbps/latency_us per entry: ring alpha-beta fit through the smallest and largest message, "
        f"median over all-gather, reduce-scatter, all-reduce; by_kind: each one's own fit.\n"
        f"Every figure is measured with all ranks busy at once (shared cores and links included)."
    )
    dump_machine(m, opts.out, header)
    log(f"wrote {opts.out}")
    return m


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``perfmodel profile``: uses an initialised torch.distributed,
    else initialises it with :func:`axo4d.dist.bootstrap.init_distributed`."""
    opts = _parser().parse_args(argv)
    import torch
    import torch.distributed as dist

    ours = False
    try:
        if dist.is_available() and dist.is_initialized():
            rank, world = dist.get_rank(), dist.get_world_size()
            device = (
                torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
            )
        else:
            from axo4d.dist.bootstrap import init_distributed

            info = init_distributed(backend=opts.backend)
            ours = True
            rank, world, device = info.rank, info.world_size, torch.device(info.device)
            opts.gpus_per_node = opts.gpus_per_node or info.local_world_size
        run(opts, rank, world, device)
    except (ImportError, RuntimeError, ValueError) as e:
        print(f"perfmodel profile: error: {e}", file=sys.stderr)
        return 2
    finally:
        if ours:
            from axo4d.dist.bootstrap import shutdown

            shutdown()
    return 0


__all__ = [
    "run",
    "main",
    "build_machine",
    "coverage_table",
    "fit_alpha_beta",
    "measure_links",
    "measure_gemm",
    "measure_host",
    "group_shapes",
    "shape_grid",
]
