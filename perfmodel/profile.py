"""``python -m perfmodel profile``: measure this machine, write a machine YAML.

Run on every rank of a job (``torchrun``, ``srun``, ``mpirun``). For every
group shape the world allows -- stride ``s`` and size ``p`` with ``s*p``
dividing the world size, the groups built by :class:`axo4d.grid.Grid` -- it
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
import os
import statistics
import sys
import time
from typing import Any, Callable

import numpy as np

from axo4d.grid import Grid, divisors

from .collectives import ALL_GATHER, ALL_REDUCE, KINDS, REDUCE_SCATTER, latency_steps, volume_factor
from .machine import GIB, BandwidthEntry, Machine, dump_machine, machine_from_dict


def fit_alpha_beta(kind: str, p: int, nbytes: list[float], seconds: list[float]) -> tuple[float, float]:
    """Least-squares fit of ``t = steps*alpha + factor*n/BW``; returns
    ``(alpha_s, gbps)`` (alpha clamped at 0)."""
    n = np.asarray(nbytes, dtype=float)
    t = np.asarray(seconds, dtype=float)
    if len(n) >= 2 and np.ptp(n) > 0:
        slope, icpt = np.polyfit(n, t, 1)
    else:
        slope, icpt = float(t[0] / n[0]), 0.0
    if slope <= 0:  # noise: fall back to the largest message, no latency
        i = int(np.argmax(n))
        slope, icpt = float(t[i] / n[i]), 0.0
    gbps = volume_factor(kind, p) / slope / 1e9
    return max(0.0, float(icpt)) / latency_steps(kind, p), float(gbps)


def group_shapes(world: int) -> list[tuple[int, int]]:
    """(stride, size) pairs whose groups partition ``world`` ranks: ``s*p | world``, ``p >= 2``."""
    return [(s, p) for s in divisors(world) for p in divisors(world // s) if p >= 2]


def shape_grid(world: int, stride: int, size: int) -> Grid:
    """A grid whose y-groups have ``stride`` and ``size`` (x below them, data above)."""
    return Grid(data=world // (stride * size), x=stride, y=size)


def coverage_table(points: dict[tuple[int, int], tuple[float, float]]) -> tuple[BandwidthEntry, ...]:
    """Bandwidth entries from measured ``(stride, size) -> (gbps, alpha_s)``:
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
            gbps, alpha = points[(s, p)]
            hi_p = None if j == len(sizes) - 1 else p
            out.append(BandwidthEntry((lo_s, hi_s), (lo_p, hi_p), round(gbps, 2), round(alpha * 1e6, 2)))
            lo_p = p + 1
        lo_s = s + 1
    return tuple(out)


# ---- measurement (needs torch.distributed) ------------------------------------
def _sync(device: Any) -> None:
    import torch
    if getattr(device, "type", str(device)) == "cuda":
        torch.cuda.synchronize(device)


def _time_collective(kind: str, group: Any, p: int, nbytes: int, device: Any, iters: int, warmup: int) -> float:
    """Seconds per call of ``kind`` with logical size ``nbytes``, slowest rank."""
    import torch
    import torch.distributed as dist
    numel = max(p, nbytes // 2 // p * p)
    full = torch.ones(numel, dtype=torch.bfloat16 if device.type == "cuda" else torch.float16, device=device)
    shard = full[: numel // p].clone()
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    ops: dict[str, Callable[[], Any]] = {
        ALL_GATHER: lambda: gather(full, shard, group=group),
        REDUCE_SCATTER: lambda: scatter(shard, full, group=group),
        ALL_REDUCE: lambda: dist.all_reduce(full, group=group),
    }
    op = ops[kind]
    for _ in range(warmup):
        op()
    _sync(device)
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        op()
    _sync(device)
    dt = torch.tensor([(time.perf_counter() - t0) / iters], dtype=torch.float64, device=device)
    dist.all_reduce(dt, op=dist.ReduceOp.MAX)
    return float(dt.item())


def measure_gemm(device: Any, n: int, iters: int = 10) -> float:
    """Achieved TFLOP/s of an ``n^3`` matmul (bf16 on GPU, fp32 on CPU)."""
    import torch
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(2):
        a @ b
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(iters):
        a @ b
    _sync(device)
    return 2 * n ** 3 * iters / (time.perf_counter() - t0) / 1e12


def measure_links(world: int, rank: int, device: Any, sizes_mb: list[float], iters: int, warmup: int,
                  log: Callable[[str], None]) -> dict[tuple[int, int], tuple[float, float]]:
    """Fit (gbps, alpha) per (stride, size): median over the three collectives."""
    import torch.distributed as dist
    points = {}
    for stride, size in group_shapes(world):
        grid = shape_grid(world, stride, size)
        mine = None
        for ranks in grid.all_groups(("y",)):  # every rank creates every group, same order
            g = dist.new_group(list(ranks))
            if rank in ranks:
                mine = g
        fits = []
        for kind in KINDS:
            nb = [int(mb * 1e6) for mb in sizes_mb]
            ts = [_time_collective(kind, mine, size, n, device, iters, warmup) for n in nb]
            fits.append(fit_alpha_beta(kind, size, nb, ts))
        gbps = statistics.median(f[1] for f in fits)
        alpha = statistics.median(f[0] for f in fits)
        points[(stride, size)] = (gbps, alpha)
        log(f"stride {stride:5d} size {size:5d}: {gbps:9.2f} GB/s, alpha {alpha * 1e6:8.2f} us")
    return points


def build_machine(points: dict[tuple[int, int], tuple[float, float]], *, name: str, gpus_per_node: int,
                  device_memory_gb: float, gemm_tflops: float, gemm_efficiency: float = 0.7) -> Machine:
    """A validated :class:`Machine` from measurements."""
    inter = [g for (s, _), (g, _) in points.items() if s >= gpus_per_node]
    data = {"name": name, "description": f"measured by perfmodel profile on {datetime.date.today()}",
            "source": "perfmodel profile", "gpus_per_node": gpus_per_node,
            "device_memory_gb": round(device_memory_gb, 2), "gemm_tflops": round(gemm_tflops, 2),
            "gemm_efficiency": gemm_efficiency,
            "latency_us": round(statistics.median(a for _, a in points.values()) * 1e6, 2),
            "bandwidth": []}
    if inter:
        data["inter_node_gbps"] = round(min(inter), 2)
    data["bandwidth"] = [{"stride": list(e.stride), "size": list(e.size), "gbps": e.gbps,
                          "latency_us": e.latency_us} for e in coverage_table(points)]
    return machine_from_dict(data, "<profile>")


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="perfmodel profile", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="machine_profile.yaml", help="YAML written by rank 0")
    ap.add_argument("--name", default="profiled", help="machine name in the file")
    ap.add_argument("--sizes-mb", default="4,16,64", help="message sizes in MB (logical n), comma separated")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--gemm-n", type=int, default=8192, help="GEMM size n for the n^3 rate (CPU: use ~1024)")
    ap.add_argument("--gemm-efficiency", type=float, default=0.7)
    ap.add_argument("--gpus-per-node", type=int, default=None, help="default: LOCAL_WORLD_SIZE or CUDA devices")
    ap.add_argument("--device-memory-gb", type=float, default=None, help="default: the device's memory")
    ap.add_argument("--backend", default="auto")
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
    if world < 2:
        raise ValueError("perfmodel profile needs at least 2 ranks to measure collectives")
    sizes = [float(v) for v in opts.sizes_mb.split(",") if v.strip()]
    points = measure_links(world, rank, device, sizes, opts.iters, opts.warmup, log)
    tflops = measure_gemm(device, opts.gemm_n)
    log(f"GEMM {opts.gemm_n}^3: {tflops:.1f} TFLOP/s")
    gpn = opts.gpus_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", 0)) or max(1, torch.cuda.device_count())
    mem = opts.device_memory_gb or _device_memory_gb(device)
    m = build_machine(points, name=opts.name, gpus_per_node=min(gpn, world), device_memory_gb=mem,
                      gemm_tflops=tflops, gemm_efficiency=opts.gemm_efficiency)
    if rank != 0:
        return None
    header = (f"Measured by `python -m perfmodel profile` on {datetime.datetime.now():%Y-%m-%d %H:%M}: "
              f"{world} ranks, device {device}, message sizes {opts.sizes_mb} MB, {opts.iters} iterations.\n"
              f"gbps/latency_us per entry: ring alpha-beta fit, median over all-gather, reduce-scatter, all-reduce.")
    dump_machine(m, opts.out, header)
    log(f"wrote {opts.out}")
    return m


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``perfmodel profile``: uses an initialised torch.distributed,
    else initialises it with :func:`launch.bootstrap.init_distributed`."""
    opts = _parser().parse_args(argv)
    import torch
    import torch.distributed as dist
    ours = False
    try:
        if dist.is_available() and dist.is_initialized():
            rank, world = dist.get_rank(), dist.get_world_size()
            device = (torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available()
                      else torch.device("cpu"))
        else:
            from launch.bootstrap import init_distributed
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
            from launch.bootstrap import shutdown
            shutdown()
    return 0
