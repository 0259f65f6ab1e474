"""Two-rank gloo groups' reduce-scatter and all-gather (:mod:`axo4d.dist.pairwise`), run by
``test_pairwise.py`` on 4 ranks, grid ``data=2,x=2``: both axes' groups have two ranks (x: global
ranks 0,1 and 2,3; data: 0,2 and 1,3), neither is the world group.

Each result is compared bit for bit with gloo's own collective on the same group
(``reduce_scatter_tensor``, ``all_gather_into_tensor``), for sizes of one element to several
chunks with a remainder, in fp32, bf16, fp64 and int64, several in flight at once and waited for in
reverse order; the bytes counted are the logical sizes. Last, a peer that never joins: the other
rank's reduce-scatter ends within the Comm's timeout in a CommError naming the operation, the
axis and the rank (its pair is closed then, so it runs last, on the x group only).
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from axo4d.config.errors import CommError
from axo4d.dist.comm import Comm
from axo4d.dist.pairwise import CHUNK_BYTES
from axo4d.facts.grid import Grid

DTYPES = (torch.float32, torch.bfloat16, torch.float64, torch.int64)
TIMEOUT_S = 2.0


def _data(n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.int64:
        return torch.randint(-(2**40), 2**40, (n,), generator=g)
    return (torch.randn(n, generator=g, dtype=torch.float64) * 10 ** torch.randint(-3, 4, (n,), generator=g)).to(dtype)


def _sizes(dtype: torch.dtype) -> list[int]:
    per_chunk = CHUNK_BYTES // torch.empty((), dtype=dtype).element_size()
    return [2, 6, 2 * per_chunk, 2 * (2 * per_chunk + 3)]  # one element each, ..., chunks and a remainder


def check_equal_to_gloo(comm: Comm, rank: int) -> list[str]:
    bad = []
    for axis in ("x", "data"):
        g = comm.group(axis)
        for dtype in DTYPES:
            for n in _sizes(dtype):
                x = _data(n, dtype, seed=1000 * rank + n)
                want_rs, want_ag = torch.empty(n // 2, dtype=dtype), torch.empty(2 * n, dtype=dtype)
                dist.reduce_scatter_tensor(want_rs, x, group=g)
                dist.all_gather_into_tensor(want_ag, x, group=g)
                if not torch.equal(comm.reduce_scatter(x, axis), want_rs):
                    bad.append(f"reduce_scatter {axis} {dtype} n={n}")
                if not torch.equal(comm.all_gather(x, axis), want_ag):
                    bad.append(f"all_gather {axis} {dtype} n={n}")
    return bad


def check_in_flight(comm: Comm, rank: int) -> list[str]:
    """Six collectives over both axes in flight, waited for last first."""
    xs = [_data(2 * (CHUNK_BYTES // 4) + 10 * i, torch.float32, seed=7 * rank + i) for i in range(6)]
    want = []
    for i, x in enumerate(xs):
        axis = ("x", "data")[i % 2]
        want.append(comm.reduce_scatter(x, axis) if i % 3 else comm.all_gather(x, axis))
    comm.reset_counters()
    handles = []
    for i, x in enumerate(xs):
        axis = ("x", "data")[i % 2]
        op = comm.reduce_scatter if i % 3 else comm.all_gather
        handles.append(op(x, axis, async_op=True))
    got = [h.wait() for h in reversed(handles)][::-1]
    bad = [f"in flight #{i}" for i, (a, b) in enumerate(zip(got, want)) if not torch.equal(a, b)]
    counted = sum(comm.bytes.values())
    logical = sum(x.numel() * 4 * (2 if i % 3 == 0 else 1) for i, x in enumerate(xs))
    if counted != logical:
        bad.append(f"bytes counted {counted}, logical {logical}")
    return bad


def check_timeout(comm: Comm, rank: int) -> dict:
    """Rank 1 never joins rank 0's reduce-scatter over x (ranks 2 and 3 sit out)."""
    if rank == 0:
        t0 = time.monotonic()
        with comm.timeout(TIMEOUT_S):
            try:
                comm.reduce_scatter(torch.ones(8), "x")
                return {"raised": False}
            except CommError as e:
                return {"raised": True, "seconds": time.monotonic() - t0, "message": str(e)}
    if rank == 1:
        time.sleep(TIMEOUT_S + 4)  # alive, silent: rank 0 must time out, not see a closed peer
    return {}


def check_profile(comm: Comm) -> dict:
    """``perfmodel profile`` times the exchange on a two-rank gloo group (what Comm runs there)."""
    from perfmodel.collectives import ALL_GATHER, REDUCE_SCATTER
    from perfmodel.link_timing import _pairwise_ops, _time_collective

    cpu, g = torch.device("cpu"), comm.group("x")
    forms = sorted(_pairwise_ops(g, 2, cpu, torch.ones(8), torch.ones(4)))
    kinds = (ALL_GATHER, REDUCE_SCATTER)
    secs = [_time_collective(k, g, 2, 1 << 16, cpu, iters=2, warmup=1, window=False) for k in kinds]
    return {"forms": forms, "seconds_positive": all(s > 0 for s in secs)}


def run(info) -> dict:
    comm = Comm(Grid.parse("data=2,x=2"), info.rank, timeout_s=120)
    paired = [comm._pair((a,), comm.group(a), torch.ones(2)) is not None for a in ("x", "data")]
    out = {"paired": paired, "bad": check_equal_to_gloo(comm, info.rank) + check_in_flight(comm, info.rank)}
    out["profile"] = check_profile(comm)
    comm.barrier()
    out["timeout"] = check_timeout(comm, info.rank)
    return out
