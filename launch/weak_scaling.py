"""Weak-scaling studies: generate the job series, run a local CPU proof, collect the table.

    python -m launch.weak_scaling generate --machine frontier --nodes 8,16,32,64 --out jobs/weak/frontier
    python -m launch.weak_scaling collect jobs/weak/frontier            # after the jobs ran
    python -m launch.weak_scaling local --ranks 1,2,4,8 --steps 6 --out runs/weak_local

``generate`` pairs each node count with a model of AxoNN's weak-scaling family (docs/design.md
section 6): ``gpt-5b`` at the smallest point, the next size (about twice the parameters) per
doubling of the GPUs, up to ``gpt-640b``; the global batch stays fixed, so the work per GPU
stays constant. ``collect`` turns the runs' ``metrics.jsonl`` into a table (measured beside
predicted, weak-scaling efficiency vs the smallest point) and a plot. ``local`` runs the
pipeline on this machine with CPU ranks (``tiny``, global batch scaled with the ranks).
Details and the definitions of every column: ``jobs/README.md``.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import math
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from launch import job as jobgen

LADDER = ("gpt-5b", "gpt-10b", "gpt-20b", "gpt-40b", "gpt-80b", "gpt-160b", "gpt-320b", "gpt-640b")
FIXED_GRIDS = {1: "data=1", 2: "x=2", 4: "x=2,z=2", 8: "data=2,x=2,z=2"}


class WeakScalingError(ValueError):
    """A weak-scaling series that cannot be built or collected."""


def parse_int_list(text: str, what: str) -> list[int]:
    """``'8,16,32'`` -> ``[8, 16, 32]`` (ascending, distinct, >= 1)."""
    try:
        vals = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise WeakScalingError(f"{what} {text!r}: expected comma-separated integers, e.g. 8,16,32") from None
    if not vals or min(vals) < 1 or sorted(set(vals)) != vals:
        raise WeakScalingError(f"{what} {text!r}: need distinct ascending integers >= 1")
    return vals


def model_ladder(nodes: list[int], models: list[str] | None = None, ladder: tuple[str, ...] = LADDER) -> list[str]:
    """The model of each point: ``models`` as given, or the ladder step log2(nodes/nodes[0])."""
    if models:
        if len(models) != len(nodes):
            raise WeakScalingError(f"--models lists {len(models)} models for {len(nodes)} node counts")
        return list(models)
    out = []
    for n in nodes:
        step = math.log2(n / nodes[0])
        if not step.is_integer():
            raise WeakScalingError(
                f"{n} nodes is not a power-of-two multiple of the smallest point ({nodes[0]} nodes); "
                f"the model doubles per doubling of GPUs, so use such counts or name the models with --models"
            )
        if int(step) >= len(ladder):
            raise WeakScalingError(
                f"{n} nodes would need the model after {ladder[-1]} "
                f"({len(ladder)} sizes, {nodes[0]}..{nodes[0] * 2 ** (len(ladder) - 1)} nodes)"
            )
        out.append(ladder[int(step)])
    return out


# ---- collecting runs into a table -------------------------------------------------------------
@dataclass
class Row:
    """One point of the table; measured fields are None when the run has no usable metrics."""

    gpus: int
    model: str
    grid: str
    steps: int = 0
    step_time_s: float | None = None
    tflops_per_gpu: float | None = None
    peak_tflops: float | None = None
    pred_step_time_s: float | None = None
    pred_tflops_per_gpu: float | None = None
    efficiency: float | None = None
    note: str = ""

    @property
    def pct_peak(self) -> float | None:
        ok = self.tflops_per_gpu is not None and self.peak_tflops
        return 100 * self.tflops_per_gpu / self.peak_tflops if ok else None


def read_metrics(path: str | os.PathLike) -> list[dict]:
    """The records of a ``metrics.jsonl`` (one JSON object per line)."""
    recs = []
    for i, line in enumerate(Path(path).read_text().splitlines(), 1):
        if line.strip():
            try:
                recs.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise WeakScalingError(f"{path}:{i}: not a JSON object ({e.msg})") from None
    return recs


def summarize(records: list[dict], skip: int) -> dict | None:
    """Mean step time and TFLOP/s per GPU after the first ``skip`` steps (None if none are left).

    TFLOP/s per GPU = mean(TFLOP per GPU per step) / mean(step time), the per-step TFLOP being
    ``tflops_per_device * step_time_s`` of each record (the trainer's FLOP count).
    """
    kept = sorted((r for r in records if "step_time_s" in r), key=lambda r: r.get("step", 0))[skip:]
    if not kept:
        return None
    t = sum(r["step_time_s"] for r in kept) / len(kept)
    flop = sum(r.get("tflops_per_device", 0.0) * r["step_time_s"] for r in kept) / len(kept)
    return {
        "steps": len(kept),
        "step_time_s": t,
        "tflop_per_step": flop,
        "tflops_per_gpu": flop / t,
        # the vendor's peak on a GPU; a CPU has none, then the GEMM rate the run measured at start-up
        "peak_tflops": kept[-1].get("peak_tflops") or kept[-1].get("gemm_ceiling_tflops"),
        "grid": kept[-1].get("grid"),
    }


def collect_rows(
    points: list[tuple[int, str, str, Path, dict | None]], skip: int, default_peak: float | None = None
) -> list[Row]:
    """Rows for ``(gpus, model, grid, run_dir, prediction)`` points, sorted by GPUs, with
    weak-scaling efficiency relative to the smallest measured point."""
    rows = []
    for gpus, model, grid, run_dir, pred in sorted(points, key=lambda p: p[0]):
        row, mfile = Row(gpus, model, grid), Path(run_dir) / "metrics.jsonl"
        s = summarize(read_metrics(mfile), skip) if mfile.is_file() else None
        if s is None:
            row.note = "no metrics.jsonl" if not mfile.is_file() else f"no steps after skipping {skip}"
        else:
            row.steps, row.step_time_s, row.tflops_per_gpu = s["steps"], s["step_time_s"], s["tflops_per_gpu"]
            row.grid = s["grid"] or grid
            row.peak_tflops = s["peak_tflops"] or default_peak
        if pred:
            row.pred_step_time_s = pred["step_time_s"]
            row.pred_tflops_per_gpu = s["tflop_per_step"] / pred["step_time_s"] if s else pred.get("tflops_per_gpu")
            row.peak_tflops = row.peak_tflops or pred.get("gemm_tflops")
        rows.append(row)
    ref = next((r for r in rows if r.tflops_per_gpu), None)
    for r in rows:
        if ref and r.tflops_per_gpu is not None:
            r.efficiency = r.tflops_per_gpu / ref.tflops_per_gpu
    return rows


COLUMNS = (
    "GPUs",
    "model",
    "grid",
    "steps",
    "time/step (s)",
    "predicted (s)",
    "TFLOP/s/GPU",
    "predicted TFLOP/s/GPU",
    "% of peak",
    "weak-scaling eff.",
)


def _cells(r: Row) -> list[str]:
    def f(v: float | None, fmt: str) -> str:
        return "—" if v is None else format(v, fmt)

    return [
        str(r.gpus),
        r.model,
        r.grid,
        str(r.steps or "—"),
        f(r.step_time_s, ".4g"),
        f(r.pred_step_time_s, ".4g"),
        f(r.tflops_per_gpu, ".4g"),
        f(r.pred_tflops_per_gpu, ".4g"),
        f(r.pct_peak, ".1f"),
        "—" if r.efficiency is None else f"{100 * r.efficiency:.1f}%",
    ]


def markdown(rows: list[Row], title: str, extra: tuple[str, ...] = ()) -> str:
    """The table as markdown, with a note on how each column is computed."""
    lines = [f"## {title}", "", "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(_cells(r)) + " |" for r in rows]
    notes = [f"GPUs {r.gpus}: {r.note}" for r in rows if r.note]
    lines += (
        [
            "",
            "time/step: mean over the steps after the warm-up ones; TFLOP/s/GPU: the trainer's FLOPs "
            "per step / mean step time / GPUs; % of peak: of the peak in metrics.jsonl; weak-scaling eff.: "
            "TFLOP/s/GPU relative to the smallest measured point; predicted: perfmodel step time (predicted "
            "TFLOP/s/GPU uses the same FLOP count as the measurement).",
        ]
        + notes
        + list(extra)
    )
    return "\n".join(lines)


def write_csv(rows: list[Row], path: str | os.PathLike) -> None:
    keys = (
        "gpus",
        "model",
        "grid",
        "steps",
        "step_time_s",
        "pred_step_time_s",
        "tflops_per_gpu",
        "pred_tflops_per_gpu",
        "pct_peak",
        "efficiency",
        "note",
    )
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(keys)
        for r in rows:
            w.writerow(["" if getattr(r, k) is None else getattr(r, k) for k in keys])


def plot(rows: list[Row], path: str | os.PathLike, title: str) -> None:
    """Measured and predicted TFLOP/s per GPU against GPUs (log2 axis)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for attr, style, label in (("tflops_per_gpu", "o-", "measured"), ("pred_tflops_per_gpu", "s--", "predicted")):
        pts = [(r.gpus, getattr(r, attr)) for r in rows if getattr(r, attr) is not None]
        if pts:
            ax.plot(*zip(*pts), style, label=label)
    for r in rows if len({r.model for r in rows}) > 1 else ():
        y = r.tflops_per_gpu if r.tflops_per_gpu is not None else r.pred_tflops_per_gpu
        if y is not None:
            ax.annotate(r.model, (r.gpus, y), textcoords="offset points", xytext=(4, 6), fontsize=7)
    ax.set_xscale("log", base=2)
    ax.set_xticks([r.gpus for r in rows], [str(r.gpus) for r in rows])
    ax.set_xlabel("GPUs (ranks)")
    ax.set_ylabel("TFLOP/s per GPU")
    ys = [v for r in rows for v in (r.tflops_per_gpu, r.pred_tflops_per_gpu) if v]
    if ys and max(ys) > 20 * min(ys):
        ax.set_yscale("log")  # measured and predicted far apart: keep both readable
    else:
        ax.set_ylim(bottom=0)
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_outputs(rows: list[Row], prefix: Path, title: str, notes: tuple[str, ...] = ()) -> None:
    """``prefix.md``, ``prefix.csv``, ``prefix.png``; the markdown is also printed."""
    prefix.parent.mkdir(parents=True, exist_ok=True)
    md = markdown(rows, title, notes)
    Path(f"{prefix}.md").write_text(md + "\n")
    write_csv(rows, f"{prefix}.csv")
    plot(rows, f"{prefix}.png", title)
    print(md)
    print(f"\nwrote {prefix}.md, {prefix}.csv, {prefix}.png")


# ---- generate -----------------------------------------------------------------------------
def generate(
    machine: str,
    nodes: list[int],
    out: str | os.PathLike,
    *,
    models: list[str] | None = None,
    batch: int | None = None,
    steps: int = 20,
    launcher: str = "slurm",
    time_limit: str | None = None,
    account: str | None = None,
    sets: tuple[str, ...] = (),
) -> dict:
    """Write one job script and prediction per point plus ``manifest.json``; returns the manifest.

    ``time_limit`` None: per point, 15 minutes for start-up plus twice the predicted time of the
    steps, at least 30 minutes."""
    out = Path(out).resolve()
    names = model_ladder(nodes, models)
    bench = (f"train.steps={steps}", "train.eval_interval=0", "checkpoint.at_end=false", "checkpoint.interval=0")
    points, skipped = [], []
    for n, model in zip(nodes, names):
        tag = f"{machine}-{model}-{n}n"
        req = jobgen.JobRequest(
            machine=machine,
            model=model,
            nodes=n,
            batch=batch,
            launcher=launcher,
            time=time_limit or "00:30:00",
            account=account,
            sets=bench + tuple(sets),
            run_dir=str(out / "runs" / tag),
            job_name=f"ws-{model}-{n}n",
            command=f"python -m launch.weak_scaling generate (point {tag})",
        )
        try:
            plan = jobgen.plan_job(req)
        except jobgen.JobError as e:
            skipped.append({"nodes": n, "model": model, "error": str(e)})
            print(f"weak_scaling: skipping {tag}: {e}", file=sys.stderr)
            continue
        if time_limit is None:
            minutes = max(30, math.ceil((900 + 2 * steps * plan.estimate.step_time_s) / 60))
            plan.request = dataclasses.replace(req, time=f"{minutes // 60:02d}:{minutes % 60:02d}:00")
        script = jobgen.write_script(jobgen.render(plan), out / f"{tag}{'.sbatch' if launcher == 'slurm' else '.sh'}")
        pred = dict(
            plan.estimate.to_dict(),
            model=model,
            nodes=n,
            gpus=plan.ntasks,
            machine=plan.machine.name,
            gemm_tflops=plan.machine.gemm_tflops,
        )
        (out / f"{tag}.prediction.json").write_text(json.dumps(pred, indent=1) + "\n")
        points.append(
            {
                "nodes": n,
                "gpus": plan.ntasks,
                "model": model,
                "grid": plan.grid.spec(),
                "script": script.name,
                "run_dir": req.run_dir,
                "prediction": pred,
            }
        )
    if not points:
        raise WeakScalingError("no point of the series has a feasible grid; see the messages above")
    manifest = {
        "machine": machine,
        "launcher": launcher,
        "steps": steps,
        "peak_tflops": points[0]["prediction"]["gemm_tflops"],
        "points": points,
        "skipped": skipped,
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    submit = [
        "#!/bin/bash",
        "# Submit the weak-scaling series (generated by launch.weak_scaling).",
        "set -e",
        f"cd {jobgen.shlex.quote(str(out))}",
    ]
    submit += [f"sbatch {p['script']}" if launcher == "slurm" else f"bash {p['script']}" for p in points]
    jobgen.write_script("\n".join(submit) + "\n", out / "submit_all.sh")
    return manifest


def rows_from_manifest(manifest: dict, skip: int) -> list[Row]:
    """Table rows for the points of a ``generate`` (or ``local``) manifest."""
    return collect_rows(
        [(p["gpus"], p["model"], p["grid"], Path(p["run_dir"]), p.get("prediction")) for p in manifest["points"]],
        skip=skip,
        default_peak=manifest.get("peak_tflops"),
    )


def collect(
    target: str | os.PathLike, skip: int = 2, out: str | os.PathLike | None = None, docs: str | None = None
) -> list[Row]:
    """Collect a manifest directory (``generate``/``local`` output) into table, CSV and plot
    (``out`` prefix, default ``DIR/weak_scaling``); ``docs``: also ``docs.md`` and ``docs.png``."""
    d = Path(target)
    mf = d / "manifest.json"
    if not mf.is_file():
        raise WeakScalingError(f"{mf} not found: give the directory written by `generate` or `local`")
    manifest = json.loads(mf.read_text())
    rows = rows_from_manifest(manifest, skip)
    title = manifest.get("title") or f"Weak scaling on {manifest['machine']}"
    notes = tuple(manifest.get("notes", ()))
    write_outputs(rows, Path(out) if out else d / "weak_scaling", title=title, notes=notes)
    if docs:
        Path(docs).parent.mkdir(parents=True, exist_ok=True)
        Path(f"{docs}.md").write_text(markdown(rows, title, notes) + "\n")
        plot(rows, f"{docs}.png", title)
        print(f"wrote {docs}.md, {docs}.png")
    return rows


# ---- local CPU proof ------------------------------------------------------------------------
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
    from axo4d.facts.grid import Grid
    from perfmodel.model import estimate_auto, rank_grids

    out = Path(out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    model, rate, cores = load_config(config).model, cpu_gemm_tflops(), len(os.sched_getaffinity(0))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(jobgen.REPO_ROOT))
    points = []
    for n in ranks:
        m, batch = cpu_machine(n, rate, cores), batch_per_rank * n
        if grids == "auto":
            est = next(e for e in rank_grids(model, n, n, batch, m, checkpointing=False) if e.feasible)
        else:
            est = estimate_auto(model, Grid.parse(FIXED_GRIDS.get(n, f"data={n}")), batch, m, False)
        run_dir = out / f"r{n}"
        cmd = [
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
            est.grid.spec(),
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
    loads = ", ".join(f"{p['gpus']}: {p['load_after']:.1f}" for p in points)
    notes = (
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
    return collect(out, skip=skip, docs=docs)


# ---- command line ---------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m launch.weak_scaling", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = ap.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("generate", help="write the job series, predictions and manifest.json")
    g.add_argument("--machine", required=True)
    g.add_argument("--nodes", required=True, help="comma-separated node counts, e.g. 8,16,32,64")
    g.add_argument("--models", default=None, help="one model per point (default: the 5b..640b ladder)")
    g.add_argument("--batch", type=int, default=None, help="global batch, same at every point (default: config's)")
    g.add_argument("--steps", type=int, default=20, help="training steps per job")
    g.add_argument("--launcher", choices=jobgen.LAUNCHERS, default="slurm")
    g.add_argument("--time", default=None, help="HH:MM:SS (default: from the prediction, at least 30 min)")
    g.add_argument("--account", default=None)
    g.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE")
    g.add_argument("--out", required=True, help="directory for scripts, predictions, manifest and runs/")
    c = sub.add_parser("collect", help="read the runs' metrics.jsonl into a table and plot")
    c.add_argument("dir", help="directory written by generate/local (holds manifest.json)")
    c.add_argument("--skip", type=int, default=2, help="warm-up steps left out of the averages")
    c.add_argument("--out", default=None, help="output prefix for .md/.csv/.png (default: DIR/weak_scaling)")
    c.add_argument("--docs", default=None, help="also write PREFIX.md and PREFIX.png (e.g. docs/weak_scaling_local)")
    lo = sub.add_parser("local", help="run the series on this machine with CPU ranks and collect it")
    lo.add_argument("--ranks", default="1,2,4,8")
    lo.add_argument("--steps", type=int, default=6)
    lo.add_argument("--config", default="tiny")
    lo.add_argument("--batch-per-rank", type=int, default=8)
    lo.add_argument("--grids", choices=("fixed", "auto"), default="fixed")
    lo.add_argument("--skip", type=int, default=2)
    lo.add_argument("--out", default="runs/weak_local")
    lo.add_argument("--docs", default=None, help="also write PREFIX.md and PREFIX.png (e.g. docs/weak_scaling_local)")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.cmd == "generate":
            m = generate(
                args.machine,
                parse_int_list(args.nodes, "--nodes"),
                args.out,
                models=args.models.split(",") if args.models else None,
                batch=args.batch,
                steps=args.steps,
                launcher=args.launcher,
                time_limit=args.time,
                account=args.account,
                sets=tuple(args.sets),
            )
            for p in m["points"]:
                pr = p["prediction"]
                print(
                    f"{p['gpus']:>6} GPUs  {p['model']:<9} {p['grid']:<26} predicted "
                    f"{pr['step_time_s']:.3f} s/step, {pr['tflops_per_gpu']:.1f} TFLOP/s/GPU  -> {p['script']}"
                )
            print(f"wrote {len(m['points'])} job(s) to {args.out}; submit with: bash {args.out}/submit_all.sh")
        elif args.cmd == "collect":
            collect(args.dir, skip=args.skip, out=args.out, docs=args.docs)
        else:
            run_local(
                parse_int_list(args.ranks, "--ranks"),
                args.steps,
                args.out,
                config=args.config,
                batch_per_rank=args.batch_per_rank,
                grids=args.grids,
                skip=args.skip,
                docs=args.docs,
            )
    except (WeakScalingError, jobgen.JobError) as e:
        print(f"weak_scaling: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
