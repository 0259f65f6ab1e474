"""The end of a multi-rank run, alone and many times: the clean-shutdown stress command.

    python -m tests.dist.end_of_run --runs 50 -n 4 --grid y=4        # prints failures / runs

Each run starts ``-n`` ranks (``mpiexec`` when there is one, else torchrun-style processes); each
rank builds the grid's groups, runs a few collectives ending with an object broadcast (what a
training run's last checkpoint does) and ends the way ``python -m axo4d.train`` ends
(:func:`axo4d.dist.bootstrap.shutdown`, then a normal interpreter exit). Before the shutdown
order was fixed, 6 of 20 runs of ``-n 4 --grid y=4`` under mpiexec aborted ("terminate called
without an active exception", a gloo thread freeing a work object during interpreter
shutdown). ``--rank`` is the per-rank entry (``--old`` ends the old way, to see the abort).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def rank_main(grid: str, old: bool) -> None:
    import torch
    import torch.distributed as dist

    from axo4d.dist.bootstrap import init_distributed, shutdown
    from axo4d.dist.comm import Comm
    from axo4d.facts.grid import Grid

    info = init_distributed("gloo", 60)
    comm = Comm(Grid.parse(grid), info.rank, timeout_s=60)
    t = torch.ones(1000)
    for i in range(3):
        for axes in ("x", "y", "z", "data"):
            comm.all_reduce(t, axes)
        comm.broadcast_object({"i": i})
    comm.all_reduce(t, "y", async_op=True).wait()
    comm.broadcast_object(None)
    if old:
        dist.destroy_process_group()  # what axo4d did before: the groups outlive it
    else:
        shutdown()


def threads() -> list[str]:
    """Names of this process's threads (Linux)."""
    return sorted(Path(f"/proc/self/task/{t}/comm").read_text().strip() for t in os.listdir("/proc/self/task"))


def launch(n: int, grid: str, old: bool = False, timeout: float = 180) -> subprocess.CompletedProcess:
    from launch.local import find_mpiexec, mpi_command, mpi_flavour

    cmd = [sys.executable, "-m", "tests.dist.end_of_run", "--rank", "--grid", grid, *(["--old"] if old else [])]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    mpiexec = find_mpiexec()
    if mpiexec:
        argv, extra, _ = mpi_command(n, cmd, mpiexec, mpi_flavour(mpiexec))
        return subprocess.run(argv, cwd=ROOT, env={**env, **extra}, capture_output=True, text=True, timeout=timeout)
    return subprocess.run(
        [sys.executable, "-m", "launch.local", "-n", str(n), "--mode", "env", "--", *cmd[2:]],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m tests.dist.end_of_run",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("-n", type=int, default=4)
    ap.add_argument("--grid", default="y=4")
    ap.add_argument("--old", action="store_true", help="end the old way (destroy_process_group only)")
    ap.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.rank:
        rank_main(args.grid, args.old)
        return 0
    failed = 0
    for i in range(args.runs):
        p = launch(args.n, args.grid, args.old)
        if p.returncode != 0:
            failed += 1
            print(f"run {i}: exit {p.returncode}: {(p.stderr.strip().splitlines() or [''])[0][:200]}", flush=True)
    print(
        f"{failed} of {args.runs} runs failed (-n {args.n}, grid {args.grid}, "
        f"{'old' if args.old else 'axo4d'} shutdown)"
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
