"""Time training is blocked per checkpoint save, background (``checkpoint.async``) against
synchronous, on 8 local CPU ranks; and what the collective trace and the step boundary cost.

    python -m bench.async_checkpoint                     # 8 ranks, grid data=2,x=2,z=2, 113M params (1.3 GB)
    python -m bench.async_checkpoint --n-embd 1024       # a smaller checkpoint (584 MiB)
    python -m bench.async_checkpoint --smoke             # 2 ranks, tiny model: shows it works

One training run; every ``--interval`` steps it saves, alternating a background save and a
synchronous one, so that both see the same machine (``--saves`` of each). **Blocked** is the
time from the call of the save to training going on: for a background save the weights'
finiteness check, the partial folder and the copy of the rank's state into host buffers; for a
synchronous one the whole write, checksums and ``COMPLETE``. Before a synchronous save any
background save still in flight is waited for outside the timing. Rank 0 prints the median and
largest blocked time of each, the background write time, their ratio (target: async blocked <=
20% of the synchronous save) and the step time with and without a background write in flight
(on a machine with fewer cores than ranks the writer competes with training for the CPU).

The same run alternates the collective trace (``parallel.trace_collectives``) on and off step by
step (median step time of each, and the collectives recorded per step), and times the step
boundary's agreement (one 8-byte max all-reduce over the world, :mod:`axo4d.training.lifecycle`)
against the step. Run it on a quiet machine; the load average is printed before and after.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m bench.async_checkpoint",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--grid", default="data=2,x=2,z=2")
    ap.add_argument("--n-embd", type=int, default=1536)
    ap.add_argument("--n-layer", type=int, default=4)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--batch", type=int, default=8, help="global batch (samples per step)")
    ap.add_argument("--saves", type=int, default=3, help="saves of each kind")
    ap.add_argument("--interval", type=int, default=3, help="steps between saves")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--out", default=None, help="where checkpoints go (default: a temporary folder)")
    ap.add_argument("--smoke", action="store_true", help="2 ranks, grid data=2, the tiny model, 1 save each")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.smoke:
        a.ranks, a.grid, a.n_embd, a.n_layer, a.saves, a.interval, a.warmup = 2, "data=2", 64, 2, 1, 2, 1
    return a


def _overrides(a: argparse.Namespace) -> list[str]:
    steps = a.warmup + 2 * a.saves * a.interval + 1
    return [
        f"model.n_layer={a.n_layer}",
        f"model.n_embd={a.n_embd}",
        "model.n_head=8",
        f"model.seq_len={a.seq}",
        f"train.global_batch={a.batch}",
        "train.dtype=fp32",
        f"train.steps={steps}",
        "parallel.tuner=false",
        f"parallel.grid={a.grid}",
        f"checkpoint.interval={a.interval}",
        "checkpoint.keep=2",
        "checkpoint.async=true",
    ]


def worker(a: argparse.Namespace) -> int:
    import torch

    from axo4d.config import load_config
    from axo4d.dist.bootstrap import shutdown
    from axo4d.training.checkpointing import integrity
    from axo4d.training.checkpointing.checkpointer import Checkpointer
    from axo4d.training.datasets.dataset import open_dataset, prepare_tokens
    from axo4d.training.startup import start
    from axo4d.training.trainer import Trainer

    torch.set_num_threads(1)
    cfg = load_config("tiny", _overrides(a))
    world = start(cfg, "env")
    comm = world.comm
    comm.on_rank0(lambda: prepare_tokens(cfg.data))
    ds = open_dataset(cfg.data, cfg.model.seq_len, cfg.train.seed, cfg.model.vocab_size)
    tr = Trainer(cfg, comm, ds, world.device)
    ck = Checkpointer(Path(a.out), cfg, comm, tr.model, tr.opt, background=True)
    trace = comm.trace
    steps = {"trace on": [], "trace off": [], "write in flight": [], "no write": []}
    blocked, writes, boundary, recorded = {"async": [], "sync": []}, [], [], []
    n_saves = 0
    for i in range(cfg.train.steps):
        comm.trace = trace if i % 2 == 0 else None  # the trace on and off on alternate steps
        busy = ck.in_flight
        n0 = trace.n if trace is not None else 0
        t0 = time.perf_counter()
        tr.step(i)
        dt = time.perf_counter() - t0
        if i == 0:
            comm.set_timeout(cfg.parallel.timeout_s)
        if i >= a.warmup:
            steps["trace on" if comm.trace is not None else "trace off"].append(dt)
            steps["write in flight" if busy else "no write"].append(dt)
            if comm.trace is not None:
                recorded.append(trace.n - n0)
        t0 = time.perf_counter()
        comm.max_over_world(0)
        boundary.append(time.perf_counter() - t0)
        if i >= a.warmup and (i + 1 - a.warmup) % a.interval == 0 and n_saves < 2 * a.saves:
            kind = "async" if n_saves % 2 == 0 else "sync"
            if kind == "sync":
                ck.wait()  # not counted: a save in flight is the other kind's cost
                if ck.last_save.get("write_s"):
                    writes.append(ck.last_save["write_s"])
            comm.barrier()
            t0 = time.perf_counter()
            ck.save(i + 1, background=kind == "async")
            blocked[kind].append(time.perf_counter() - t0)
            n_saves += 1
    ck.wait()
    size = integrity.total_bytes(__import__("json").loads((ck.last / "COMPLETE").read_text())["files"])
    if comm.rank == 0:
        report(a, cfg, tr, size, blocked, writes, steps, boundary, recorded)
    ck.close()
    shutdown()
    return 0


def _s(v: float) -> str:
    return f"{v * 1e3:.1f} ms" if v < 1 else f"{v:.2f} s"


def report(a, cfg, tr, size, blocked, writes, steps, boundary, recorded) -> None:
    m = cfg.model
    print(
        f"bench.async_checkpoint: {a.ranks} CPU ranks (gloo, 1 thread each, {os.cpu_count()} cores), grid {a.grid}; "
        f"GPT {m.n_layer} layers, hidden {m.n_embd}, {tr.model.num_params() / 1e6:.1f}M parameters, seq {m.seq_len}, "
        f"batch {cfg.train.global_batch}; checkpoint {size / 2**20:,.1f} MiB; load average {_load()}"
    )
    for kind in ("sync", "async"):
        b = blocked[kind]
        w = (
            f"; written in the background in {_s(statistics.median(writes))} (median)"
            if kind == "async" and writes
            else ""
        )
        print(
            f"  {kind:5s} saves: {len(b)}, training blocked median {_s(statistics.median(b))}, max {_s(max(b))}"
            f" (all: {', '.join(_s(x) for x in b)}){w}"
        )
    ratio = statistics.median(blocked["async"]) / statistics.median(blocked["sync"])
    print(f"  blocked async / sync: {ratio:.3f} (target <= 0.20): {'met' if ratio <= 0.2 else 'NOT met'}")
    for a_, b_ in (("no write", "write in flight"), ("trace off", "trace on")):
        if steps[a_] and steps[b_]:
            x, y = statistics.median(steps[a_]), statistics.median(steps[b_])
            n = f"{len(steps[a_])}+{len(steps[b_])} steps"
            print(f"  step time median: {a_} {_s(x)}, {b_} {_s(y)} (ratio {y / x:.3f}; {n})")
    if recorded:
        print(f"  collectives recorded per step with the trace on: {statistics.median(recorded):.0f}")
    step = statistics.median(steps["no write"] or steps["trace off"])
    bnd = statistics.median(boundary)
    print(
        f"  step boundary agreement (8-byte max all-reduce over {a.ranks} ranks): median {bnd * 1e6:.0f} us "
        f"= {100 * bnd / step:.3f}% of the median step",
        flush=True,
    )


def _load() -> str:
    try:
        return " ".join(open("/proc/loadavg").read().split()[:3])
    except OSError:
        return "unknown"


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    if a.worker:
        return worker(a)
    argv = list(argv if argv is not None else sys.argv[1:])
    from launch.local import run_env

    with tempfile.TemporaryDirectory(prefix="axo4d-bench-ckpt-") as tmp:
        out = a.out or tmp
        print(f"bench.async_checkpoint: load average before {_load()}; checkpoints in {out}", flush=True)
        args = ["bench.async_checkpoint", "--worker", *argv, "--out", out]
        return run_env(a.ranks, [sys.executable, "-u", "-m", *args], timeout=3600)


if __name__ == "__main__":
    sys.exit(main())
