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
Details and the definitions of every column: ``jobs/README.md``. The table:
:mod:`launch.weak_scaling_table`; the local proof: :mod:`launch.weak_scaling_local`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
from pathlib import Path

from launch import job as jobgen
from launch.weak_scaling_local import run_local
from launch.weak_scaling_table import WeakScalingError, collect

LADDER = ("gpt-5b", "gpt-10b", "gpt-20b", "gpt-40b", "gpt-80b", "gpt-160b", "gpt-320b", "gpt-640b")


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


# ---- generate -----------------------------------------------------------------------------
def _plan_point(
    req: jobgen.JobRequest, tag: str, steps: int, time_limit: str | None, skipped: list[dict]
) -> jobgen.JobPlan | None:
    """The job plan of one point (its time limit from the prediction when none is given), or None
    (recorded in ``skipped`` and reported) when it has no feasible grid."""
    try:
        plan = jobgen.plan_job(req)
    except jobgen.JobError as e:
        skipped.append({"nodes": req.nodes, "model": req.model, "error": str(e)})
        print(f"weak_scaling: skipping {tag}: {e}", file=sys.stderr)
        return None
    if time_limit is None:
        minutes = max(30, math.ceil((900 + 2 * steps * plan.estimate.step_time_s) / 60))
        plan.request = dataclasses.replace(req, time=f"{minutes // 60:02d}:{minutes % 60:02d}:00")
    return plan


def _write_point(plan: jobgen.JobPlan, req: jobgen.JobRequest, tag: str, out: Path) -> dict:
    """Write one point's job script and prediction; returns its manifest entry."""
    script = jobgen.write_script(jobgen.render(plan), out / f"{tag}{'.sbatch' if req.launcher == 'slurm' else '.sh'}")
    pred = dict(
        plan.estimate.to_dict(),
        model=req.model,
        nodes=req.nodes,
        gpus=plan.ntasks,
        machine=plan.machine.name,
        gemm_tflops=plan.machine.gemm_tflops,
    )
    (out / f"{tag}.prediction.json").write_text(json.dumps(pred, indent=1) + "\n")
    return {
        "nodes": req.nodes,
        "gpus": plan.ntasks,
        "model": req.model,
        "grid": plan.grid.spec(),
        "script": script.name,
        "run_dir": req.run_dir,
        "prediction": pred,
    }


def _write_submit(out: Path, launcher: str, points: list[dict]) -> None:
    """Write ``submit_all.sh``, which submits (or runs) every point's script in order."""
    submit = [
        "#!/bin/bash",
        "# Submit the weak-scaling series (generated by launch.weak_scaling).",
        "set -e",
        f"cd {jobgen.shlex.quote(str(out))}",
    ]
    submit += [f"sbatch {p['script']}" if launcher == "slurm" else f"bash {p['script']}" for p in points]
    jobgen.write_script("\n".join(submit) + "\n", out / "submit_all.sh")


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
        plan = _plan_point(req, tag, steps, time_limit, skipped)
        if plan is not None:
            points.append(_write_point(plan, req, tag, out))
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
    _write_submit(out, launcher, points)
    return manifest


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
