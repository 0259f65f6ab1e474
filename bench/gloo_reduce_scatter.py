"""What the sharded optimizer's collectives cost on gloo: a reduce-scatter (gloo's own, an
all-to-all of the pieces followed by their sum, direct send/recv pairs followed by their sum, and
axo4d's ``Comm``: on two ranks one exchange of halves in 1 MiB chunks, :mod:`axo4d.dist.pairwise`)
and an all-gather (gloo's own, by send/recv, and axo4d's), each beside an all-reduce of the same
buffer, on 2 ranks joined by a shaped link::

    sudo python -m bench.gloo_reduce_scatter --vcluster [--rate 1gbit --mb 100 --rounds 8]
    python -m bench.gloo_reduce_scatter --smoke          # 2 local ranks, 1 MB, 2 rounds (the unit test's)

Measured 2026-12-02 at 19:51 UTC on the virtual cluster (1 Gbit, 2 nodes x 1 rank, nothing else
running, load average below 0.8), medians of 8 rounds: 100 MB: all-reduce 893 ms, reduce-scatter
1017 ms (gloo's) and 991 ms (all-to-all + sum), all-gather 781 ms; 25 MB: 225, 231 (210), 153 ms.
A reduce-scatter plus an all-gather -- the sharded optimizer -- cost about two all-reduces of
link time on this link, where on NCCL they cost one together.

Again 2026-12-03 at 04:10 UTC (load average 1.1 -> 0.9, nothing else running; 6 rounds), with the
send/recv forms, which move half an all-reduce's bytes: 100 MB: all-reduce 903 ms, reduce-scatter
889 (gloo's), 870 (all-to-all), 879 (send/recv; least 473) ms, all-gather 687 (gloo's), 849
(send/recv) ms; 25 MB: 210, 219, 213, 184 (least 113), 143, 197 ms. Sending half the bytes as
one message each way was sometimes half the time (the least) but not in the median: such a pair
of opposite messages runs at full duplex only some of the time on this link. Sent in 1 MiB
chunks, all in flight at once, it did every time; that is axo4d's form since (docs/overlap.md).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

from bench.loadavg import LoadSampler


def a2a_reduce_scatter(x: torch.Tensor, group) -> torch.Tensor:
    """This rank's piece of the sum of ``x`` over ``group``: every rank's piece sent to its owner by
    one all-to-all, then added in group order."""
    import torch.distributed as dist

    n = dist.get_world_size(group)
    pieces = torch.empty_like(x)  # (n, numel/n): row i is rank i's contribution to this rank's piece
    dist.all_to_all_single(pieces, x, group=group)
    return pieces.view(n, -1).sum(0)


def p2p_reduce_scatter(x: torch.Tensor, group) -> torch.Tensor:
    """This rank's piece of the sum of ``x`` over ``group`` by direct sends: piece ``j`` to rank
    ``j`` (``isend``/``irecv`` pairs, every transfer in flight at once), then added in group order."""
    import torch.distributed as dist

    n, me = dist.get_world_size(group), dist.get_rank(group)
    rows = x.view(n, -1)
    got = torch.empty_like(rows)
    ops = []
    for j in range(n):
        if j != me:
            ops.append(dist.P2POp(dist.isend, rows[j].contiguous(), dist.get_global_rank(group, j), group))
            ops.append(dist.P2POp(dist.irecv, got[j], dist.get_global_rank(group, j), group))
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    got[me] = rows[me]
    return got.sum(0)


def p2p_all_gather(piece: torch.Tensor, group) -> torch.Tensor:
    """Every rank's ``piece`` by direct sends (``isend``/``irecv`` pairs), in group order."""
    import torch.distributed as dist

    n, me = dist.get_world_size(group), dist.get_rank(group)
    out = torch.empty(n, piece.numel(), dtype=piece.dtype)
    ops = []
    for j in range(n):
        if j != me:
            ops.append(dist.P2POp(dist.isend, piece, dist.get_global_rank(group, j), group))
            ops.append(dist.P2POp(dist.irecv, out[j], dist.get_global_rank(group, j), group))
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    out[me] = piece
    return out.view(-1)


def variants(comm, x: torch.Tensor) -> dict:
    """The collectives timed, each a function of no argument on the ``data`` axis's group."""
    import torch.distributed as dist

    half, grp = torch.empty(x.numel() // 2), comm.group(("data",))
    whole = torch.empty_like(x)
    return {
        "all_reduce (ring)": lambda: comm.all_reduce(x, "data"),
        "reduce_scatter (gloo's own)": lambda: dist.reduce_scatter_tensor(half, x, group=grp),
        "reduce_scatter (all-to-all + sum)": lambda: a2a_reduce_scatter(x, grp),
        "reduce_scatter (send/recv + sum)": lambda: p2p_reduce_scatter(x, grp),
        "reduce_scatter (axo4d: 1 MiB chunks)": lambda: comm.reduce_scatter(x, "data"),
        "all_gather (gloo's own)": lambda: dist.all_gather_into_tensor(whole, half, group=grp),
        "all_gather (send/recv)": lambda: p2p_all_gather(half, grp),
        "all_gather (axo4d: 1 MiB chunks)": lambda: comm.all_gather(half, "data"),
    }


def worker(a: argparse.Namespace) -> int:
    import torch.distributed as dist

    from axo4d.dist.comm import Comm
    from axo4d.facts.grid import Grid

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    comm = Comm(Grid.parse(f"data={world}"), rank)
    x = torch.arange(int(a.mb * 1e6) // 4, dtype=torch.float32).remainder_(97).add_(rank)
    grp = comm.group(("data",))
    want = torch.empty(x.numel() // world)
    dist.reduce_scatter_tensor(want, x, group=grp)
    forms = (("all-to-all", a2a_reduce_scatter), ("send/recv", p2p_reduce_scatter), ("axo4d", None))
    for name, fn in forms:
        mine = fn(x, grp) if fn is not None else comm.reduce_scatter(x, "data")
        if not torch.equal(mine, want):  # the sums of integers: exact in any order
            print(f"rank {rank}: the {name} reduce-scatter differs from gloo's", file=sys.stderr)
            return 1
    gathered = torch.empty(x.numel())
    dist.all_gather_into_tensor(gathered, want, group=grp)
    for name, mine in (("send/recv", p2p_all_gather(want, grp)), ("axo4d", comm.all_gather(want, "data"))):
        if not torch.equal(mine, gathered):
            print(f"rank {rank}: the {name} all-gather differs from gloo's", file=sys.stderr)
            return 1
    runs = variants(comm, x)
    times: dict[str, list[float]] = {k: [] for k in runs}
    with LoadSampler() as load:
        for f in runs.values():  # warm-up: the connections and buffers
            f()
        for _ in range(a.rounds):
            for k, f in runs.items():
                dist.barrier()
                t0 = time.perf_counter()
                f()
                times[k].append(time.perf_counter() - t0)
    if rank == 0:
        base = statistics.median(times["all_reduce (ring)"])
        loads = f"load average {load.samples[0]:.2f} -> {load.samples[-1]:.2f}"
        print(f"{world} ranks, {a.mb:g} MB fp32, {a.rounds} rounds; {loads}")
        for k, ts in times.items():
            med = statistics.median(ts)
            print(f"  {k:42s} median {med * 1e3:8.1f} ms  least {min(ts) * 1e3:8.1f} ms  /all_reduce {med / base:5.2f}")
    comm.close()
    dist.destroy_process_group()
    return 0


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vcluster", action="store_true", help="2 virtual nodes joined by a shaped link (root)")
    ap.add_argument("--rate", default="1gbit", help="with --vcluster: the link rate (tc units)")
    ap.add_argument("--mb", type=float, default=100.0, help="buffer size in MB (fp32)")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--smoke", action="store_true", help="2 local ranks, 1 MB, 2 rounds")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.smoke:
        a.mb, a.rounds, a.vcluster = 1.0, 2, False
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    if a.worker:
        return worker(a)
    args = ["bench.gloo_reduce_scatter", "--worker", "--mb", str(a.mb), "--rounds", str(a.rounds)]
    if a.vcluster:
        import subprocess

        cmd = [sys.executable, "-m", "launch.vcluster", "--nodes", "2", "--ranks-per-node", "1", "--rate", a.rate]
        return subprocess.call([*cmd, "--timeout", "900", "--", *args])
    from launch.local import run_env

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    return run_env(2, [sys.executable, "-u", "-m", *args], timeout=300)


if __name__ == "__main__":
    sys.exit(main())
