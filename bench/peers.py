"""axo4d against the frameworks its users would pick instead, side by side in one run.

    python -m bench.peers --vcluster                  # every pair on the virtual cluster (root), 1 Gbit link
    python -m bench.peers --vcluster --pairs x2,y2    # some pairs
    python -m bench.peers --local --pairs data2       # local ranks (no shaped link)
    python -m bench.peers --local --pairs x2 --n-embd 64 --n-layer 1 --seq 32 --batch 4 --steps 1 --rounds 1  # smoke

Pairs (2 ranks unless said): ``x2`` and ``y2`` against torch's own tensor parallelism
(``parallelize_module`` with ``ColwiseParallel``/``RowwiseParallel`` and ``SequenceParallel`` on
the norms, Megatron's pattern, the loss vocabulary-parallel); ``z2`` against FSDP2
(``fully_shard`` on every block and the root); ``data2`` against ``DistributedDataParallel``;
on 4 ranks ``data2x2`` against FSDP2 over data with torch TP over the other axis (2D), and
``x2y2`` against torch TP over 4 ranks.

Every contender trains the same model (:class:`axo4d.models.plain.PlainGPT`'s shape; the peers
run that plain PyTorch model itself), from the same initial weights (axo4d's, gathered and loaded
into the plain model before the peer shards it), on the same samples (axo4d's step samples, the
global batch cut over the data ranks), with the same AdamW (lr, betas, eps, weight decay on
matrices, global-norm clipping). axo4d runs its trainer with the default ``parallel`` settings on
the pair's grid. Both sides' first-step losses are printed and must agree (1e-5 relative, fp32):
otherwise the contenders do not do the same work and the run fails (exit 1).

Timing: ``--rounds`` rounds of ``--steps`` timed steps per contender, the order alternating each
round (axo4d first, then the peer first, ...) after ``--warmup`` untimed steps each. A round starts
after a barrier and runs its steps back to back, as training does; a step is timed from its start
to the next one's, the last to the round's end once the weight all-gathers axo4d's sharded
optimizer leaves in flight have landed: whatever a step leaves running (those all-gathers, behind
the next forward) is inside some step's time. The figure is the median step time of each side
and their ratio. The load average is printed
before and after: a figure is evidence only when nothing else runs on the machine. On one machine
(``--local``) gloo moves data on the cores that compute; ``--vcluster`` (root) puts ranks on two
virtual nodes joined by a shaped link (:mod:`launch.vcluster`).

On a host with GPUs every rank computes on one (``local_rank`` modulo their count), both sides:
with one GPU, as on the machines ``bench/gpu_check.sh`` runs on, the ranks share it and gloo moves
CUDA tensors through host memory, so the figures say that both sides run there and agree, and how
their steps compare in that setting; they are not what either would do with a GPU per rank.

Subnormal floats are flushed to zero on every rank, as in :mod:`bench.overlap` (``--keep-denormals``
computes with them): as training proceeds some values become subnormal and on a CPU every operation
on one takes a slow path (GPUs do not), which adds the same growing time to both sides' steps and
so pulls every ratio towards 1. Both contenders share each rank's process, so both run with what
axo4d's start-up did to the C library's allocator on CPU ranks (:mod:`axo4d.dist.heap`: freed
memory kept for the next step; printed as ``heap``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

PAIRS = {  # name -> (ranks, axo4d grid, peer)
    "x2": (2, "x=2", "tp"),
    "y2": (2, "y=2", "tp"),
    "z2": (2, "z=2", "fsdp2"),
    "data2": (2, "data=2", "ddp"),
    "data2x2": (4, "data=2,x=2", "fsdp2+tp"),
    "x2y2": (4, "x=2,y=2", "tp"),
}
PEER_NAMES = {
    "tp": "torch TP (parallelize_module, Megatron pattern + SequenceParallel)",
    "fsdp2": "FSDP2 (fully_shard)",
    "ddp": "DDP (DistributedDataParallel)",
    "fsdp2+tp": "FSDP2 over data + torch TP (2D)",
}
LOSS_RTOL = 1e-5


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m bench.peers", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--pairs", default="data2,x2,y2,z2,data2x2,x2y2", help="comma-separated: " + ", ".join(PAIRS))
    where = ap.add_mutually_exclusive_group()
    where.add_argument("--vcluster", action="store_true", help="2 virtual nodes joined by a shaped link (root)")
    where.add_argument("--local", action="store_true", help="plain local ranks (the default)")
    ap.add_argument("--rate", default="1gbit", help="with --vcluster: the inter-node link rate (tc units)")
    ap.add_argument("--n-embd", type=int, default=512)
    ap.add_argument("--n-layer", type=int, default=4)
    ap.add_argument("--n-head", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=16, help="global batch (samples per step)")
    ap.add_argument("--steps", type=int, default=8, help="timed steps per contender and round")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps per contender before the rounds")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="extra axo4d config override")
    ap.add_argument(
        "--keep-denormals", action="store_true", help="compute with subnormal floats (default: flushed to zero)"
    )
    ap.add_argument("--json", default="", help="write the figures here (one object per pair)")
    ap.add_argument("--worker", default="", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    bad = [p for p in a.pairs.split(",") if p not in PAIRS]
    if bad:
        ap.error(f"--pairs {','.join(bad)}: not a pair; valid: {', '.join(PAIRS)}")
    return a


def overrides(a: argparse.Namespace, grid: str) -> list[str]:
    """axo4d's config on top of ``tiny``: the model, the batch and fp32; ``parallel`` stays default."""
    return [
        f"model.n_layer={a.n_layer}",
        f"model.n_embd={a.n_embd}",
        f"model.n_head={a.n_head}",
        f"model.seq_len={a.seq}",
        f"train.global_batch={a.batch}",
        "train.grad_accum=1",
        "train.dtype=fp32",
        f"train.steps={a.warmup + a.rounds * a.steps}",
        f"parallel.grid={grid}",
        *a.set,
    ]


# ---- the worker: one pair on every rank ------------------------------------------------------------
def worker(a: argparse.Namespace) -> int:
    import torch

    from axo4d.config import load_config
    from axo4d.dist.bootstrap import init_distributed, shutdown
    from axo4d.dist.comm import Comm
    from axo4d.facts.grid import Grid
    from axo4d.training.datasets.dataset import open_dataset, prepare_tokens
    from axo4d.training.trainer import Trainer
    from bench.peer_models import build_peer, full_weights, peer_step
    from bench.subnormals import set_subnormals

    ranks, grid_s, peer = PAIRS[a.worker]
    info = init_distributed("gloo", 600)
    torch.set_num_threads(a.threads)  # after start-up, which sets its default threads
    subnormals = set_subnormals(not a.keep_denormals)  # the module docstring says why
    cfg = load_config("tiny", overrides(a, grid_s))
    grid = Grid.parse(grid_s)
    world = Comm(Grid(data=info.world_size), info.rank)
    if info.rank == 0:
        prepare_tokens(cfg.data)
    world.barrier()
    ds = open_dataset(cfg.data, cfg.model.seq_len, cfg.train.seed, cfg.model.vocab_size)
    ours = Trainer(cfg, Comm(grid, info.rank, timeout_s=600), ds, info.device)
    theirs = build_peer(peer, cfg, full_weights(ours), info.rank, info.world_size, grid, info.device)
    steps = {"axo4d": lambda i: ours.step(i).loss, "peer": lambda i: peer_step(theirs, ours.plan, ds, cfg, i)}
    times: dict[str, list[float]] = {"axo4d": [], "peer": []}
    cpu_times: dict[str, list[float]] = {"axo4d": [], "peer": []}  # the process's CPU time (its threads)
    first = {name: float(fn(0)) for name, fn in steps.items()}  # step 0: the losses must agree
    step = {"axo4d": 1, "peer": 1}
    for _ in range(a.warmup - 1):
        for name, fn in steps.items():
            fn(step[name])
            step[name] += 1
    for r in range(a.rounds):
        for name in ("axo4d", "peer") if r % 2 == 0 else ("peer", "axo4d"):
            ours.settle()  # nothing of the other side in flight
            world.barrier()
            marks, cpu = [], []
            for _ in range(a.steps):
                marks.append(time.perf_counter())
                cpu.append(time.process_time())
                steps[name](step[name])
                step[name] += 1
            ours.settle()  # the last step's weight all-gathers land inside the round
            marks.append(time.perf_counter())
            cpu.append(time.process_time())
            times[name] += [b - a_ for a_, b in zip(marks, marks[1:])]
            cpu_times[name] += [b - a_ for a_, b in zip(cpu, cpu[1:])]
    if info.rank == 0:
        res = figures(a, ranks, grid_s, peer, first, times, cpu_times, subnormals)
        res["heap"] = info.heap  # both contenders' process: axo4d.dist.heap
        print(report_line(res), flush=True)
        if a.json:
            with open(a.json, "w") as f:
                json.dump(res, f, indent=1)
    shutdown()
    return 0 if agree(first) else 1


def agree(first: dict[str, float]) -> bool:
    return abs(first["axo4d"] - first["peer"]) <= LOSS_RTOL * abs(first["peer"])


def figures(a, ranks: int, grid: str, peer: str, first: dict, times: dict, cpu: dict, subnormals: str) -> dict:
    med = {k: statistics.median(v) for k, v in times.items()}
    return {
        "pair": a.worker,
        "ranks": ranks,
        "grid": grid,
        "peer": PEER_NAMES[peer],
        "where": f"launch.vcluster 2 nodes, {a.rate} link" if a.vcluster else "one machine",
        "model": {"n_layer": a.n_layer, "n_embd": a.n_embd, "n_head": a.n_head, "seq": a.seq, "batch": a.batch},
        "denormals": subnormals,
        "first_loss": first,
        "losses_agree": agree(first),
        "times_s": times,
        "median_s": med,
        "cpu_s": cpu,
        "median_cpu_s": {k: statistics.median(v) for k, v in cpu.items()},
        "ratio": med["axo4d"] / med["peer"],
        "load_avg_end": round(os.getloadavg()[0], 2),
    }


def report_line(r: dict) -> str:
    fl = r["first_loss"]
    return (
        f"{r['pair']:8s} {r['grid']:11s} axo4d {r['median_s']['axo4d'] * 1e3:8.1f} ms | {r['peer']}: "
        f"{r['median_s']['peer'] * 1e3:8.1f} ms | axo4d/peer {r['ratio']:.3f} | first-step loss axo4d "
        f"{fl['axo4d']:.6f}, peer {fl['peer']:.6f}{'' if r['losses_agree'] else '  DISAGREE'} | "
        f"CPU per step (median, this process) axo4d {r['median_cpu_s']['axo4d'] * 1e3:.1f} ms, peer "
        f"{r['median_cpu_s']['peer'] * 1e3:.1f} ms | subnormals {r['denormals']} | heap {r.get('heap', 'left')} | "
        f"load {r['load_avg_end']} at the end"
    )


def table(results: list[dict]) -> str:
    """The pairs as a Markdown table (median step times, ratio, both first-step losses)."""
    lines = [
        "| pair | grid | axo4d ms | peer | peer ms | axo4d / peer | first-step loss axo4d / peer | load at the end |",
        "|---|---|---:|---|---:|---:|---|---:|",
    ]
    for r in results:
        fl = r["first_loss"]
        lines.append(
            f"| {r['pair']} | {r['grid']} | {r['median_s']['axo4d'] * 1e3:.1f} | {r['peer']} | "
            f"{r['median_s']['peer'] * 1e3:.1f} | {r['ratio']:.3f} | {fl['axo4d']:.6f} / {fl['peer']:.6f}"
            f"{'' if r['losses_agree'] else ' DISAGREE'} | {r['load_avg_end']} |"
        )
    return "\n".join(lines)


# ---- the driver: one launch per pair --------------------------------------------------------------
def launch_pair(a: argparse.Namespace, argv: list[str], pair: str, out: str) -> int:
    ranks = PAIRS[pair][0]
    args = ["bench.peers", *argv, "--worker", pair, "--json", out]
    if a.vcluster:
        cmd = [sys.executable, "-m", "launch.vcluster", "--nodes", "2", "--ranks-per-node", str(ranks // 2)]
        return subprocess.call([*cmd, "--rate", a.rate, "--timeout", "1800", "--", *args])
    from launch.local import run_env

    os.environ["OMP_NUM_THREADS"] = str(a.threads)
    return run_env(ranks, [sys.executable, "-u", "-m", *args], timeout=1800)


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    if a.worker:
        return worker(a)
    import tempfile

    argv = [x for x in (argv if argv is not None else sys.argv[1:])]
    argv = _without(argv, "--json", "--pairs")
    load0 = os.getloadavg()
    print(
        f"bench.peers: {'launch.vcluster, 2 nodes, ' + a.rate if a.vcluster else 'local ranks'}; GPT {a.n_layer} "
        f"layers, hidden {a.n_embd}, {a.n_head} heads, seq {a.seq}, global batch {a.batch}, fp32 (subnormals "
        f"{'kept' if a.keep_denormals else 'flushed'}), AdamW; {a.rounds} rounds x {a.steps} timed steps "
        f"(after {a.warmup}); {a.threads} thread(s) a rank, "
        f"{os.cpu_count()} cores; load average before {load0[0]:.2f} {load0[1]:.2f} {load0[2]:.2f}",
        flush=True,
    )
    results, status = [], 0
    with tempfile.TemporaryDirectory() as tmp:
        for pair in a.pairs.split(","):
            out = os.path.join(tmp, pair + ".json")
            rc = launch_pair(a, argv, pair, out)
            if rc != 0 or not os.path.exists(out):
                print(f"{pair}: failed (exit {rc})", flush=True)
                status = status or rc or 1
                continue
            with open(out) as f:
                results.append(json.load(f))
            if a.json:  # after every pair: a run cut short keeps the pairs it finished
                _write(a.json, load0, None, results)
    load1 = os.getloadavg()
    print(table(results), flush=True)
    print(f"load average after {load1[0]:.2f} {load1[1]:.2f} {load1[2]:.2f}", flush=True)
    if a.json:
        _write(a.json, load0, load1, results)
    return status


def _write(path: str, load0, load1, results: list[dict]) -> None:
    with open(path, "w") as f:
        json.dump({"load_before": load0, "load_after": load1, "pairs": results}, f, indent=1)


def _without(argv: list[str], *flags: str) -> list[str]:
    out, skip = [], False
    for x in argv:
        if skip:
            skip = False
            continue
        if x in flags:
            skip = True
            continue
        if any(x.startswith(f + "=") for f in flags):
            continue
        out.append(x)
    return out


if __name__ == "__main__":
    sys.exit(main())
