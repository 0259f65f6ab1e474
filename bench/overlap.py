"""Step time with overlap on vs off on 8 local CPU ranks (gloo).

    python -m bench.overlap                          # spawns 8 ranks, grid z=8
    python -m bench.overlap --grid data=2,z=4 --n-embd 384 --steps 6
    python -m bench.overlap --ranks 2 --grid z=2     # one rank per core: less contention
    python -m bench.overlap --vcluster               # ranks under launch.vcluster (if present)

Each rank builds two :class:`axo4d.training.trainer.Trainer` on the same grid and data, one with
``parallel.overlap`` on and one off (tuner off for both), and alternates their steps (off, on,
off, on, ...) so both see the same machine load; the first ``--warmup`` steps of each are
dropped. Rank 0 prints the median and minimum step times (the minimum is the better estimate on
a machine shared with other jobs), their ratios (target <= 0.75), and the bytes each
rank moves per step. The model is chosen so communication and compute are comparable: a wide
model (weights all-gathered over z) with a small local batch.

Honest caveat: on a machine with fewer cores than ranks, gloo's communication threads and the
GEMMs compete for the same cores, so overlap cannot hide much; the figure is what this CPU and
gloo achieve, not what a GPU cluster would.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m bench.overlap", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--ranks", type=int, default=8, help="number of local ranks (default 8)")
    ap.add_argument("--grid", default="z=8", help="grid of --ranks ranks (default z=8: largest weight gathers)")
    ap.add_argument("--n-embd", type=int, default=512)
    ap.add_argument("--n-layer", type=int, default=2)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8, help="global batch (samples per step)")
    ap.add_argument("--steps", type=int, default=5, help="timed steps per mode")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    ap.add_argument(
        "--vcluster",
        action="store_true",
        help="launch through launch.vcluster: 2 nodes (network namespaces, root), --ranks/2 each",
    )
    ap.add_argument("--rate", default="1gbit", help="with --vcluster: inter-node link rate (tc units)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def _overrides(a: argparse.Namespace) -> list[str]:
    return [
        f"model.n_layer={a.n_layer}",
        f"model.n_embd={a.n_embd}",
        "model.n_head=8",
        f"model.seq_len={a.seq}",
        f"train.global_batch={a.batch}",
        "train.dtype=fp32",
        "train.grad_accum=1",
        f"train.steps={a.warmup + a.steps}",
        "parallel.tuner=false",
        f"parallel.grid={a.grid}",
    ]


def worker(a: argparse.Namespace) -> int:
    import torch

    from axo4d.config import load_config
    from axo4d.dist.bootstrap import init_distributed, shutdown
    from axo4d.dist.comm import Comm
    from axo4d.dist.grid import Grid
    from axo4d.training.data.dataset import open_dataset, prepare_tokens
    from axo4d.training.trainer import Trainer

    torch.set_num_threads(a.threads)
    info = init_distributed("gloo", 120)
    base = load_config("tiny", _overrides(a))
    world = Comm(Grid(data=info.world_size), info.rank)
    if info.rank == 0:
        prepare_tokens(base.data)
    world.barrier()
    ds = open_dataset(base.data, base.model.seq_len, base.train.seed, base.model.vocab_size)
    trainers, times = {}, {"off": [], "on": []}
    for mode in ("off", "on"):
        cfg = dataclasses.replace(base, parallel=dataclasses.replace(base.parallel, overlap=mode == "on"))
        trainers[mode] = Trainer(cfg, Comm(Grid.parse(a.grid), info.rank, timeout_s=120), ds, info.device)
    for i in range(a.warmup + a.steps):
        for mode in ("off", "on"):
            trainers[mode].comm.reset_counters()
            world.barrier()
            t0 = time.perf_counter()
            trainers[mode].step(i)
            if i >= a.warmup:
                times[mode].append(time.perf_counter() - t0)
    if info.rank == 0:
        report(a, base, trainers, times)
    shutdown()
    return 0


def report(a, cfg, trainers, times) -> None:
    off, on = statistics.median(times["off"]), statistics.median(times["on"])
    best_off, best_on = min(times["off"]), min(times["on"])
    nbytes = sum(trainers["on"].comm.bytes.values())
    stats = dict(trainers["on"].model.schedule.stats)
    m = cfg.model
    where = f"launch.vcluster 2 nodes, {a.rate} link" if a.vcluster else "one machine"
    print(
        f"bench.overlap: {a.ranks} CPU ranks ({where}; gloo, {a.threads} thread(s) each, {os.cpu_count()} cores), "
        f"grid {a.grid}; GPT {m.n_layer} layers, hidden {m.n_embd}, seq {m.seq_len}, global batch "
        f"{cfg.train.global_batch}, fp32"
    )
    print(f"  bytes moved per rank per step: {nbytes / 2**20:.1f} MiB (same with and without overlap)")
    for mode, med, best in (("off", off, best_off), ("on ", on, best_on)):
        print(
            f"  step time, overlap {mode}: median {med * 1e3:8.1f} ms, min {best * 1e3:8.1f} ms  "
            f"(all: {', '.join(f'{t * 1e3:.0f}' for t in times[mode.strip()])})"
        )
    print(
        f"  ratio on/off: median {on / off:.3f}, min {best_on / best_off:.3f}  (target <= 0.75)   prefetch: {stats}",
        flush=True,
    )


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    if a.worker:
        return worker(a)
    argv = list(argv if argv is not None else sys.argv[1:])
    args = ["bench.overlap", "--worker", *argv]
    if a.vcluster:
        try:
            import launch.vcluster  # noqa: F401
        except ImportError:
            print("bench.overlap: launch.vcluster is not available; run without --vcluster", file=sys.stderr)
            return 2
        import subprocess

        return subprocess.call(
            [
                sys.executable,
                "-m",
                "launch.vcluster",
                "--nodes",
                "2",
                "--ranks-per-node",
                str(a.ranks // 2),
                "--rate",
                a.rate,
                "--timeout",
                "1800",
                "--",
                *args,
            ]
        )
    from launch.local import run_env

    return run_env(a.ranks, [sys.executable, "-u", "-m", *args], timeout=1800)


if __name__ == "__main__":
    sys.exit(main())
