"""The measurement side of :mod:`bench.validate_perfmodel`: ``perfmodel profile`` and a training
run of every grid on :mod:`launch.vcluster` (interleaved in rounds, or one after the other), the
median step time of each after its warm-up.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

from bench.loadavg import LoadSampler
from bench.perfmodel_sweep import grid_dir, split_spec
from bench.validate_predict import (
    CONFIG,
    MODEL_SETS,
    PROFILE_ARGS,
    ROOT,
    RUN_SETS,
    WORLD,
    configurations,
    frozen_record,
    model_config,
    model_yaml,
)
from bench.validation_stats import median_step_time


def _env() -> dict[str, str]:
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")


def profile(vc: Any, out: Path, timeout: float, extra: list[str] | None = None) -> None:
    """``perfmodel profile`` on the cluster, with the validated model's GEMM shapes."""
    yml = model_yaml(out.with_name("model.yaml"), extra)
    cmd = [
        sys.executable,
        "-u",
        "-m",
        "perfmodel",
        "profile",
        "--out",
        str(out),
        *PROFILE_ARGS,
        "--model",
        str(yml),
        "--batch",
        str(model_config(extra).train.global_batch),
    ]
    rc = vc.run(cmd, timeout=timeout, env=_env())
    if rc != 0 or not out.exists():
        raise RuntimeError(f"perfmodel profile failed (exit {rc})")


def train_grid(vc: Any, spec: str, out: Path, steps: int, extra: list[str], timeout: float) -> int:
    """One training run of ``spec`` on the virtual cluster (output in ``out``)."""
    grid, order = split_spec(spec)
    sets = [*MODEL_SETS, *RUN_SETS, f"train.steps={steps}", *extra, *order]
    cmd = [sys.executable, "-u", "-m", "axo4d.train", "--config", CONFIG, "--grid", grid, "--out", str(out)]
    for s in sets:
        cmd += ["--set", s]
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "stdout.txt", "w") as log:
        return vc.run(cmd, timeout=timeout, env=_env(), log=log)


def feasible_specs(extra: list[str] | None = None, world: int = WORLD) -> list[str]:
    """Grids of ``world`` ranks the model builds on (the perf model's divisibility check)."""
    from axo4d.facts.archs import model_spec
    from axo4d.facts.grid import all_grids

    cfg = model_config(extra)
    return [
        g.spec() for g in all_grids(world) if not model_spec(cfg.model, g).divisibility_reasons(cfg.train.global_batch)
    ]


def measure_all(opts: argparse.Namespace, out: Path, log: Any = print) -> dict[str, Any]:
    """Profile, then train every grid, on one virtual cluster; returns the results record."""
    from launch.vcluster import VCluster
    from launch.vcluster_commands import Spec

    extra = list(opts.set)
    res: dict[str, Any] = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "command": "python -m bench.validate_perfmodel " + " ".join(opts.argv),
        "mode": opts.mode,
        "steps": opts.steps,
        "warmup": opts.warmup,
        "rounds": opts.rounds,
        "extra_sets": extra,
        "host": host_description(),
        "runs": {},
        "load_start": round(os.getloadavg()[0], 1),
        "nodes": opts.nodes,
        "ranks_per_node": opts.ranks_per_node,
        "orders": opts.orders,
    }
    machine = Path(opts.machine) if opts.machine else out / "machine.yaml"
    world = opts.nodes * opts.ranks_per_node
    res["frozen"] = frozen_record(None, extra, world, opts.ranks_per_node)  # before anything is measured
    with VCluster(Spec(opts.nodes, opts.ranks_per_node, opts.rate, opts.delay)) as vc:
        res["link"] = vc.shaping
        if not opts.machine:
            t0 = time.time()
            with LoadSampler() as load:
                profile(vc, machine, opts.timeout, extra)
            res["load_profile"] = load.summary()
            log(f"profile: {time.time() - t0:.0f} s -> {machine} (load {res['load_profile']})")
        res["machine_file"] = str(machine)
        res["frozen"].update(frozen_record(str(machine), extra, world, opts.ranks_per_node))
        specs = configurations(feasible_specs(extra, world), opts.orders, extra, str(machine))
        t0 = time.time()
        with LoadSampler() as load:
            rcs = (
                _interleaved(vc, specs, out, opts) if opts.mode == "interleaved" else _one_by_one(vc, specs, out, opts)
            )
        res["load_measure"] = load.summary()
        res["measure_wall_s"] = round(time.time() - t0, 1)
    res["load_end"] = round(os.getloadavg()[0], 1)
    for spec in specs:
        rec: dict[str, Any] = {"rc": rcs[spec], "dir": str(grid_dir(out / "runs", spec))}
        if rcs[spec] == 0:
            rec["median_s"], rec["times"] = median_step_time(Path(rec["dir"]) / "metrics.jsonl", opts.warmup)
        res["runs"][spec] = rec
    (out / "results.json").write_text(json.dumps(res, indent=1))
    return res


def _interleaved(vc: Any, specs: list[str], out: Path, opts: argparse.Namespace) -> dict[str, int]:
    """All grids in one launch of :mod:`bench.perfmodel_sweep` (rounds, rotating order)."""
    cmd = [
        sys.executable,
        "-u",
        "-m",
        "bench.perfmodel_sweep",
        "--out",
        str(out / "runs"),
        "--grids",
        ";".join(specs),
        "--rounds",
        str(opts.rounds),
        "--steps",
        str(opts.steps),
        "--warmup",
        str(opts.warmup),
    ]
    for s in [*MODEL_SETS, *RUN_SETS, *opts.set]:
        cmd += ["--set", s]
    rc = vc.run(cmd, timeout=opts.timeout, env=_env())
    return {s: rc for s in specs}


def _one_by_one(vc: Any, specs: list[str], out: Path, opts: argparse.Namespace) -> dict[str, int]:
    """One ``python -m axo4d.train`` per grid (startup of 8 ranks each time)."""
    rcs = {}
    for spec in specs:
        t0 = time.time()
        rcs[spec] = train_grid(vc, spec, grid_dir(out / "runs", spec), opts.steps, list(opts.set), opts.timeout)
        print(f"{spec:24s} rc {rcs[spec]} ({time.time() - t0:.0f} s)", flush=True)
    return rcs


def host_description() -> str:
    """CPU model, core count, kernel, torch version."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import torch

    return (
        f"{cpu}, {os.cpu_count()} logical CPUs, Linux {platform.release()}, Python {platform.python_version()}, "
        f"torch {torch.__version__} (gloo, OMP_NUM_THREADS=1 per rank)"
    )
