"""Predicted vs measured step time on one GPU: the 1-GPU run and several ranks sharing the GPU.

    python -m bench.perfmodel_gpu [--config gpt2-124m] [--ranks 1,2] [--steps 8] [--out runs/perfmodel_gpu]

For each rank count ``n``: ``perfmodel profile`` on ``n`` ranks (GEMM table of the model's local
shapes on that grid family, attention, streaming; with ``n > 1`` also the collectives and the
overlap figures, on the backend given by ``--backend``, gloo by default: NCCL does not run two
ranks on one GPU) writes a machine file; ``python -m axo4d.train`` trains ``--steps`` steps on
the grid the model picks (``--grid auto`` with ``parallel.machine`` = that file, so the grid,
order and prediction come from the same model); the report prints the measured median step time
(after ``--warmup`` steps) beside the predicted one, with the ratio. Nothing here was used to
build the model. The same flow runs on CPU (fp32, gloo) for a smoke test:
``--config tiny --steps 5 --warmup 2 --profile-args '--gemm-n 256 --sizes-mb 0.001,0.25 --iters 4 --repeats 1'``.

Needs a GPU for what it is meant to show; docs/perfmodel_validation.md says whether it has run.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def _env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")


def _launch(n: int, module_args: list[str], log: Path, timeout: float) -> int:
    """``launch.local`` with ``n`` ranks; on timeout the whole process group is stopped (no rank
    left behind) and 124 returned."""
    cmd = [sys.executable, "-m", "launch.local", "-n", str(n), "--mode", "env", "--", *module_args]
    with open(log, "w") as f:
        p = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=_env(), cwd=ROOT, start_new_session=True)
        try:
            return p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGTERM)
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
            f.write(f"\nbench.perfmodel_gpu: stopped after {timeout:g} s\n")
            return 124


def _profile_args(n: int, opts: argparse.Namespace, machine: Path) -> list[str]:
    """The ``perfmodel profile`` command (module and arguments) of ``n`` ranks writing ``machine``."""
    return [
        "perfmodel",
        "profile",
        "--out",
        str(machine),
        "--model",
        opts.config,
        "--batch",
        str(opts.batch),
        "--backend",
        opts.backend,
        "--gpus-per-node",
        str(n),
        "--name",
        f"one-device-{n}-ranks",
        *shlex.split(opts.profile_args),
    ]


def _train_args(opts: argparse.Namespace, machine: Path, run: Path) -> list[str]:
    """The ``axo4d.train --grid auto`` command (module and arguments) on the profiled ``machine``."""
    return [
        "axo4d.train",
        "--config",
        opts.config,
        "--grid",
        "auto",
        "--out",
        str(run),
        "--set",
        f"parallel.machine={machine}",
        "--set",
        f"train.steps={opts.steps}",
        "--set",
        f"train.global_batch={opts.batch}",
        "--set",
        f"parallel.backend={opts.backend}",
        "--set",
        "train.eval_interval=0",
        "--set",
        "checkpoint.at_end=false",
    ]


def measure_point(n: int, opts: argparse.Namespace, out: Path) -> dict[str, Any]:
    """Profile, train and compare for ``n`` ranks on this machine's device."""
    out.mkdir(parents=True, exist_ok=True)
    machine = out / "machine.yaml"
    prof = _profile_args(n, opts, machine)
    rc = _launch(n, prof, out / "profile.log", opts.timeout)
    if rc != 0:
        return {"ranks": n, "error": f"profile failed (exit {rc}), see {out / 'profile.log'}"}
    run = out / "run"
    train = _train_args(opts, machine, run)
    rc = _launch(n, train, out / "train.log", opts.timeout)
    if rc != 0:
        return {"ranks": n, "error": f"training failed (exit {rc}), see {out / 'train.log'}"}
    recs = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    times = [r["step_time_s"] for r in recs if "step_time_s" in r and r["step"] >= opts.warmup]
    pred = predicted(out / "train.log")
    grid = next((r["grid"] for r in recs if "grid" in r), "?")
    meas = statistics.median(times) if times else float("nan")
    return {
        "ranks": n,
        "grid": grid,
        "measured_s": meas,
        "predicted_s": pred,
        "ratio": pred / meas if times and pred else float("nan"),
        "steps": len(times),
    }


def predicted(log: Path) -> float:
    """The prediction ``axo4d.train`` printed for the chosen grid (first-step line)."""
    for line in log.read_text().splitlines():
        if line.startswith("step time: measured") and "predicted" in line:
            return float(line.split("predicted ")[1].split(" s")[0])
    return float("nan")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.perfmodel_gpu", description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="gpt2-124m")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--ranks", default="1,2", help="rank counts sharing the device (default 1,2)")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--backend", default="gloo", help="gloo (several ranks on one GPU) or nccl (one rank)")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per launch (profile, training)")
    ap.add_argument(
        "--profile-args",
        default="",
        help="extra `perfmodel profile` options; CPU smoke test: "
        "'--gemm-n 256 --sizes-mb 0.001,0.25 --iters 4 --repeats 1'",
    )
    ap.add_argument("--out", default="runs/perfmodel_gpu")
    opts = ap.parse_args(argv)
    rows = [measure_point(int(n), opts, Path(opts.out) / f"ranks{n}") for n in opts.ranks.split(",") if n.strip()]
    print(f"{'ranks':>5s}  {'grid':28s} {'measured s':>10s} {'predicted s':>11s} {'pred/meas':>9s}")
    for r in rows:
        if "error" in r:
            print(f"{r['ranks']:5d}  {r['error']}")
        else:
            print(
                f"{r['ranks']:5d}  {r['grid']:28s} {r['measured_s']:10.4f} {r['predicted_s']:11.4f} {r['ratio']:9.2f}"
            )
    (Path(opts.out) / "results.json").write_text(json.dumps(rows, indent=1))
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
