"""The local CPU proof of a weak-scaling series (``python -m launch.weak_scaling local``): ``tiny``
trained with ``launch.local`` on 1, 2, 4, 8 CPU ranks (global batch scaled with the ranks) and
predicted by ``perfmodel`` with a "cpu-local" machine of this machine's measured GEMM rate, then
collected into a table (:func:`launch.weak_scaling_table.collect`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

from launch import job as jobgen
from launch.weak_scaling_table import Row, WeakScalingError, collect

FIXED_GRIDS = {1: "data=1", 2: "x=2", 4: "x=2,z=2", 8: "data=2,x=2,z=2"}


def cpu_gemm_tflops(n: int = 256, windows: int = 5, seconds: float = 0.1) -> float:
    """Measured fp32 GEMM rate of one thread on this machine (TFLOP/s): the best of a few short
    windows, so that other processes on a shared machine disturb it less."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        a, b = torch.randn(n, n), torch.randn(n, n)
        a @ b
        best = 0.0
        for _ in range(windows):
            reps, t0 = 0, time.perf_counter()
            while time.perf_counter() - t0 < seconds:
                a @ b
                reps += 1
            best = max(best, 2 * n**3 * reps / (time.perf_counter() - t0) / 1e12)
        return best
    finally:
        torch.set_num_threads(threads)


def cpu_machine(ranks: int, gemm_tflops: float, cores: int | None = None) -> Any:
    """A "cpu-local" machine: ``ranks`` CPU ranks on one node sharing ``cores`` cores.

    GEMM rate per rank: the measured single-thread rate times min(1, cores/ranks). Bandwidth
    (2 GB/s) and latency (50 us) of gloo over loopback are assumptions, not measurements.
    """
    from perfmodel.machine import machine_from_dict

    cores = cores or len(os.sched_getaffinity(0))
    mem_gb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return machine_from_dict(
        {
            "name": "cpu-local",
            "description": f"this machine: {ranks} CPU ranks on {cores} cores",
            "gpus_per_node": ranks,
            "device_memory_gb": round(mem_gb / ranks, 2),
            "gemm_tflops": gemm_tflops * min(1.0, cores / ranks),
            "gemm_efficiency": 1.0,
            "latency_us": 50,
            "bandwidth": [{"stride": [1, None], "size": [2, None], "gbps": 2.0}],
        },
        src="cpu-local",
    )


def _run(cmd: list[str], env: dict, log: Path, timeout: float) -> int:
    with open(log, "w") as f:
        try:
            return subprocess.run(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            return 124


def _estimate(model: Any, n: int, batch: int, machine: Any, grids: str) -> Any:
    """The perfmodel estimate of one point: the best feasible grid (``grids="auto"``) or the fixed one."""
    from axo4d.facts.grid import Grid
    from perfmodel.model import estimate_auto, rank_grids

    if grids == "auto":
        return next(e for e in rank_grids(model, n, n, batch, machine, checkpointing=False) if e.feasible)
    return estimate_auto(model, Grid.parse(FIXED_GRIDS.get(n, f"data={n}")), batch, machine, False)


def _train_cmd(n: int, config: str, grid: str, run_dir: Path, batch: int, steps: int) -> list[str]:
    """The ``launch.local`` command line of one point's training run."""
    return [
        sys.executable,
        "-m",
        "launch.local",
        "-n",
        str(n),
        "--",
        "axo4d.train",
        "--config",
        config,
        "--grid",
        grid,
        "--out",
        str(run_dir),
        "--set",
        f"train.global_batch={batch}",
        "--set",
        f"train.steps={steps}",
        "--set",
        "train.eval_interval=0",
        "--set",
        "checkpoint.at_end=false",
        "--set",
        "checkpoint.interval=0",
    ]


def _notes(
    points: list[dict], cores: int, rate: float, config: str, steps: int, skip: int, batch_per_rank: int
) -> tuple[str, ...]:
    """The table's notes: the setup, what the prediction models, what % of peak means."""
    loads = ", ".join(f"{p['gpus']}: {p['load_after']:.1f}" for p in points)
    return (
        f"Setup: {cores} CPU core(s) shared with other work (1-minute load average after each point, by "
        f"ranks: {loads}), gloo, OMP_NUM_THREADS=1, "
        f"{steps} steps, the first {skip} left out. Weak scaling: the same model ({config}) and "
        f"{batch_per_rank} samples per rank (global batch = {batch_per_rank} x ranks). With more ranks "
        f"than cores the ranks share cores, so the ideal efficiency here is min(1, cores/ranks).",
        f"Predicted: perfmodel with a 'cpu-local' machine: measured one-thread fp32 GEMM rate "
        f"({rate * 1e3:.3g} GFLOP/s, times cores/ranks when oversubscribed) and an assumed 2 GB/s, 50 us "
        f"loopback network. Per-operation overheads (Python, small kernels, LayerNorm, softmax, optimizer) "
        f"are not modelled, which dominate a model this small.",
        "% of peak: of the fp32 GEMM rate each run measures at start-up (peak_tflops in metrics.jsonl).",
    )


def _write_manifest(
    out: Path, points: list[dict], notes: tuple[str, ...], rate: float, config: str, steps: int, batch_per_rank: int
) -> None:
    """Write the series' ``manifest.json`` for :func:`collect`."""
    title = f"Weak scaling on this machine (CPU ranks, {config}, {batch_per_rank} samples per rank)"
    manifest = {
        "machine": "cpu-local",
        "launcher": "launch.local",
        "steps": steps,
        "peak_tflops": rate,
        "title": title,
        "notes": notes,
        "points": points,
        "skipped": [],
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")


def run_local(
    ranks: list[int],
    steps: int,
    out: str | os.PathLike,
    *,
    config: str = "tiny",
    batch_per_rank: int = 8,
    grids: str = "fixed",
    skip: int = 2,
    timeout: float = 900,
    docs: str | None = None,
    runner: Callable[[list[str], dict, Path, float], int] = _run,
) -> list[Row]:
    """Train ``config`` on each rank count with ``launch.local``, collect the table (also to
    ``docs``.md/.png when given)."""
    from axo4d.config import load_config

    out = Path(out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    model, rate, cores = load_config(config).model, cpu_gemm_tflops(), len(os.sched_getaffinity(0))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(jobgen.REPO_ROOT))
    points = []
    for n in ranks:
        m, batch = cpu_machine(n, rate, cores), batch_per_rank * n
        est = _estimate(model, n, batch, m, grids)
        run_dir = out / f"r{n}"
        cmd = _train_cmd(n, config, est.grid.spec(), run_dir, batch, steps)
        run_dir.mkdir(parents=True, exist_ok=True)
        print(f"weak_scaling local: {n} rank(s), grid {est.grid.spec()}, global batch {batch}", flush=True)
        if (rc := runner(cmd, env, out / f"r{n}.log", timeout)) != 0:
            raise WeakScalingError(f"the run on {n} rank(s) failed with status {rc}; see {out / f'r{n}.log'}")
        pred = dict(est.to_dict(), model=config, gpus=n, global_batch=batch, gemm_tflops=m.gemm_tflops)
        points.append(
            {
                "nodes": 1,
                "gpus": n,
                "model": config,
                "grid": est.grid.spec(),
                "run_dir": str(run_dir),
                "prediction": pred,
                "load_after": os.getloadavg()[0],
            }
        )
    notes = _notes(points, cores, rate, config, steps, skip, batch_per_rank)
    _write_manifest(out, points, notes, rate, config, steps, batch_per_rank)
    return collect(out, skip=skip, docs=docs)
