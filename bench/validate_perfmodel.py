"""Validate the performance model's grid ranking on a virtual two-node cluster.

    sudo python -m bench.validate_perfmodel [--steps 10] [--out runs/validate] [--doc docs/perfmodel_validation.md]
    python -m bench.validate_perfmodel --from-json runs/validate/results.json --machine runs/validate/machine.yaml

On :mod:`launch.vcluster` (2 namespaces x 4 ranks, the inter-node veth shaped
to 1 Gbit/s): ``perfmodel profile`` writes a machine YAML; then a small GPT
(:data:`MODEL_SETS`) trains ``--steps`` steps on every 8-rank grid the model
divides on, each with ``python -m axo4d.train``. The measured step time of a
grid is the median of its steps after ``--warmup``. The model ranks the same
grids (:func:`perfmodel.model.rank_grids`, 4 GPUs a node, fp32 element sizes)
with the profiled machine; the report gives per-grid predicted vs measured,
the Spearman rank correlation and whether the measured fastest grid is in the
predicted top 2. ``--from-json`` re-scores stored measurements (no cluster).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from bench.perfmodel_sweep import grid_dir

ROOT = Path(__file__).resolve().parent.parent
CONFIG = "tiny"
#: The validated model: 2 layers, hidden 128, 8 heads, 64 tokens, batch 16 (fp32 on CPU).
MODEL_SETS: tuple[str, ...] = (
    "model.n_layer=2", "model.n_embd=128", "model.n_head=8", "model.vocab_size=256", "model.seq_len=64",
    "model.vocab_multiple=8", "train.global_batch=16", "train.dtype=fp32")
#: Keep runs short and side-effect free (no tuner timing, no checkpoint, one eval batch, no GEMM probe).
RUN_SETS: tuple[str, ...] = ("train.eval_interval=0", "train.eval_batches=1", "train.peak_tflops=1.0",
                             "parallel.tuner=false", "checkpoint.at_end=false")
PROFILE_ARGS: tuple[str, ...] = ("--sizes-mb", "0.001,0.25,4", "--iters", "6", "--warmup", "1", "--repeats", "3",
                                 "--gemm-n", "256", "--name", "vcluster-cpu")
GPUS_PER_NODE = 4


# ---- statistics (pure) ---------------------------------------------------------------
def ranks(values: list[float]) -> list[float]:
    """1-based ranks, ties get the average of their positions."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    out = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            out[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return out


def pearson(a: list[float], b: list[float]) -> float:
    """Pearson correlation of two equal-length lists (nan when either is constant)."""
    n = len(a)
    if n < 2 or n != len(b):
        raise ValueError("pearson: need two lists of equal length >= 2")
    ma, mb = sum(a) / n, sum(b) / n
    cov = sum((x - ma) * (y - mb) for x, y in zip(a, b))
    va, vb = sum((x - ma) ** 2 for x in a), sum((y - mb) ** 2 for y in b)
    return cov / (va * vb) ** 0.5 if va > 0 and vb > 0 else float("nan")


def spearman(a: list[float], b: list[float]) -> float:
    """Spearman rank correlation (Pearson on tie-averaged ranks)."""
    return pearson(ranks(a), ranks(b))


def median_step_time(metrics: Path, warmup: int) -> tuple[float, list[float]]:
    """Median ``step_time_s`` of a ``metrics.jsonl``, leaving out warm-up steps: records
    flagged ``warmup`` (interleaved sweeps), else the first ``warmup`` steps (axo4d.train)."""
    times = []
    for line in metrics.read_text().splitlines():
        rec = json.loads(line) if line.strip() else {}
        if "step_time_s" not in rec:
            continue
        skip = rec["warmup"] if "warmup" in rec else rec.get("step", 0) < warmup
        if not skip:
            times.append(float(rec["step_time_s"]))
    if not times:
        raise ValueError(f"{metrics}: no step times after the warm-up steps")
    return statistics.median(times), times


# ---- prediction ------------------------------------------------------------------------
def model_config(extra: list[str] | None = None) -> Any:
    from axo4d.config import load_config
    return load_config(CONFIG, list(MODEL_SETS) + list(extra or []))


def predict(machine_path: str, extra: list[str] | None = None) -> dict[str, Any]:
    """Estimates of every 8-rank grid, keyed by spec (infeasible ones included)."""
    from axo4d.spec import Dtypes
    from perfmodel.machine import load_machine
    from perfmodel.model import rank_grids
    cfg = model_config(extra)
    m = load_machine(machine_path)
    ests = rank_grids(cfg.model, 8, GPUS_PER_NODE, cfg.train.global_batch, m, checkpointing=False,
                      dtypes=Dtypes.for_compute("fp32"), dp_bucket_mb=cfg.parallel.dp_bucket_mb)
    return {e.grid.spec(): e for e in ests}


def score(measured: dict[str, float], pred: dict[str, Any]) -> dict[str, Any]:
    """Rows sorted by measured time, Spearman, and the top-2 check."""
    specs = [s for s in measured if s in pred]
    p = [pred[s].step_time_s for s in specs]
    m = [measured[s] for s in specs]
    pr, mr = ranks(p), ranks(m)
    rows = sorted(({"grid": s, "predicted_s": p[i], "measured_s": m[i], "pred_rank": pr[i], "meas_rank": mr[i],
                    "compute_s": pred[s].compute_s, "exposed_comm_s": pred[s].exposed_comm_s}
                   for i, s in enumerate(specs)), key=lambda r: r["measured_s"])
    best = rows[0]["grid"] if rows else ""
    top2 = sorted(specs, key=lambda s: pred[s].step_time_s)[:2]
    return {"rows": rows, "spearman": spearman(p, m) if len(specs) > 1 else float("nan"),
            "measured_best": best, "predicted_top2": top2, "best_in_top2": best in top2}


# ---- measurement on the virtual cluster ------------------------------------------------
def _env() -> dict[str, str]:
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")


def profile(vc: Any, out: Path, timeout: float) -> None:
    cmd = [sys.executable, "-u", "-m", "perfmodel", "profile", "--out", str(out), *PROFILE_ARGS]
    rc = vc.run(cmd, timeout=timeout, env=_env())
    if rc != 0 or not out.exists():
        raise RuntimeError(f"perfmodel profile failed (exit {rc})")


def train_grid(vc: Any, spec: str, out: Path, steps: int, extra: list[str], timeout: float) -> int:
    """One training run of ``spec`` on the virtual cluster (output in ``out``)."""
    sets = [*MODEL_SETS, *RUN_SETS, f"train.steps={steps}", *extra]
    cmd = [sys.executable, "-u", "-m", "axo4d.train", "--config", CONFIG, "--grid", spec, "--out", str(out)]
    for s in sets:
        cmd += ["--set", s]
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "stdout.txt", "w") as log:
        return vc.run(cmd, timeout=timeout, env=_env(), log=log)


def feasible_specs(extra: list[str] | None = None) -> list[str]:
    """8-rank grids the model builds on (the perf model's divisibility check)."""
    from axo4d.dist.grid import all_grids
    from axo4d.spec import model_spec
    cfg = model_config(extra)
    return [g.spec() for g in all_grids(8)
            if not model_spec(cfg.model, g).divisibility_reasons(cfg.train.global_batch)]


def measure_all(opts: argparse.Namespace, out: Path, log: Any = print) -> dict[str, Any]:
    """Profile, then train every grid, on one virtual cluster; returns the results record."""
    from launch.vcluster import Spec, VCluster
    extra = list(opts.set)
    res: dict[str, Any] = {"date": datetime.datetime.now().isoformat(timespec="seconds"),
                           "command": "python -m bench.validate_perfmodel " + " ".join(opts.argv),
                           "mode": opts.mode, "steps": opts.steps, "warmup": opts.warmup, "rounds": opts.rounds,
                           "extra_sets": extra, "host": host_description(), "runs": {},
                           "load_start": round(os.getloadavg()[0], 1)}
    machine = Path(opts.machine) if opts.machine else out / "machine.yaml"
    specs = feasible_specs(extra)
    with VCluster(Spec(2, 4, opts.rate, opts.delay)) as vc:
        res["link"] = vc.shaping
        if not opts.machine:
            t0 = time.time()
            profile(vc, machine, opts.timeout)
            log(f"profile: {time.time() - t0:.0f} s -> {machine}")
        res["machine_file"] = str(machine)
        t0 = time.time()
        rcs = _interleaved(vc, specs, out, opts) if opts.mode == "interleaved" else _one_by_one(vc, specs, out, opts)
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
    cmd = [sys.executable, "-u", "-m", "bench.perfmodel_sweep", "--out", str(out / "runs"), "--grids", ";".join(specs),
           "--rounds", str(opts.rounds), "--steps", str(opts.steps), "--warmup", str(opts.warmup)]
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
    return (f"{cpu}, {os.cpu_count()} logical CPUs, Linux {platform.release()}, Python {platform.python_version()}, "
            f"torch {torch.__version__} (gloo, OMP_NUM_THREADS=1 per rank)")


def report_text(res: dict[str, Any], sc: dict[str, Any], machine: str) -> str:
    """Markdown: settings, the per-grid table and the verdict."""
    from perfmodel.machine import load_machine
    m = load_machine(machine)
    load = (f"; 1-min load average {res['load_start']} at the start, {res['load_end']} at the end "
            f"(the host is shared)" if "load_start" in res else "")
    lines = [f"- command: `{res['command']}`", f"- date: {res['date']}", f"- host: {res['host']}{load}",
             f"- virtual cluster: 2 nodes (network namespaces) x 4 ranks; inter-node veth: {res.get('link', '?')}",
             f"- model: `{' '.join(MODEL_SETS)}` (plus `{' '.join(res.get('extra_sets', [])) or '-'}`), "
             + _how(res),
             f"- machine file: `{machine}`: GEMM {m.gemm_tflops * 1e3:.1f} GFLOP/s x {m.gemm_efficiency}, "
             f"latency {m.latency_us:.0f} us, inter-node {m.inter_gbps * 8:.2f} Gbit/s per group, "
             f"{m.op_overhead_us:.1f} us per operator, {m.memory_gbps or 0:.2f} GB/s elementwise, "
             f"overlap efficiency {m.overlap_efficiency:g}", "",
             "| grid | measured s/step | predicted s/step | pred/meas | measured rank | predicted rank | "
             "pred. compute s | pred. exposed comm s |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in sc["rows"]:
        lines.append(f"| {r['grid']} | {r['measured_s']:.3f} | {r['predicted_s']:.3f} | "
                     f"{r['predicted_s'] / r['measured_s']:.2f} | {r['meas_rank']:g} | {r['pred_rank']:g} | "
                     f"{r['compute_s']:.3f} | {r['exposed_comm_s']:.3f} |")
    failed = [s for s, r in res["runs"].items() if r.get("rc") != 0]
    lines += ["", f"**Spearman rank correlation: {sc['spearman']:.3f}** (target >= 0.9) over {len(sc['rows'])} grids.",
              f"**Measured fastest: {sc['measured_best']}; predicted top 2: {', '.join(sc['predicted_top2'])} -> "
              f"{'in the top 2' if sc['best_in_top2'] else 'NOT in the top 2'}.**"]
    if failed:
        lines.append(f"Runs that failed (excluded): {', '.join(failed)}.")
    return "\n".join(lines)


def _how(res: dict[str, Any]) -> str:
    if res.get("mode") == "interleaved":
        return (f"interleaved sweep (`bench.perfmodel_sweep`): {res['rounds']} rounds x {res['steps']} steps per "
                f"grid, the first {res['warmup']} of every visit left out, median of the rest "
                f"({res.get('measure_wall_s', 0):.0f} s for all grids)")
    return (f"one `python -m axo4d.train` run per grid, {res['steps']} steps, median of the steps after "
            f"{res['warmup']} warm-up steps")


BEGIN, END = "<!-- results:begin -->", "<!-- results:end -->"


def write_doc(path: Path, text: str) -> None:
    """Replace the generated block of ``path`` (created with a heading if missing)."""
    block = f"{BEGIN}\n{text}\n{END}"
    old = path.read_text() if path.exists() else "# Performance model validation\n\n"
    if BEGIN in old and END in old:
        new = old[:old.index(BEGIN)] + block + old[old.index(END) + len(END):]
    else:
        new = old.rstrip("\n") + "\n\n" + block + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(new)


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m bench.validate_perfmodel", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", choices=("interleaved", "train"), default="interleaved",
                    help="interleaved: one launch, every grid in rounds (bench.perfmodel_sweep; default); "
                         "train: one `python -m axo4d.train` per grid")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved: rounds over all grids (default 5)")
    ap.add_argument("--steps", type=int, default=None,
                    help="steps per grid and round (interleaved, default 4) or per run (train, default 10)")
    ap.add_argument("--warmup", type=int, default=None,
                    help="steps left out of the median: of every visit (interleaved, default 1) or of the run "
                         "(train, default 3)")
    ap.add_argument("--out", default="runs/validate", help="folder of runs, machine.yaml, results.json")
    ap.add_argument("--machine", default=None, help="use this machine YAML instead of profiling")
    ap.add_argument("--from-json", default=None, help="re-score stored results.json (no cluster needed)")
    ap.add_argument("--doc", default=None, help="write the result table into this markdown file")
    ap.add_argument("--rate", default="1gbit")
    ap.add_argument("--delay", default="0.2ms")
    ap.add_argument("--timeout", type=float, default=1200, help="seconds per launch (default 1200)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="extra config override")
    return ap


def main(argv: list[str] | None = None) -> int:
    """Exit 0 when the targets are met (Spearman >= 0.9, best in top 2), 1 if not, 2 on errors."""
    argv = sys.argv[1:] if argv is None else list(argv)
    opts = _parser().parse_args(argv)
    opts.argv = argv
    inter = opts.mode == "interleaved"
    opts.steps = opts.steps if opts.steps is not None else (4 if inter else 10)
    opts.warmup = opts.warmup if opts.warmup is not None else (1 if inter else 3)
    try:
        if opts.from_json:
            res = json.loads(Path(opts.from_json).read_text())
        else:
            out = Path(opts.out)
            out.mkdir(parents=True, exist_ok=True)
            res = measure_all(opts, out)
        machine = opts.machine or res["machine_file"]
        measured = {s: r["median_s"] for s, r in res["runs"].items() if r.get("rc") == 0}
        sc = score(measured, predict(machine, res.get("extra_sets")))
    except (OSError, ValueError, RuntimeError) as e:
        print(f"bench.validate_perfmodel: error: {e}", file=sys.stderr)
        return 2
    text = report_text(res, sc, machine)
    print(text)
    if opts.doc:
        doc = Path(opts.doc)
        if not opts.from_json:   # keep the profiled machine next to the table it produced
            keep = doc.with_name(doc.stem + "_machine.yaml")
            keep.write_text(Path(machine).read_text())
            text = text.replace(f"`{machine}`", f"`{keep.name}` (copied from `{machine}`)")
        write_doc(doc, text)
    return 0 if sc["spearman"] >= 0.9 and sc["best_in_top2"] else 1


if __name__ == "__main__":
    sys.exit(main())
