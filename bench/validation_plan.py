"""Issue 26's preregistered validation of the performance model (docs/perfmodel_validation_plan.md).

    sudo python -m bench.validation_plan measure [--only H1,H3] [--out runs/validation26]
    python -m bench.validation_plan report [--out runs/validation26] [--doc docs/perfmodel_validation.md]
    sudo python -m bench.validation_plan measure --smoke   # tiny model, 1 round: the plumbing only
    sudo python -m bench.validation_plan measure --budget 900 --resume   # what fits in 15 min, then the rest

``measure``: each held-out configuration of :data:`HELDOUT` (none used while building the model),
one after the other, with :mod:`bench.validate_perfmodel` on :mod:`launch.vcluster`: the cluster
profiled by ``perfmodel profile`` at the start of its run, every grid of its world (with
``orders='traffic'`` also each grid in its busiest-axis-first order) trained interleaved,
:data:`ROUNDS` rounds of :data:`STEPS` steps, the first :data:`WARMUP` of every visit left out.
Before each configuration the 1-minute load average must be below :data:`QUIET_LOAD` (waits up
to ``--wait`` seconds, else stops: exit 2); the load during each run is recorded.

``report``: per configuration Spearman's rho of predicted against measured step time, its 95%
bootstrap interval (:func:`bench.validation_stats.bootstrap_rho`, :data:`REPS` replicates, seed
:data:`SEED`), the same for the alpha-beta baseline and for rho - rho_baseline; then the verdict of
the preregistered bound (:func:`verdict`). Exit 0 when the bound is met, 1 when not, 2 on errors.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

#: the held-out configurations: virtual cluster, link, rank orders, model (over validate_perfmodel's MODEL_SETS)
HELDOUT: dict[str, dict[str, Any]] = {
    "H1": {
        "nodes": 2,
        "ranks_per_node": 2,
        "rate": "1gbit",
        "orders": "default",
        "sets": ["model.n_layer=2", "model.n_embd=256", "model.n_head=8", "model.seq_len=128", "train.global_batch=16"],
    },
    "H2": {
        "nodes": 4,
        "ranks_per_node": 1,
        "rate": "500mbit",
        "orders": "default",
        "sets": ["model.n_layer=3", "model.n_embd=384", "model.n_head=6", "model.seq_len=128", "train.global_batch=8"],
    },
    "H3": {
        "nodes": 2,
        "ranks_per_node": 2,
        "rate": "2gbit",
        "orders": "traffic",
        "sets": ["model.n_layer=2", "model.n_embd=320", "model.n_head=8", "model.seq_len=192", "train.global_batch=8"],
    },
    "H4": {
        "nodes": 4,
        "ranks_per_node": 1,
        "rate": "1gbit",
        "orders": "traffic",
        "sets": ["model.n_layer=4", "model.n_embd=224", "model.n_head=4", "model.seq_len=256", "train.global_batch=8"],
    },
}
ROUNDS, STEPS, WARMUP = 5, 4, 1
#: seconds a configuration is expected to take on a quiet machine, before one has been measured
#: (profile and sweep; only for ``--budget``: which fit in a quiet window)
EXPECTED_S = {"H1": 300.0, "H2": 360.0, "H3": 420.0, "H4": 480.0}
REPS, SEED = 10000, 26
#: the bound: every configuration's rho at least this, and the mean rho - rho_baseline's 95% interval above 0
RHO_MIN = 0.80
QUIET_LOAD = 2.5
SMOKE_SETS = ["model.n_layer=1", "model.n_embd=32", "model.n_head=4", "model.seq_len=16", "train.global_batch=8"]


def argv_of(name: str, out: Path, smoke: bool = False) -> list[str]:
    """:mod:`bench.validate_perfmodel`'s arguments for configuration ``name``."""
    h = HELDOUT[name]
    args = ["--out", str(out / name), "--nodes", str(h["nodes"]), "--ranks-per-node", str(h["ranks_per_node"])]
    args += ["--rate", h["rate"], "--orders", h["orders"]]
    args += ["--rounds", "1" if smoke else str(ROUNDS), "--steps", "2" if smoke else str(STEPS)]
    args += ["--warmup", str(WARMUP)]
    for s in SMOKE_SETS if smoke else h["sets"]:
        args += ["--set", s]
    return args


def wait_quiet(limit_s: float, log: Any = print) -> float:
    """Wait until the 1-minute load average is below :data:`QUIET_LOAD` (at most ``limit_s``); the load."""
    t0 = time.time()
    while True:
        load = os.getloadavg()[0]
        if load < QUIET_LOAD or time.time() - t0 >= limit_s:
            return load
        log(f"validation_plan: load average {load:.2f} >= {QUIET_LOAD}: waiting for a quiet machine")
        time.sleep(30)


def measured(out: Path, name: str) -> bool:
    """Whether ``out/name/results.json`` holds a complete measurement (every run exited 0)."""
    try:
        res = json.loads((out / name / "results.json").read_text())
    except (OSError, ValueError):
        return False
    return bool(res.get("runs")) and all(r.get("rc") == 0 for r in res["runs"].values())


def fits(name: str, elapsed_s: float, budget_s: float, taken: dict[str, float]) -> bool:
    """Whether configuration ``name`` is expected to finish within ``budget_s`` (0: no budget)
    after ``elapsed_s``: its :data:`EXPECTED_S` scaled by the largest taken/expected of the
    configurations measured so far (``taken``: name -> seconds)."""
    scale = max((t / EXPECTED_S[n] for n, t in taken.items()), default=1.0)
    return budget_s <= 0 or elapsed_s + EXPECTED_S[name] * scale <= budget_s


def measure(a: argparse.Namespace) -> int:
    """Measure the configurations in turn; with ``--budget`` stop before one that would not fit
    (named: measure them later into the same ``--out``), with ``--resume`` skip those already
    measured there (their durations scale what the rest is expected to take). Which run is
    decided by durations and files only, never by a result."""
    from bench.validate_perfmodel import main as validate

    out = Path(a.out)
    start, taken, left, failed = time.time(), {}, [], []
    for name in a.only.split(",") if a.only else HELDOUT:
        if a.resume and measured(out, name):
            print(f"validation_plan: {name}: already measured in {out / name} (--resume)", flush=True)
            if _attempt_record(out, name).get("seconds"):  # how long it took scales what is expected
                taken[name] = float(_attempt_record(out, name)["seconds"])
            continue
        if left:
            left.append(name)
            continue
        # waiting for a quiet machine takes from the window too
        load = wait_quiet(a.wait if a.budget <= 0 else max(0.0, min(a.wait, a.budget - (time.time() - start))))
        if not fits(name, time.time() - start, a.budget, taken):
            left.append(name)
            continue
        if load >= QUIET_LOAD and not a.force:
            print(f"validation_plan: load average {load:.2f} >= {QUIET_LOAD}: not measuring {name}", file=sys.stderr)
            return 2
        t0 = time.time()
        for attempt in (1, 2):  # the plan: a run that fails is re-run once, and the re-run reported
            rc = validate(argv_of(name, out, a.smoke))
            ok = rc != 2 and measured(out, name)
            note = "" if ok else (": failed, re-running once" if attempt == 1 else ": failed twice")
            print(f"validation_plan: {name}: attempt {attempt} exit {rc}{note} (load before {load:.2f})", flush=True)
            rec = {"attempts": attempt, "exit": rc, "ok": ok, "seconds": round(time.time() - t0, 1)}
            (out / name).mkdir(parents=True, exist_ok=True)
            (out / name / "attempts.json").write_text(json.dumps(rec))
            if ok:
                break
        taken[name] = time.time() - t0
        print(f"validation_plan: {name}: {taken[name]:.0f} s", flush=True)
        failed += [] if ok else [name]
    if left:
        print(
            f"validation_plan: not measured within the budget of {a.budget:.0f} s: {', '.join(left)}; measure them "
            f"in another quiet window: measure --only {','.join(left)} --out {out}",
            flush=True,
        )
    if failed:
        print(f"validation_plan: failed twice: {', '.join(failed)}", file=sys.stderr)
        return 2
    return 0


def scored(out: Path, name: str) -> tuple[dict, dict]:
    """``(results record, score with bootstrap intervals)`` of configuration ``name``."""
    from bench.validate_predict import GPUS_PER_NODE, predict, score

    res = json.loads((out / name / "results.json").read_text())
    runs = {s: r for s, r in res["runs"].items() if r.get("rc") == 0}
    world = res.get("nodes", 2) * res.get("ranks_per_node", GPUS_PER_NODE)
    pred = predict(res["machine_file"], res.get("extra_sets"), world, res.get("ranks_per_node"), list(runs))
    return res, score({s: r["median_s"] for s, r in runs.items()}, pred, {s: r["times"] for s, r in runs.items()})


def verdict(per: dict[str, dict], pooled: tuple[float, float, float]) -> tuple[bool, list[str]]:
    """The preregistered bound: every configuration's rho >= :data:`RHO_MIN`, and the lower end of
    the 95% interval of the mean rho - rho_baseline above 0; ``(met, reasons it is not)``."""
    bad = [f"{n}: rho {sc['spearman']:.3f} < {RHO_MIN}" for n, sc in per.items() if not sc["spearman"] >= RHO_MIN]
    if not pooled[1] > 0:
        bad.append(
            f"mean rho - rho_baseline {pooled[0]:.3f}, 95% interval [{pooled[1]:.3f}, {pooled[2]:.3f}] reaches 0"
        )
    return not bad, bad


def report(a: argparse.Namespace) -> int:
    from bench.validation_stats import pooled_delta

    out = Path(a.out)
    names = [n for n in (a.only.split(",") if a.only else HELDOUT) if (out / n / "results.json").exists()]
    if not names:
        print(f"validation_plan: no results.json under {out}", file=sys.stderr)
        return 2
    per, rows, sets = {}, [], []
    for n in names:
        res, sc = scored(out, n)
        per[n] = sc
        p = [r["predicted_s"] for r in sc["rows"]]
        b = [r["baseline_s"] for r in sc["rows"]]
        steps = [res["runs"][r["grid"]]["times"] for r in sc["rows"]]
        sets.append((p, b, steps))
        ci = sc["bootstrap"]
        logs = [abs(math.log(r["predicted_s"] / r["measured_s"])) for r in sc["rows"]]
        h = HELDOUT[n]
        rerun = " (re-run)" if _attempts(out, n) > 1 else ""
        rows.append(
            f"| {n}{rerun} | {h['nodes']} x {h['ranks_per_node']}, {h['rate']}, orders {h['orders']}; "
            f"`{' '.join(res.get('extra_sets', []))}` | {len(sc['rows'])} | {_ci(ci['model'])} | {_ci(ci['baseline'])} "
            f"| {_ci(ci['delta'])} | {'yes' if sc['best_in_top2'] else 'no'} | {sum(logs) / len(logs):.3f} "
            f"| {res.get('load_start', '?')} / {res.get('load_measure', {}).get('max', '?')} |"
        )
    pooled = pooled_delta(sets, REPS, SEED)
    met, bad = verdict(per, pooled)
    missing = [n for n in HELDOUT if n not in per]
    if missing:  # the bound is over all the held-out configurations
        met, bad = False, bad + [f"incomplete: {', '.join(missing)} not measured"]
    text = "\n".join(
        [
            "| configuration | cluster, link, orders; model | configs | rho model [95%] | rho baseline [95%] "
            "| rho - baseline [95%] | fastest in top 2 | mean abs log(pred/meas) | load before / max during |",
            "|---|---|---:|---|---|---|---|---:|---|",
            *rows,
            "",
            f"Mean rho - rho_baseline over {len(names)} configurations: {_ci(pooled)}.",
            f"**Preregistered bound (every rho >= {RHO_MIN}; the mean difference's 95% interval above 0): "
            + ("met.**" if met else "NOT met** (" + "; ".join(bad) + ")."),
        ]
    )
    print(text)
    if a.doc:
        from bench.validate_perfmodel import write_doc

        write_doc(Path(a.doc), text, "issue26-validation")
    return 0 if met else 1


def _attempt_record(out: Path, name: str) -> dict:
    """``out/name/attempts.json``: attempts, exit status, ok, seconds (``{}`` when absent)."""
    try:
        rec = json.loads((out / name / "attempts.json").read_text())
    except (OSError, ValueError):
        return {}
    return rec if isinstance(rec, dict) else {}


def _attempts(out: Path, name: str) -> int:
    return int(_attempt_record(out, name).get("attempts", 1))


def _ci(v: tuple[float, float, float]) -> str:
    return f"{v[0]:.3f} [{v[1]:.3f}, {v[2]:.3f}]"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m bench.validation_plan",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("what", choices=("measure", "report"))
    ap.add_argument("--out", default="runs/validation26")
    ap.add_argument("--only", default="", help="comma-separated configurations (default: all of HELDOUT)")
    ap.add_argument("--doc", default="", help="report: write the table into this markdown file")
    ap.add_argument("--wait", type=float, default=1800, help="measure: seconds to wait for a quiet machine")
    ap.add_argument("--force", action="store_true", help="measure even when the machine is not quiet")
    ap.add_argument("--smoke", action="store_true", help="tiny model, one round: the plumbing only")
    ap.add_argument(
        "--budget", type=float, default=0, help="measure: seconds; start no configuration that would not fit (0: none)"
    )
    ap.add_argument("--resume", action="store_true", help="measure: skip configurations already measured in --out")
    a = ap.parse_args(argv)
    try:
        return measure(a) if a.what == "measure" else report(a)
    except (OSError, ValueError, RuntimeError, KeyError) as e:
        print(f"bench.validation_plan: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
