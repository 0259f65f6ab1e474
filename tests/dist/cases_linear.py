"""Rank-side checks of the 3D linear layer against ``nn.Linear`` (run by test_linear.py).

Each grid of the world is checked in one spawned group: forward Y, dX, dW and
d(bias) on the unsharded input, fp32, non-transposed, transposed and chained.
Also runnable directly: ``python -m launch.local -n 8 -- tests.dist.cases_linear``.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from axo4d.dist.comm import Comm
from axo4d.facts import parts
from axo4d.facts.grid import Grid
from axo4d.nn.context import LayerContext
from axo4d.nn.grads import global_grad_norm
from axo4d.nn.overlap_schedule import make_schedule
from tests.helpers import (
    from_linear,
    full_weight,
    gather_blocks,
    gather_linear_weight,
    gather_output,
    reduce_gradients,
    shard_features,
    shard_input,
    shard_rows,
)

GRIDS = {
    2: ["x=2", "y=2", "z=2", "data=2"],
    4: ["x=2,y=2", "y=2,z=2", "x=2,z=2", "data=2,z=2", "data=2,x=2", "z=4", "x=4"],
    8: [
        "x=2,y=2,z=2",
        "data=2,x=2,y=2",
        "data=2,x=2,z=2",
        "data=2,y=2,z=2",
        "data=2,z=4",
        "data=4,z=2",
        "x=2,y=4",
        "data=8",
    ],
}
# (M, K, N) non-square shapes; rows M divisible by data*z of every grid above
SHAPES = [(16, 24, 40), (8, 16, 8)]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def _ref(x: torch.Tensor, layers: list[nn.Linear], r: torch.Tensor):
    x = x.clone().requires_grad_(True)
    y = x
    for lin in layers:
        y = lin(y)
    (y * r).sum().backward()
    return y.detach(), x.grad


def check_chain(comm: Comm, m: int, dims: list[int], transposed: list[bool], bias: bool, seed: int, sched=None) -> dict:
    """Chain of layers (dims[i] -> dims[i+1]) against nn.Linear; returns max rel errors. ``sched``: a
    schedule the layers share (the eager one of a bare ``Comm`` otherwise)."""
    torch.manual_seed(seed)
    refs = [nn.Linear(a, b, bias=bias) for a, b in zip(dims, dims[1:])]
    for ref in refs:  # non-zero bias so a doubled bias shows
        if bias:
            nn.init.normal_(ref.bias)
    x = torch.randn(m, dims[0])
    r = torch.randn(m, dims[-1])
    y_ref, dx_ref = _ref(x, refs, r)
    ctx = comm if sched is None else LayerContext(comm, sched)
    pars = [from_linear(ref, ctx, transposed=t) for ref, t in zip(refs, transposed)]
    if sched is not None:
        sched.attach([q for p in pars for q in p.parameters()])
    x_blk = shard_input(pars[0], x).requires_grad_(True)
    y = x_blk
    with sched.forward_pass(True) if sched is not None else contextlib.nullcontext():
        for p in pars:
            y = p(y)
    last = pars[-1]
    r_blk = shard_features(shard_rows(r, comm), comm, (last.in_axis, last.out_axis))
    (y * r_blk).sum().backward()
    if sched is not None:
        sched.finish()
    params = [q for p in pars for q in p.parameters()]
    if sched is None:  # a schedule sums the gradients over the batch axes itself
        reduce_gradients(params, comm)
    errs = {
        "y": rel_err(gather_output(last, y), y_ref),
        "dx": rel_err(gather_blocks(x_blk.grad, comm, ("z", "data"), (pars[0].out_axis, pars[0].in_axis)), dx_ref),
    }
    for i, (p, ref) in enumerate(zip(pars, refs)):
        dw = gather_linear_weight(p.weight.grad, comm, p.in_axis, p.out_axis, (p.out_features, p.in_features))
        errs[f"dw{i}"] = rel_err(dw, ref.weight.grad)
        errs[f"w{i}"] = rel_err(full_weight(p), ref.weight.detach())
        if bias:
            db = gather_blocks(p.bias.grad[None], comm, (), p.out_axis)[0]
            errs[f"db{i}"] = rel_err(db, ref.bias.grad)
    ref_norm = torch.cat([q.grad.reshape(-1) for ref in refs for q in ref.parameters()]).norm()
    errs["grad_norm"] = abs(global_grad_norm(params, comm) - float(ref_norm)) / float(ref_norm)
    return errs


def check_reuse(comm: Comm, overlap: bool, seed: int = 7) -> dict:
    """One layer called twice in a forward (``L(x1)`` and ``L(x2)``, as tied weights are) with the
    eager or the overlapped schedule, over two steps (the second prefetches from the first's
    recording), against ``nn.Linear`` doing the same: outputs, both dX, dW, d(bias)."""
    torch.manual_seed(seed)
    ref = nn.Linear(16, 24)
    nn.init.normal_(ref.bias)
    x1, x2, r1, r2 = torch.randn(16, 16), torch.randn(16, 16), torch.randn(16, 24), torch.randn(16, 24)
    a, b = x1.clone().requires_grad_(True), x2.clone().requires_grad_(True)
    ((ref(a) * r1).sum() + (ref(b) * r2).sum()).backward()
    sched = make_schedule(comm, overlap, bucket_mb=1e-4)  # tiny buckets: several, issued early
    lin = from_linear(ref, LayerContext(comm, sched))
    sched.attach(lin.parameters())
    out_rows = lambda t: shard_features(shard_rows(t, comm), comm, (lin.in_axis, lin.out_axis))
    errs = {}
    for step in range(2):
        lin.zero_grad(set_to_none=True)
        xb1, xb2 = (shard_input(lin, t).requires_grad_(True) for t in (x1, x2))
        with sched.forward_pass(True):
            y1, y2 = lin(xb1), lin(xb2)
        ((y1 * out_rows(r1)).sum() + (y2 * out_rows(r2)).sum()).backward()
        sched.finish()
        dw = gather_linear_weight(lin.weight.grad, comm, lin.in_axis, lin.out_axis, (24, 16))
        db = gather_blocks(lin.bias.grad[None], comm, (), lin.out_axis)[0]
        for k, (got, want) in {
            "y": (gather_output(lin, y1), ref(x1).detach()),
            "dw": (dw, ref.weight.grad),
            "db": (db, ref.bias.grad),
            "dx1": (gather_blocks(xb1.grad, comm, ("z", "data"), (lin.out_axis, lin.in_axis)), a.grad),
            "dx2": (gather_blocks(xb2.grad, comm, ("z", "data"), (lin.out_axis, lin.in_axis)), b.grad),
        }.items():
            errs[f"{k}@{step}"] = rel_err(got, want)
    if overlap and comm.size("z") > 1:
        errs["prefetch hits (>0) at step 1"] = 0.0 if sched.stats["hits"] > 0 else 1.0
    return errs


def check_chunked(comm: Comm, overlap: bool) -> dict:
    """A non-transposed -> transposed chain with its forwards in row chunks (the chunk floor lowered
    to 8 elements: every layer whose input or output axis has ranks chunks, 4 chunks of the rows),
    each chunk's input all-gathered and output reduce-scattered on their own, in flight behind the
    GEMMs with the overlapped schedule: the same against ``nn.Linear`` as unchunked, and the
    schedule saw the chunks (errors are 1.0 where a chunk was expected and none ran)."""
    floor, parts.MIN_CHUNK_ELEMENTS = parts.MIN_CHUNK_ELEMENTS, 8
    try:
        sched = make_schedule(comm, overlap, bucket_mb=1e-4)
        errs = check_chain(comm, 32, [24, 40, 16], [False, True], True, seed=31, sched=sched)
    finally:
        parts.MIN_CHUNK_ELEMENTS = floor
    if overlap and comm.size(("x", "y")) > 1:
        errs["gather chunks seen"] = 0.0 if sched.stats["gather_chunks"] > 0 else 1.0
        errs["scatter chunks seen"] = 0.0 if sched.stats["chunks"] > 0 else 1.0
    return errs


def check_grid(comm: Comm) -> dict:
    """All cases on one grid: max error per case."""
    out = {}
    for si, (m, k, n) in enumerate(SHAPES):
        for bias in (True, False):
            for t in (False, True):
                e = check_chain(comm, m, [k, n], [t], bias, seed=10 + si)
                out[f"{'T' if t else 'N'}{m}x{k}x{n}{'+b' if bias else ''}"] = max(e.values())
        e = check_chain(comm, m, [k, n, k + 8], [False, True], True, seed=20 + si)
        out[f"N->T chain {m}x{k}x{n}x{k + 8}"] = max(e.values())
    for overlap in (False, True):
        e = check_chunked(comm, overlap)
        worst = max(e, key=e.get)
        out[f"forward in row chunks, {'overlapped' if overlap else 'eager'} schedule (worst: {worst})"] = e[worst]
    for overlap in (False, True):
        e = check_reuse(comm, overlap)
        worst = max(e, key=e.get)
        out[f"layer called twice, {'overlapped' if overlap else 'eager'} schedule (worst: {worst})"] = e[worst]
    return out


def run(info) -> dict:
    """Entry point on each rank: every grid of this world size."""
    results = {}
    for spec in GRIDS[info.world_size]:
        comm = Comm(Grid.parse(spec), info.rank, timeout_s=60)
        results[spec] = check_grid(comm)
    return results


def bias_counted_wrong(info) -> dict:
    """Negative control: summing the bias gradient also over x (G_x times) must be caught."""
    comm = Comm(Grid.parse("x=2,z=2"), info.rank, timeout_s=60)
    torch.manual_seed(3)
    ref = nn.Linear(8, 8)
    x, r = torch.randn(8, 8), torch.randn(8, 8)
    _ref(x, [ref], r)
    lin = from_linear(ref, comm)
    x_blk = shard_input(lin, x)
    r_blk = shard_rows(r, comm).chunk(comm.size(("x", "y")), -1)[comm.index(("x", "y"))]
    (lin(x_blk) * r_blk).sum().backward()
    reduce_gradients(list(lin.parameters()), comm)
    good = rel_err(lin.bias.grad, ref.bias.grad)
    comm.all_reduce(lin.bias.grad, "x")  # the mistake: counting the replicated gradient G_x times
    return {"good": good, "wrong": rel_err(lin.bias.grad, ref.bias.grad)}


if __name__ == "__main__":
    from axo4d.dist.bootstrap import init_distributed

    info = init_distributed(backend="gloo", timeout_s=60)
    res = run(info)
    if info.rank == 0:
        for spec, cases in res.items():
            print(f"{spec:18s} max rel err {max(cases.values()):.2e}  ({len(cases)} cases)")
    from axo4d.dist.bootstrap import shutdown

    shutdown()
