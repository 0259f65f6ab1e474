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
import os
import statistics
import sys
from typing import Any

from .groups import group_shapes, shape_grid
from .link_timing import Work, measure_gemm, measure_host, measure_links
from .machine import GIB, Machine, dump_machine
from .profile_fit import CPU_SLOWDOWNS, build_machine, coverage_table, fit_alpha_beta


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
