"""FP8 training against bf16 on the CPU: the same small GPT, data and seed, loss curves side by side.

    python -m bench.fp8_convergence                  # config small, 300 steps, 1 process, ~bf16 vs both recipes
    python -m bench.fp8_convergence --steps 20 --config tiny --out runs/fp8_smoke     # a smoke run
    python -m bench.fp8_convergence --ranks 4 --grid x=2,z=2   # the same on a grid (launch.local)
    python -m bench.fp8_convergence --reuse          # keep the runs under --out that finished

Runs ``python -m axo4d.train`` once in bf16 (``train.dtype=bf16``: autocast on the CPU) and once
per FP8 recipe (``train.fp8=<recipe>``, ``train.fp8_layers=all``: every linear layer, the LM head
included, since the rule ``auto`` leaves every layer of a model this small in bf16), all else
equal. Pass bound, stated before measuring: at every validation evaluation the FP8 run's loss is
within 2% of the bf16 run's, and so is the mean training loss of the last 50 steps. Writes
``<docs>/fp8_convergence.png`` (the curves) and ``<docs>/fp8_convergence.json`` (the figures),
prints a Markdown table; exit status 1 when a recipe misses the bound. A numerical result: the
load of the machine changes its wall time, not its figures.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from axo4d.training.plot import read_metrics

ROOT = Path(__file__).resolve().parents[1]
BOUND = 0.02
TAIL = 50


def _finished(out: Path, steps: int) -> bool:
    """Whether ``out`` holds a run that reached its last validation (``steps - 1``)."""
    if not (out / "metrics.jsonl").exists():
        return False
    _, val = read_metrics(out / "metrics.jsonl")
    return bool(val) and val[-1]["step"] == steps - 1


def _train(a: argparse.Namespace, out: Path, sets: list[str]) -> float | None:
    if a.reuse and _finished(out, a.steps):
        print(f"reusing the finished run in {out} (--reuse)", flush=True)
        return None
    sets = [f"train.steps={a.steps}", "train.dtype=bf16", *sets]
    head = [sys.executable, "-m"]
    if a.ranks > 1:
        head += ["launch.local", "-n", str(a.ranks), "--"]
    cmd = head + ["axo4d.train", "--config", a.config, "--out", str(out), "--grid", a.grid]
    cmd += [x for s in sets for x in ("--set", s)]
    print("running:", " ".join(cmd[1:]), flush=True)
    t0 = time.time()
    rc = subprocess.call(cmd, cwd=ROOT, stdout=subprocess.DEVNULL)
    if rc != 0:
        raise SystemExit(f"bench.fp8_convergence: training failed (exit {rc}): {' '.join(cmd)}")
    return time.time() - t0


def compare(base: Path, other: Path) -> dict:
    """Relative differences of ``other``'s losses from ``base``'s (metrics.jsonl of each)."""
    bt, bv = read_metrics(base)
    ot, ov = read_metrics(other)
    vals = {r["step"]: r["val_loss"] for r in bv}
    val = [(r["step"], vals[r["step"]], r["val_loss"]) for r in ov if r["step"] in vals]
    tail_b = sum(r["loss"] for r in bt[-TAIL:]) / len(bt[-TAIL:])
    tail_o = sum(r["loss"] for r in ot[-TAIL:]) / len(ot[-TAIL:])
    worst_val = max(abs(o / b - 1) for _, b, o in val)
    return {
        "val": [{"step": s, "bf16": b, "fp8": o, "rel": o / b - 1} for s, b, o in val],
        "train_tail_bf16": tail_b,
        "train_tail_fp8": tail_o,
        "train_tail_rel": tail_o / tail_b - 1,
        "max_val_rel": worst_val,
        "pass": worst_val <= BOUND and abs(tail_o / tail_b - 1) <= BOUND,
    }


def plot(runs: dict[str, Path], png: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.4))
    for name, path in runs.items():
        train, val = read_metrics(path)
        line = ax.plot([r["step"] for r in train], [r["loss"] for r in train], lw=0.8, alpha=0.8, label=f"{name} train")
        c = line[0].get_color()
        ax.plot([r["step"] for r in val], [r["val_loss"] for r in val], "o-", color=c, label=f"{name} val")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="small")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--recipes", default="tensorwise,rowwise")
    ap.add_argument("--ranks", type=int, default=1)
    ap.add_argument("--grid", default="data=1")
    ap.add_argument("--out", default="runs/fp8_convergence")
    ap.add_argument("--docs", default=str(ROOT / "docs"))
    ap.add_argument("--reuse", action="store_true", help="keep runs under --out that reached their last step")
    a = ap.parse_args(argv)
    out = Path(a.out)
    runs, walls = {"bf16": out / "bf16"}, {}
    walls["bf16"] = _train(a, runs["bf16"], [])
    for r in a.recipes.split(","):
        runs[f"fp8 {r}"] = out / r
        walls[f"fp8 {r}"] = _train(a, runs[f"fp8 {r}"], [f"train.fp8={r}", "train.fp8_layers=all"])
    metrics = {k: v / "metrics.jsonl" for k, v in runs.items()}
    res = {k: compare(metrics["bf16"], m) for k, m in metrics.items() if k != "bf16"}
    docs = Path(a.docs)
    docs.mkdir(parents=True, exist_ok=True)
    title = f"{a.config}: bf16 vs FP8, {a.steps} steps, {a.ranks} CPU process(es), grid {a.grid}"
    plot(metrics, docs / "fp8_convergence.png", title)
    summary = {"config": a.config, "steps": a.steps, "ranks": a.ranks, "grid": a.grid, "bound": BOUND}
    summary.update({"wall_s": walls, "results": res})
    (docs / "fp8_convergence.json").write_text(json.dumps(summary, indent=1))
    print(f"\n| run | max rel. diff of val loss | last {TAIL} steps' train loss (bf16 -> FP8) | within {BOUND:.0%} |")
    print("|---|---|---|---|")
    for k, v in res.items():
        tail = f"{v['train_tail_bf16']:.4f} -> {v['train_tail_fp8']:.4f} ({100 * v['train_tail_rel']:+.2f}%)"
        print(f"| {k} | {100 * v['max_val_rel']:.2f}% | {tail} | {'PASS' if v['pass'] else 'FAIL'} |")
    return 0 if all(v["pass"] for v in res.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
