"""Step time with overlap on vs off, beside the ideal ratio measured in the same run.

    python -m bench.overlap --vcluster --ranks 2 --grid z=2 --rate 1gbit --n-embd 512 --seq 256 --batch 16
    python -m bench.overlap --ranks 2 --grid data=2          # local ranks (no shaped link)
    python -m bench.overlap_table --rate 1gbit               # the five grids, with the model's predictions

Each rank builds, on the same grid and data, :class:`axo4d.training.trainer.Trainer` s with
``parallel.overlap`` off and on (default settings otherwise: 'auto' buckets, the sharded optimizer
when G_data > 1, tuner off), with G_data > 1 also one on with ``parallel.shard_optimizer=false``,
and one on a :class:`~bench.overlap_probe.NullComm` (**compute alone**: the same step with no
communication); it records the collectives of one overlapped step and replays them on the
grid's groups one after the other (**communication alone**). The modes alternate step by step
(off, on, [on unsharded], compute, comm, off, ...) so all see the same machine; the first
``--warmup`` steps of each are dropped. Rank 0 prints the median and minimum step times, on/off,
the **ideal ratio** ``max(comm, compute) / (comm + compute)`` from the two medians (perfect
overlap: each hidden behind the other) and the distance to it, the sharded/unsharded ratio, and
the bytes each rank moves per step; ``--json`` writes them.

Subnormal floats are flushed to zero on every rank (``torch.set_flush_denormal``; ``--keep-denormals``
computes with them): a few steps into training some values become subnormal, and on a CPU every
operation on one takes a slow path. The compute-alone trainer on x=2 at hidden 2048 went from 2.7 s
a step to 4.2-5.1 s from its fifth step on, and stayed at 2.7-2.8 s with them flushed (or with its
learning rate at 0): the "drift" docs/overlap.md records, which moved every mode's time by its own
amount.

On one machine (without ``--vcluster``) gloo moves data on the cores that compute, so overlap
hides little; ``--vcluster`` puts ranks on virtual nodes joined by a shaped link
(:mod:`launch.vcluster`, root), where the link's time is real and does not take the CPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m bench.overlap", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--ranks", type=int, default=2, help="number of ranks (default 2)")
    ap.add_argument("--grid", default="z=2", help="grid of --ranks ranks (default z=2)")
    ap.add_argument("--n-embd", type=int, default=512)
    ap.add_argument("--n-layer", type=int, default=2)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=16, help="global batch (samples per step)")
    ap.add_argument("--steps", type=int, default=5, help="timed steps per mode")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="extra config override")
    ap.add_argument("--json", default="", help="rank 0 writes the figures here")
    ap.add_argument(
        "--vcluster", action="store_true", help="launch through launch.vcluster: 2 nodes, --ranks/2 each (root)"
    )
    ap.add_argument("--rate", default="1gbit", help="with --vcluster: inter-node link rate (tc units)")
    ap.add_argument(
        "--keep-denormals", action="store_true", help="compute with subnormal floats (default: flushed to zero)"
    )
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def overrides(a: argparse.Namespace) -> list[str]:
    """The benchmark's config (on top of ``tiny``): the model and batch, fp32, no tuner."""
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
        *a.set,
    ]


def _with(cfg, **parallel):
    return dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, **parallel))


def _block_clock() -> list[float]:
    """A one-element list that every collective adds the wall seconds the step is blocked on it to,
    from now on in this process: a blocking call's whole time, a pending one's wait
    (:class:`axo4d.dist.comm.Handle`). A probe of the step's exposed communication on CPU ranks,
    where gloo blocks the host (on NCCL a wait is a stream dependency, not host time)."""
    from axo4d.dist.comm import Comm, Handle

    clock = [0.0]
    wait, run = Handle.wait, Comm._run

    def timed(fn):
        def call(*args, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kw)
            finally:
                clock[0] += time.perf_counter() - t0

        return call

    blocking = timed(run)

    def run_timed(self, op, axes, fn, async_op, *rest, **kw):
        return (run if async_op else blocking)(self, op, axes, fn, async_op, *rest, **kw)

    Handle.wait = timed(wait)
    Comm._run = run_timed
    return clock


def _trainers(base, grid, info) -> tuple[dict, dict]:
    """The modes' configs and trainers on one dataset: overlap off and on (and on without the
    sharded optimizer where it is on), and compute alone (on a :class:`~bench.overlap_probe.NullComm`)."""
    from axo4d.dist.comm import Comm
    from axo4d.training.datasets.dataset import open_dataset
    from axo4d.training.optim.sharded import shard_optimizer_on
    from axo4d.training.trainer import Trainer
    from bench.overlap_probe import NullComm

    ds = open_dataset(base.data, base.model.seq_len, base.train.seed, base.model.vocab_size)
    cfgs = {"off": _with(base, overlap=False), "on": _with(base, overlap=True)}
    if shard_optimizer_on(base.parallel, grid):
        cfgs["on_unsharded"] = _with(base, overlap=True, shard_optimizer="false")
    trainers = {m: Trainer(c, Comm(grid, info.rank, timeout_s=300), ds, info.device) for m, c in cfgs.items()}
    trainers["compute"] = Trainer(cfgs["on"], NullComm(grid, info.rank), ds, info.device)
    return cfgs, trainers


def worker(a: argparse.Namespace) -> int:
    import torch

    from axo4d.config import load_config
    from axo4d.dist.bootstrap import init_distributed, shutdown
    from axo4d.dist.comm import Comm
    from axo4d.facts.grid import Grid
    from axo4d.training.datasets.dataset import prepare_tokens
    from bench.overlap_probe import Recorder, replay
    from bench.subnormals import set_subnormals

    subnormals = set_subnormals(not a.keep_denormals)  # the module docstring says why
    info = init_distributed("gloo", 300)
    torch.set_num_threads(a.threads)  # after start-up, which sets its default threads
    base = load_config("tiny", overrides(a))
    grid = Grid.parse(a.grid)
    world = Comm(Grid(data=info.world_size), info.rank)
    if info.rank == 0:
        prepare_tokens(base.data)
    world.barrier()
    cfgs, trainers = _trainers(base, grid, info)
    rec = Recorder(trainers["on"].comm)
    replay_comm = Comm(grid, info.rank, timeout_s=300)
    calls: list = []
    modes = [*trainers, "comm"]
    times: dict[str, list[float]] = {m: [] for m in modes}
    blocked = _block_clock()
    waits: dict[str, list[float]] = {m: [] for m in modes}  # wall seconds blocked in a collective's wait
    cpu: dict[str, list[float]] = {m: [] for m in modes}  # the process's CPU seconds (every thread)
    for i in range(a.warmup + a.steps):
        for mode in modes:
            if mode in cfgs:
                trainers[mode].comm.reset_counters()
            if mode == "on" and i == a.warmup - 1:
                rec.start()
            world.barrier()
            blocked[0], c0 = 0.0, time.process_time()
            t0 = time.perf_counter()
            if mode == "comm":
                replay(replay_comm, calls)
            else:
                trainers[mode].step(i)
            dt = time.perf_counter() - t0
            if mode == "on" and i == a.warmup - 1:
                calls = rec.stop()
            if i >= a.warmup:
                times[mode].append(dt)
                waits[mode].append(blocked[0])
                cpu[mode].append(time.process_time() - c0)
    for tr in trainers.values():
        tr.settle()
    if info.rank == 0:
        res = figures(a, base, trainers, times, calls, subnormals)
        res["heap"] = info.heap  # axo4d.dist.heap
        res["blocked_s"] = {m: statistics.median(t) for m, t in waits.items() if t}
        res["cpu_s"] = {m: statistics.median(t) for m, t in cpu.items() if t}
        res.update(cpu_floor(res))
        print(report(res), flush=True)
        if a.json:
            with open(a.json, "w") as f:
                json.dump(res, f, indent=1)
    shutdown()
    return 0


def figures(a, cfg, trainers, times, calls, subnormals: str) -> dict:
    """Everything the report prints (and ``--json`` keeps)."""
    from bench.overlap_probe import ideal_ratio

    med = {m: statistics.median(t) for m, t in times.items() if t}
    best = {m: min(t) for m, t in times.items() if t}
    on = trainers["on"]
    res = {
        "grid": a.grid,
        "ranks": a.ranks,
        "where": f"launch.vcluster 2 nodes, {a.rate} link" if a.vcluster else "one machine",
        "threads": a.threads,
        "denormals": subnormals,
        "cores": os.cpu_count(),
        "load_avg_end": round(os.getloadavg()[0], 2),
        "model": {"n_layer": cfg.model.n_layer, "n_embd": cfg.model.n_embd, "seq": cfg.model.seq_len},
        "batch": cfg.train.global_batch,
        "sets": list(a.set),
        "times_s": times,
        "median_s": med,
        "min_s": best,
        "ratio_on_off": med["on"] / med["off"],
        "ratio_on_off_min": best["on"] / best["off"],
        "ideal_ratio": ideal_ratio(med["comm"], med["compute"]),
        "bytes_per_step": sum(on.comm.bytes.values()),
        "replayed_calls": len(calls),
        "prefetch": dict(on.model.schedule.stats),
        "buckets": len(on.model.schedule.bucket_plan()),
        "sharded": hasattr(on.opt, "gather_stats"),
        "weight_gathers": on.opt.gather_stats if hasattr(on.opt, "gather_stats") else {},
    }
    if "on_unsharded" in med:
        res["ratio_sharded_unsharded"] = med["on"] / med["on_unsharded"]
    res["distance_to_ideal"] = res["ratio_on_off"] - res["ideal_ratio"]
    return res


def cpu_floor(r: dict) -> dict:
    """The on/off ratio below which no schedule goes when communication's own CPU cannot hide
    (a rank with one core: gloo's threads and the network stack run on the core that computes):
    ``max(compute CPU + comm CPU, compute, comm) / off`` from the medians, and on/off's distance to
    it. The ideal ratio prices that CPU at zero; this prints both (empty without CPU times)."""
    c, med = r.get("cpu_s", {}), r["median_s"]
    if not med.get("off") or "compute" not in c or "comm" not in c:
        return {}
    floor = max(c["compute"] + c["comm"], med["compute"], med["comm"]) / med["off"]
    return {"cpu_floor": floor, "distance_to_cpu_floor": r["ratio_on_off"] - floor}


def report(r: dict) -> str:
    m = r["model"]
    lines = [
        f"bench.overlap: {r['ranks']} CPU ranks ({r['where']}; gloo, {r['threads']} thread(s) each, {r['cores']} "
        f"cores), grid {r['grid']}; GPT {m['n_layer']} layers, hidden {m['n_embd']}, seq {m['seq']}, global batch "
        f"{r['batch']}, fp32 (subnormals {r.get('denormals', 'kept')}, heap {r.get('heap', 'left')})"
        f"{' ' + ' '.join(r['sets']) if r['sets'] else ''}; "
        f"load average {r['load_avg_end']} at the end",
        f"  bytes moved per rank per step: {r['bytes_per_step'] / 2**20:.1f} MiB (the same with and without overlap); "
        f"{r['buckets']} data-parallel bucket(s); sharded optimizer {'on' if r['sharded'] else 'off'}",
    ]
    names = {
        "off": "overlap off",
        "on": "overlap on ",
        "on_unsharded": "on, unsharded optimizer",
        "compute": "compute alone",
        "comm": "communication alone",
    }
    for mode, t in r["times_s"].items():
        lines.append(
            f"  {names[mode]:24s} median {r['median_s'][mode] * 1e3:8.1f} ms, min {r['min_s'][mode] * 1e3:8.1f} ms  "
            f"(all: {', '.join(f'{x * 1e3:.0f}' for x in t)})"
        )
        if mode in r.get("blocked_s", {}):
            lines.append(
                f"  {'':24s} blocked in waits {r['blocked_s'][mode] * 1e3:.0f} ms, CPU (user + system, every "
                f"thread) {r['cpu_s'][mode] * 1e3:.0f} ms (medians)"
            )
    lines.append(
        f"  on/off: median {r['ratio_on_off']:.3f} (min {r['ratio_on_off_min']:.3f}); ideal max(comm, compute)/"
        f"(comm + compute) = {r['ideal_ratio']:.3f}; distance {r['distance_to_ideal']:+.3f}"
    )
    if "cpu_floor" in r:
        lines.append(
            f"  floor with communication's own CPU (one core a rank): max(compute CPU + comm CPU, compute, comm)/off "
            f"= {r['cpu_floor']:.3f}; distance {r['distance_to_cpu_floor']:+.3f}"
        )
    if "ratio_sharded_unsharded" in r:
        lines.append(f"  sharded/unsharded optimizer (overlap on): {r['ratio_sharded_unsharded']:.3f}")
    lines.append(f"  prefetch: {r['prefetch']}; weight gathers: {r['weight_gathers']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    if a.worker:
        return worker(a)
    argv = list(argv if argv is not None else sys.argv[1:])
    args = ["bench.overlap", "--worker", *argv]
    if a.vcluster:
        import subprocess

        if a.ranks % 2:
            print(
                f"bench.overlap: --ranks {a.ranks}: --vcluster puts half the ranks on each of 2 nodes", file=sys.stderr
            )
            return 2
        cmd = [sys.executable, "-m", "launch.vcluster", "--nodes", "2", "--ranks-per-node", str(a.ranks // 2)]
        return subprocess.call([*cmd, "--rate", a.rate, "--timeout", "1800", "--", *args])
    from launch.local import run_env

    return run_env(a.ranks, [sys.executable, "-u", "-m", *args], timeout=1800)


if __name__ == "__main__":
    sys.exit(main())
