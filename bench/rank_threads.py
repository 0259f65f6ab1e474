"""Several CPU ranks on one host: torch's default intra-op threads (one per core in every rank)
against axo4d's default (each rank its share of the cores, :mod:`axo4d.dist.threads`), side by side
in one run.

    python -m bench.rank_threads                       # 8 ranks, tiny, x=2,y=2,z=2 and data=2,x=2,z=2
    python -m bench.rank_threads --ranks 4 --grids data=2,z=2 --steps 10

Each job is the real command line (``launch.local`` in env mode, ``axo4d.train --config tiny``, fp32,
the tuner off), run once per setting in alternating order; the figure is the median step time over
the job's steps after the first (``step_time_s`` of ``metrics.jsonl``) and the whole job's wall time,
with the host's load average before and during. "torch default" sets ``OMP_NUM_THREADS`` to the
core count, which is what torch picks when nothing is set; "axo4d default" leaves it unset.
Throughput is not the point here (no FLOP rate is claimed): the ratio is.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.loadavg import LoadSampler

ROOT = Path(__file__).resolve().parents[1]


def _job(ranks: int, grid: str, steps: int, threads: str | None, out: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    if threads is not None:
        env["OMP_NUM_THREADS"] = threads
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [sys.executable, "-m", "launch.local", "-n", str(ranks), "--mode", "env", "--", "axo4d.train"]
    cmd += ["--config", "tiny", "--grid", grid, "--out", str(out)]
    sets = (f"train.steps={steps}", "train.dtype=fp32", "parallel.tuner=false", "train.eval_interval=0")
    for s in (*sets, "checkpoint.at_end=false"):
        cmd += ["--set", s]
    t0 = time.perf_counter()
    with LoadSampler() as load:
        p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=3600)
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        raise SystemExit(f"rank_threads: job on {grid} failed (exit {p.returncode}):\n{p.stderr[-2000:]}")
    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
    times = [r["step_time_s"] for r in recs if "step_time_s" in r][1:]
    return {"step_s": statistics.median(times), "wall_s": wall, "load": load.summary()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.rank_threads", description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--grids", default="x=2,y=2,z=2;data=2,x=2,z=2", help="grids separated by ';'")
    ap.add_argument("--steps", type=int, default=20)
    a = ap.parse_args(argv)
    if a.ranks < 2 or a.steps < 2:
        print(f"rank_threads: --ranks {a.ranks} --steps {a.steps}; valid: at least 2 each", file=sys.stderr)
        return 2
    cores = os.cpu_count() or 1
    print(f"{a.ranks} ranks on {cores} cores, config tiny, {a.steps} steps; load average before: {os.getloadavg()}")
    print(
        f"| grid | torch default (OMP_NUM_THREADS={cores}) step ms | axo4d default step ms | ratio "
        "| wall s torch / axo4d | load before/max |"
    )
    print("|---|---:|---:|---:|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for i, grid in enumerate(a.grids.split(";")):
            order = [str(cores), None] if i % 2 == 0 else [None, str(cores)]
            res = {t: _job(a.ranks, grid, a.steps, t, Path(tmp) / f"{i}-{t}") for t in order}
            old, new = res[str(cores)], res[None]
            loads = f"{old['load']['before']}/{old['load']['max']}, {new['load']['before']}/{new['load']['max']}"
            print(
                f"| {grid} | {1e3 * old['step_s']:.0f} | {1e3 * new['step_s']:.0f} | "
                f"{old['step_s'] / new['step_s']:.2f}x | {old['wall_s']:.0f} / {new['wall_s']:.0f} | {loads} |",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
