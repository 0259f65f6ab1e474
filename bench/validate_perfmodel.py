"""Validate the performance model's grid ranking on a virtual cluster, beside an alpha-beta baseline.

    sudo python -m bench.validate_perfmodel [--out runs/validate] [--doc docs/perfmodel_validation.md]
    sudo python -m bench.validate_perfmodel --nodes 2 --ranks-per-node 2 --orders traffic --set model.n_embd=192 ...
    python -m bench.validate_perfmodel --from-json runs/validate/results.json --machine runs/validate/machine.yaml

On :mod:`launch.vcluster` (``--nodes`` namespaces x ``--ranks-per-node`` ranks, the inter-node
veth shaped to 1 Gbit/s): ``perfmodel profile`` writes a machine YAML (links, the model's local
GEMM shapes, attention, streaming, overlap and concurrency figures); then a small GPT
(:data:`MODEL_SETS` plus ``--set``) trains on every grid of the world the model divides on (with
``--orders traffic`` each grid also in its busiest-axis-first order), interleaved
(:mod:`bench.perfmodel_sweep`). The measured step time of a configuration is the median of its
steps after the warm-up. The model predicts the same configurations with the profiled machine;
the report gives per-configuration predicted vs measured, the Spearman rank correlation, whether
the measured fastest is in the predicted top 2, and the same for the **baseline**: the bare
alpha-beta sum of every collective, no compute (``comm_total_s``). ``results.json`` records the
sha256 of every ``perfmodel`` source and of the machine file used (what was frozen).
``--from-json`` re-scores stored measurements (no cluster).
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import math
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

from bench.loadavg import LoadSampler
from bench.perfmodel_sweep import grid_dir, split_spec
from bench.validation_stats import bootstrap_rho, median_step_time, misordered, ranks, spearman

ROOT = Path(__file__).resolve().parent.parent
CONFIG = "tiny"
#: The validated model: 2 layers, hidden 128, 8 heads, 64 tokens, batch 16 (fp32 on CPU).
MODEL_SETS: tuple[str, ...] = (
    "model.n_layer=2",
    "model.n_embd=128",
    "model.n_head=8",
    "model.vocab_size=256",
    "model.seq_len=64",
    "model.vocab_multiple=8",
    "train.global_batch=16",
    "train.dtype=fp32",
)
#: Keep runs short and side-effect free (no tuner timing, no checkpoint, one eval batch, no GEMM probe).
RUN_SETS: tuple[str, ...] = (
    "train.eval_interval=0",
    "train.eval_batches=1",
    "train.peak_tflops=1.0",
    "parallel.tuner=false",
    "checkpoint.at_end=false",
)
PROFILE_ARGS: tuple[str, ...] = (
    "--sizes-mb",
    "0.001,0.25,4",
    "--iters",
    "6",
    "--warmup",
    "1",
    "--repeats",
    "3",
    "--gemm-n",
    "256",
    "--name",
    "vcluster-cpu",
)
GPUS_PER_NODE = 4
WORLD = 8


# ---- prediction ------------------------------------------------------------------------
def model_config(extra: list[str] | None = None) -> Any:
    from axo4d.config import load_config

    return load_config(CONFIG, list(MODEL_SETS) + list(extra or []))


def model_yaml(path: Path, extra: list[str] | None = None) -> Path:
    """The validated model as a config YAML (``perfmodel profile --model``)."""
    import yaml

    from axo4d.config import config_to_dict

    cfg = model_config(extra)
    path.write_text(
        yaml.safe_dump({"model": config_to_dict(cfg.model), "train": {"global_batch": cfg.train.global_batch}})
    )
    return path


def predict(
    machine_path: str,
    extra: list[str] | None = None,
    world: int = WORLD,
    gpn: int = GPUS_PER_NODE,
    configs: list[str] | None = None,
) -> dict[str, Any]:
    """Estimates keyed by configuration (``grid`` or ``grid|order``): every grid of ``world`` ranks
    (infeasible ones included), and ``configs`` when given."""
    from axo4d.facts.grid import Grid
    from axo4d.facts.spec import Dtypes
    from perfmodel.machine import load_machine
    from perfmodel.model import estimate, rank_grids

    cfg = model_config(extra)
    m = load_machine(machine_path)
    kw = dict(dtypes=Dtypes.for_compute("fp32"), dp_bucket_mb=cfg.parallel.dp_bucket_mb, gpus_per_node=gpn)
    out = {
        e.grid.spec(): e
        for e in rank_grids(
            cfg.model,
            world,
            gpn,
            cfg.train.global_batch,
            m,
            checkpointing=False,
            **{k: v for k, v in kw.items() if k != "gpus_per_node"},
        )
    }
    for c in configs or []:
        if c not in out:
            grid, _, order = c.partition("|")
            out[c] = estimate(cfg.model, Grid.parse(grid, order or None), cfg.train.global_batch, m, **kw)
    return out


def configurations(
    specs: list[str], orders: str, extra: list[str] | None, machine_path: str | None = None
) -> list[str]:
    """Grids (``orders='default'``), or each grid and its traffic order where it differs."""
    if orders == "default":
        return list(specs)
    from axo4d.facts.grid import Grid
    from axo4d.facts.spec import Dtypes
    from perfmodel.machine import load_machine
    from perfmodel.model import estimate
    from perfmodel.search import traffic_order

    cfg = model_config(extra)
    m = load_machine(machine_path or "perlmutter")  # bytes decide the order, not the links
    out = []
    for s in specs:
        g = Grid.parse(s)
        e = estimate(cfg.model, g, cfg.train.global_batch, m, dtypes=Dtypes.for_compute("fp32"))
        o = traffic_order(g, e.comm_s)
        out.append(s)
        if [a for a in o if g.size(a) > 1] != [a for a in g.order if g.size(a) > 1]:
            out.append(f"{s}|{','.join(o)}")
    return out


def score(
    measured: dict[str, float], pred: dict[str, Any], steps: dict[str, list[float]] | None = None
) -> dict[str, Any]:
    """Rows sorted by measured time, Spearman and the top-2 check, for the model and for the
    alpha-beta baseline (``comm_total_s``); the spread of log(predicted/measured); with ``steps``
    (each configuration's step times) the bootstrap intervals of rho, rho_baseline and their
    difference (:func:`bench.validation_stats.bootstrap_rho`)."""
    specs = [s for s in measured if s in pred]
    p = [pred[s].step_time_s for s in specs]
    base = [pred[s].comm_total_s for s in specs]
    m = [measured[s] for s in specs]
    pr, mr, br = ranks(p), ranks(m), ranks(base)
    rows = sorted(
        (
            {
                "grid": s,
                "predicted_s": p[i],
                "measured_s": m[i],
                "pred_rank": pr[i],
                "meas_rank": mr[i],
                "baseline_s": base[i],
                "base_rank": br[i],
                "compute_s": pred[s].compute_s,
                "exposed_comm_s": pred[s].exposed_comm_s,
            }
            for i, s in enumerate(specs)
        ),
        key=lambda r: r["measured_s"],
    )
    best = rows[0]["grid"] if rows else ""
    top2 = sorted(specs, key=lambda s: pred[s].step_time_s)[:2]
    btop2 = sorted(specs, key=lambda s: pred[s].comm_total_s)[:2]
    logs = [math.log(a / b) for a, b in zip(p, m) if a > 0 and b > 0]
    mean = sum(logs) / len(logs) if logs else float("nan")
    sd = (sum((x - mean) ** 2 for x in logs) / max(1, len(logs) - 1)) ** 0.5 if logs else float("nan")
    ok = steps is not None and len(specs) >= 3 and all(steps.get(s) for s in specs)
    ci = bootstrap_rho(p, base, [steps[s] for s in specs]) if ok else {}
    return {
        "rows": rows,
        "bootstrap": ci,
        "spearman": spearman(p, m) if len(specs) > 1 else float("nan"),
        "measured_best": best,
        "predicted_top2": top2,
        "best_in_top2": best in top2,
        "baseline_spearman": spearman(base, m) if len(specs) > 1 else float("nan"),
        "baseline_top2": btop2,
        "baseline_best_in_top2": best in btop2,
        "log_ratio_mean": mean,
        "log_ratio_sd": sd,
        "misordered": misordered(p, m),
    }


def prediction_sources(extra: list[str] | None = None, world: int = WORLD, gpn: int = GPUS_PER_NODE) -> list[Path]:
    """Every source file of this checkout a prediction reads: the modules a fresh interpreter has
    imported after :func:`predict` (perfmodel, the axo4d model facts, config, grid, ... and these
    benchmark modules), found by running one."""
    import subprocess

    code = (
        "import json, sys\n"
        "import bench.validate_perfmodel as v\n"
        f"v.predict('perlmutter', {list(extra or [])!r}, {world}, {min(gpn, 4)})\n"
        "print(json.dumps(sorted({m.__file__ for m in list(sys.modules.values()) if getattr(m, '__file__', None)})))\n"
    )
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    files = [Path(f).resolve() for f in json.loads(out.stdout.strip().splitlines()[-1])]
    return sorted(f for f in files if ROOT in f.parents and ".venv" not in f.parts and f.suffix == ".py")


def frozen_record(
    machine: str | None = None, extra: list[str] | None = None, world: int = WORLD, gpn: int = GPUS_PER_NODE
) -> dict[str, str]:
    """sha256 (first 16 hex) of every source file a prediction reads (:func:`prediction_sources`:
    perfmodel and the axo4d modules it imports) and of the machine file: what was frozen."""
    files = prediction_sources(extra, world, gpn) + ([Path(machine)] if machine else [])
    return {
        str(f.relative_to(ROOT) if f.is_absolute() and ROOT in f.parents else f): hashlib.sha256(
            f.read_bytes()
        ).hexdigest()[:16]
        for f in files
        if f.exists()
    }


# ---- measurement on the virtual cluster ------------------------------------------------
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


def report_text(res: dict[str, Any], sc: dict[str, Any], machine: str) -> str:
    """Markdown: settings, what was frozen, the per-configuration table and the verdict."""
    from perfmodel.machine import load_machine

    m = load_machine(machine)
    g_, c_, conc = m.slowdowns()
    load = (
        f"; 1-min load average {res['load_start']} at the start, {res['load_end']} at the end"
        + (f", during the sweep {res['load_measure']}" if "load_measure" in res else " (the host is shared)")
        if "load_start" in res
        else ""
    )
    nodes, rpn = res.get("nodes", 2), res.get("ranks_per_node", 4)
    lines = [
        f"- command: `{res['command']}`",
        f"- date: {res['date']}",
        f"- host: {res['host']}{load}",
        f"- virtual cluster: {nodes} nodes (network namespaces) x {rpn} ranks; inter-node veth: "
        f"{res.get('link', '?')}; rank orders: {res.get('orders', 'default')}",
        f"- model: `{' '.join(MODEL_SETS)}` (plus `{' '.join(res.get('extra_sets', [])) or '-'}`), " + _how(res),
        f"- machine file: `{machine}`: GEMM table {len(m.gemm_table)} shapes (curve {m.gemm_tflops * 1e3:.1f} "
        f"GFLOP/s, half-speed dimension {m.gemm_half_dim:g}), attention {m.attention_tflops or 0:.4g} TFLOP/s, "
        f"latency {m.latency_us:.0f} us, inter-node {m.inter_gbps * 8:.2f} Gbit/s per group, "
        f"{m.op_overhead_us:.1f} us per operator, {m.memory_gbps or 0:.2f} GB/s elementwise, slowdowns: "
        f"compute x{g_:g}, collectives x{c_:g}, concurrent x{conc['intra']:g} / x{conc['inter']:g}",
    ]
    if res.get("frozen"):
        lines.append(
            "- frozen before measuring (sha256, first 16 hex): "
            + ", ".join(f"`{k}` {v}" for k, v in res["frozen"].items())
        )
    lines += [
        "",
        "| configuration | measured s/step | predicted s/step | pred/meas | measured rank | predicted rank "
        "| baseline rank | pred. compute s | pred. exposed comm s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in sc["rows"]:
        lines.append(
            f"| {r['grid']} | {r['measured_s']:.3f} | {r['predicted_s']:.3f} | "
            f"{r['predicted_s'] / r['measured_s']:.2f} | {r['meas_rank']:g} | {r['pred_rank']:g} | "
            f"{r['base_rank']:g} | {r['compute_s']:.3f} | {r['exposed_comm_s']:.3f} |"
        )
    ci = sc.get("bootstrap") or {}
    if ci:
        f = lambda k: f"{ci[k][0]:.3f} [{ci[k][1]:.3f}, {ci[k][2]:.3f}]"  # noqa: E731
        lines += [
            "",
            f"Spearman rho with 95% bootstrap intervals: model {f('model')}, baseline {f('baseline')}, "
            f"model - baseline {f('delta')}.",
        ]
    failed = [s for s, r in res["runs"].items() if r.get("rc") != 0]
    wrong = [ok for _, ok in sc["misordered"]]
    close = [ok for ratio, ok in sc["misordered"] if ratio < 1 + m.uncertainty]
    lines += [
        "",
        f"**Spearman rank correlation: model {sc['spearman']:.3f}, alpha-beta baseline "
        f"{sc['baseline_spearman']:.3f}** (target >= 0.9) over {len(sc['rows'])} configurations.",
        f"**Measured fastest: {sc['measured_best']}; model's top 2: {', '.join(sc['predicted_top2'])} -> "
        f"{'in the top 2' if sc['best_in_top2'] else 'NOT in the top 2'}; baseline's top 2: "
        f"{', '.join(sc['baseline_top2'])} -> {'in' if sc['baseline_best_in_top2'] else 'NOT in'}.**",
        f"Predicted/measured: geometric mean {math.exp(sc['log_ratio_mean']):.2f}, log-ratio sd "
        f"{sc['log_ratio_sd']:.2f}. Pairs ordered as measured: {sum(wrong)}/{len(wrong)}; among pairs the "
        f"model puts within its uncertainty ({100 * m.uncertainty:.0f}%): {sum(close)}/{len(close)}.",
    ]
    if failed:
        lines.append(f"Runs that failed (excluded): {', '.join(failed)}.")
    if res.get("changed_since"):
        lines.append(f"Re-scored with model sources changed since the measurement: {', '.join(res['changed_since'])}.")
    return "\n".join(lines)


def _how(res: dict[str, Any]) -> str:
    if res.get("mode") == "interleaved":
        return (
            f"interleaved sweep (`bench.perfmodel_sweep`): {res['rounds']} rounds x {res['steps']} steps per "
            f"grid, the first {res['warmup']} of every visit left out, median of the rest "
            f"({res.get('measure_wall_s', 0):.0f} s for all grids)"
        )
    return (
        f"one `python -m axo4d.train` run per grid, {res['steps']} steps, median of the steps after "
        f"{res['warmup']} warm-up steps"
    )


BEGIN, END = "<!-- results:begin -->", "<!-- results:end -->"


def write_doc(path: Path, text: str, tag: str = "results") -> None:
    """Replace the generated block ``<!-- tag:begin -->`` .. ``<!-- tag:end -->`` of ``path``
    (appended, the file created with a heading if missing)."""
    begin, end = f"<!-- {tag}:begin -->", f"<!-- {tag}:end -->"
    block = f"{begin}\n{text}\n{end}"
    old = path.read_text() if path.exists() else "# Performance model validation\n\n"
    if begin in old and end in old:
        new = old[: old.index(begin)] + block + old[old.index(end) + len(end) :]
    else:
        new = old.rstrip("\n") + "\n\n" + block + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(new)


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m bench.validate_perfmodel",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument(
        "--mode",
        choices=("interleaved", "train"),
        default="interleaved",
        help="interleaved: one launch, every grid in rounds (bench.perfmodel_sweep; default); "
        "train: one `python -m axo4d.train` per grid",
    )
    ap.add_argument("--rounds", type=int, default=5, help="interleaved: rounds over all grids (default 5)")
    ap.add_argument(
        "--steps",
        type=int,
        default=None,
        help="steps per grid and round (interleaved, default 4) or per run (train, default 10)",
    )
    ap.add_argument(
        "--warmup",
        type=int,
        default=None,
        help="steps left out of the median: of every visit (interleaved, default 1) or of the run (train, default 3)",
    )
    ap.add_argument("--out", default="runs/validate", help="folder of runs, machine.yaml, results.json")
    ap.add_argument("--machine", default=None, help="use this machine YAML instead of profiling")
    ap.add_argument("--from-json", default=None, help="re-score stored results.json (no cluster needed)")
    ap.add_argument("--doc", default=None, help="write the result table into this markdown file")
    ap.add_argument("--rate", default="1gbit")
    ap.add_argument("--delay", default="0.2ms")
    ap.add_argument("--timeout", type=float, default=1200, help="seconds per launch (default 1200)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="extra config override")
    ap.add_argument("--nodes", type=int, default=2, help="virtual nodes (default 2)")
    ap.add_argument("--ranks-per-node", type=int, default=GPUS_PER_NODE, help="ranks per node (default 4)")
    ap.add_argument("--oversubscribe", action="store_true", help="allow more than two ranks per core")
    ap.add_argument(
        "--orders",
        choices=("default", "traffic"),
        default="default",
        help="traffic: also each grid in its busiest-axis-first rank order",
    )
    return ap


def main(argv: list[str] | None = None) -> int:
    """Exit 0 when the targets are met (Spearman >= 0.9, best in top 2), 1 if not, 2 on errors."""
    argv = sys.argv[1:] if argv is None else list(argv)
    opts = _parser().parse_args(argv)
    opts.argv = argv
    inter = opts.mode == "interleaved"
    opts.steps = opts.steps if opts.steps is not None else (4 if inter else 10)
    opts.warmup = opts.warmup if opts.warmup is not None else (1 if inter else 3)
    cores = os.cpu_count() or 1
    if not opts.from_json and opts.nodes * opts.ranks_per_node > 2 * cores and not opts.oversubscribe:
        print(
            f"bench.validate_perfmodel: error: {opts.nodes} nodes x {opts.ranks_per_node} ranks on {cores} cores: more "
            f"than two ranks per core measures the scheduler, not the model; use at most {2 * cores} ranks "
            f"(or --oversubscribe)",
            file=sys.stderr,
        )
        return 2
    try:
        if opts.from_json:
            res = json.loads(Path(opts.from_json).read_text())
        else:
            out = Path(opts.out)
            out.mkdir(parents=True, exist_ok=True)
            res = measure_all(opts, out)
        machine = opts.machine or res["machine_file"]
        measured = {s: r["median_s"] for s, r in res["runs"].items() if r.get("rc") == 0}
        steps = {s: r["times"] for s, r in res["runs"].items() if r.get("rc") == 0 and r.get("times")}
        world = res.get("nodes", 2) * res.get("ranks_per_node", GPUS_PER_NODE)
        if opts.from_json:
            now = frozen_record(None, res.get("extra_sets"), world, res.get("ranks_per_node", GPUS_PER_NODE))
            res["changed_since"] = sorted(k for k, v in res.get("frozen", {}).items() if k in now and now[k] != v)
        sc = score(
            measured,
            predict(machine, res.get("extra_sets"), world, res.get("ranks_per_node", GPUS_PER_NODE), list(measured)),
            steps,
        )
    except (OSError, ValueError, RuntimeError) as e:
        print(f"bench.validate_perfmodel: error: {e}", file=sys.stderr)
        return 2
    text = report_text(res, sc, machine)
    print(text)
    if opts.doc:
        doc = Path(opts.doc)
        if not opts.from_json:  # keep the profiled machine next to the table it produced
            keep = doc.with_name(doc.stem + "_machine.yaml")
            keep.write_text(Path(machine).read_text())
            text = text.replace(f"`{machine}`", f"`{keep.name}` (copied from `{machine}`)")
        write_doc(doc, text)
    return 0 if sc["spearman"] >= 0.9 and sc["best_in_top2"] else 1


if __name__ == "__main__":
    sys.exit(main())
