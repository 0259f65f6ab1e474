"""Rank-side checks of the FP8 3D linear layer against torchao's ``Float8Linear`` on one process
(run by test_fp8.py; grids: each axis alone, together, with data). The reference runs torchao's
layer on each (data, z) batch shard and sums the weight gradients -- what a data-parallel torchao
run computes: every rank scales its own samples, but whole features and the whole weight.

On 2 ranks also FP8 training on data=2 with the unsharded, the sharded and the offloaded
optimizer (:func:`fp8_training`): the weight scales are recomputed after every update, the runs
agree bit for bit, and a resume continues bit for bit.

Per grid and recipe ('tensorwise', 'rowwise'): Y, dX, dW and d(bias) of a non-transposed layer
and a transposed one (fp32; non-transposed in bf16 too) and a non-transposed -> transposed chain; the layer called twice
with the overlapped schedule and weight caching over two steps (prefetched FP8 gathers, cached FP8
blocks); every cast (the z-gathered weight blocks of forward and backward, X, dY, the per-column
casts of dW) bit for bit against the unsharded tensor's cast, sliced; and a negative control: the
same layer with scales left unagreed (each rank its own amax) must miss the tolerance.
"""

from __future__ import annotations

import contextlib
import warnings

import torch
from torch import nn

import axo4d.nn.fp8 as F8
import axo4d.nn.fp8_plan as F8P
from axo4d.dist.comm import Comm
from axo4d.facts.grid import Grid
from axo4d.nn.context import LayerContext
from axo4d.nn.fp8_linear import weight_cast
from axo4d.nn.overlap_schedule import make_schedule
from tests.dist.cases_linear import rel_err
from tests.helpers import (
    from_linear,
    gather_blocks,
    gather_linear_weight,
    gather_output,
    reduce_gradients,
    shard_features,
    shard_input,
    shard_rows,
)

GRIDS = {  # each axis alone, pairs, all three, with data
    2: ["x=2", "y=2", "z=2", "data=2"],
    4: ["x=2,y=2", "y=2,z=2", "data=2,x=2", "z=4"],
    8: ["x=2,y=2,z=2", "data=2,x=2,z=2", "data=2,y=2,z=2", "x=2,y=4"],
}
# (M, K, N): every local GEMM dimension a multiple of 16 on each grid above (x=2,y=4: K/4, N/4)
M, K, N = 128, 64, 128
RECIPES = ("tensorwise", "rowwise")


def torchao_linears(refs: list[nn.Linear], recipe: str) -> nn.Sequential:
    """``refs`` (copied) converted to torchao's ``Float8Linear`` of ``recipe``."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    seq = nn.Sequential(*[nn.Linear(r.in_features, r.out_features, bias=r.bias is not None) for r in refs])
    for a, r in zip(seq, refs):
        a.load_state_dict(r.state_dict())
    return convert_to_float8_training(seq, config=Float8LinearConfig.from_recipe_name(recipe))


BATCH = ("z", "data")


def shardwise(ao: nn.Module, x: torch.Tensor, r: torch.Tensor, shards: int) -> torch.Tensor:
    """torchao's layers on each of ``shards`` batch shards of ``x`` (backward of ``sum(y * r)``
    accumulating their gradients): the full output."""
    ys = []
    for xs, rs in zip(x.chunk(shards), r.chunk(shards)):
        y = ao(xs)
        (y.float() * rs).sum().backward()
        ys.append(y.detach())
    return torch.cat(ys)


def check_chain(comm: Comm, recipe: str, m: int, dims: list[int], transposed: list[bool], dtype, seed: int) -> dict:
    """A chain of FP8 layers against torchao's on the full batch: max rel errors."""
    torch.manual_seed(seed)
    refs = [nn.Linear(a, b) for a, b in zip(dims, dims[1:])]
    for r in refs:
        nn.init.normal_(r.bias)
    ao = torchao_linears(refs, recipe)
    x, rr = torch.randn(m, dims[0]).to(dtype), torch.randn(m, dims[-1])
    xa = x.clone().requires_grad_(True)
    ya = shardwise(ao, xa, rr, comm.size(BATCH))  # the input in the compute dtype: torchao's CUDA path
    ctx = LayerContext(comm, make_schedule(comm, False), None, F8P.plan(recipe))
    pars = [from_linear(r, ctx, transposed=t) for r, t in zip(refs, transposed)]
    xb = shard_input(pars[0], x).requires_grad_(True)
    ac = torch.autocast("cpu", dtype=torch.bfloat16) if dtype == torch.bfloat16 else contextlib.nullcontext()
    with ac:
        y = xb
        for p in pars:
            y = p(y)
    last = pars[-1]
    r_blk = shard_features(shard_rows(rr, comm), comm, (last.in_axis, last.out_axis))
    (y.float() * r_blk).sum().backward()
    params = [q for p in pars for q in p.parameters()]
    reduce_gradients(params, comm)
    blocks = (pars[0].out_axis, pars[0].in_axis)  # the input's feature blocks
    errs = {
        "y": rel_err(gather_output(last, y.detach().float()), ya.float()),
        "dx": rel_err(gather_blocks(xb.grad.float(), comm, BATCH, blocks), xa.grad.float()),
    }
    for i, (p, a) in enumerate(zip(pars, ao)):
        dw = gather_linear_weight(p.weight.grad, comm, p.in_axis, p.out_axis, (p.out_features, p.in_features))
        errs[f"dw{i}"] = rel_err(dw, a.weight.grad)
        errs[f"db{i}"] = rel_err(gather_blocks(p.bias.grad[None], comm, (), p.out_axis)[0], a.bias.grad)
    return errs


def check_reuse(comm: Comm, recipe: str, seed: int = 5) -> dict:
    """One FP8 layer called twice a forward, overlapped schedule with weight caching, two steps (the
    second prefetches from the first's recording), against torchao's layer doing the same."""
    torch.manual_seed(seed)
    ref = nn.Linear(64, 128)
    nn.init.normal_(ref.bias)
    ao = torchao_linears([ref], recipe)[0]
    x1, x2, r1, r2 = torch.randn(64, 64), torch.randn(64, 64), torch.randn(64, 128), torch.randn(64, 128)
    a, b = x1.clone().requires_grad_(True), x2.clone().requires_grad_(True)
    n = comm.size(BATCH)
    want = shardwise(ao, a, r1, n), shardwise(ao, b, r2, n)
    sched = make_schedule(comm, True, bucket_mb=1e-4, cache_layers=1)
    lin = from_linear(ref, LayerContext(comm, sched, None, F8P.plan(recipe)))
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
        dw = gather_linear_weight(lin.weight.grad, comm, lin.in_axis, lin.out_axis, (128, 64))
        errs[f"y@{step}"] = rel_err(gather_output(lin, y2.detach()), want[1])
        errs[f"dw@{step}"] = rel_err(dw, ao.weight.grad)
        errs[f"dx1@{step}"] = rel_err(gather_blocks(xb1.grad, comm, BATCH, (lin.out_axis, lin.in_axis)), a.grad)
    if comm.size("z") > 1:
        errs["prefetch hits (>0) at step 1"] = 0.0 if sched.stats["hits"] > 0 else 1.0
    if comm.size("z") > 1 and recipe == "tensorwise":  # rowwise: the backward block is cast per column
        errs["cache hits (>0)"] = 0.0 if sched.cache.stats["cache_hits"] > 0 else 1.0
    return errs


def _same(got: F8.Fp8Tensor, want: F8.Fp8Tensor) -> float:
    """0.0 when the FP8 bytes and the scales are identical, else the largest difference."""
    d = (got.data.float() - want.data.float()).abs().max()
    s = (got.scale.float() - want.scale.float()).abs().max()
    return float(max(d, s))


def _slice(t: F8.Fp8Tensor, rows: slice, cols: slice) -> F8.Fp8Tensor:
    sc = t.scale
    if sc.dim() == 2:
        sc = sc[rows] if sc.shape[1] == 1 else sc[:, cols]
    return F8.Fp8Tensor(t.data[rows, cols], sc)


def check_casts(comm: Comm, recipe: str, seed: int = 9) -> dict:
    """Every cast on the grid equals the cast of the unsharded tensor, sliced, bit for bit: the
    gathered FP8 weight block of forward and backward (z pieces cast before the gather), X, dY and
    the per-column casts of the dW GEMM."""
    torch.manual_seed(seed)
    r = F8.RECIPES[recipe]
    out = {}
    for transposed in (False, True):
        m, k, n = 128, 64, 128
        w, x, dy = torch.randn(n, k), torch.randn(m, k), torch.randn(m, n) * 1e-3
        ref = nn.Linear(k, n, bias=False)
        with torch.no_grad():
            ref.weight.copy_(w)
        ctx = LayerContext(comm, make_schedule(comm, False), None, F8P.plan(recipe))
        lin = from_linear(ref, ctx, transposed=transposed)
        n_out, k_in = lin.block_shape
        ro = slice(comm.coord(lin.out_axis) * n_out, (comm.coord(lin.out_axis) + 1) * n_out)
        ci = slice(comm.coord(lin.in_axis) * k_in, (comm.coord(lin.in_axis) + 1) * k_in)
        tag = "T" if transposed else "N"
        for bwd, c in ((False, r.w), (True, r.w_dx)):
            got = lin.schedule.weight(lin, weight_cast(lin, bwd), backward=bwd)
            out[f"{tag} weight block {'bwd' if bwd else 'fwd'}"] = _same(got, _slice(F8.cast(w, c), ro, ci))
        mloc = m // comm.size(BATCH)
        rr = slice(comm.index(BATCH) * mloc, (comm.index(BATCH) + 1) * mloc)
        xb, dyb = x[rr, ci], dy[rr, ro]
        for name, full, blk, c, cols, axis in (
            ("X", x, xb, r.x, ci, lin.in_axis),
            ("X for dW", x, xb, r.x_dw, ci, lin.in_axis),
            ("dY", dy, dyb, r.dy, ro, lin.out_axis),
            ("dY for dW", dy, dyb, r.dy_dw, ro, lin.out_axis),
        ):  # this rank's samples, cast as their shard is alone (features whole)
            got = F8.cast(blk, c, comm, (), (axis,))
            out[f"{tag} {name}"] = _same(got, _slice(F8.cast(full[rr], c), slice(None), cols))
    return out


@contextlib.contextmanager
def unagreed_scales():
    """Negative control: every amax stays this rank's own (no all-reduce)."""
    old = F8.agree
    F8.agree = lambda amax, comm, groups: amax
    try:
        yield
    finally:
        F8.agree = old


def check_grid(comm: Comm) -> dict:
    out = {}
    for recipe in RECIPES:
        for t in (False, True):
            e = check_chain(comm, recipe, M, [K, N], [t], torch.float32, 10)
            out[f"{recipe} {'T' if t else 'N'}{M}x{K}x{N} fp32"] = max(e.values())
        e = check_chain(comm, recipe, M, [K, N], [False], torch.bfloat16, 11)
        out[f"{recipe} N{M}x{K}x{N} bf16"] = max(e.values())
        e = check_chain(comm, recipe, M, [K, N, K], [False, True], torch.float32, 20)
        out[f"{recipe} N->T chain fp32"] = max(e.values())
        e = check_reuse(comm, recipe)
        worst = max(e, key=e.get)
        out[f"{recipe} layer called twice, overlapped, cached (worst: {worst})"] = e[worst]
        for name, v in check_casts(comm, recipe).items():
            out[f"{recipe} cast {name} (bit-exact)"] = v
    return out


def control(comm: Comm) -> dict:
    """Errors with unagreed scales (must exceed the tolerance where some tensor is split)."""
    with unagreed_scales():
        e = check_chain(comm, "tensorwise", M, [K, N, K], [False, True], torch.float32, 20)
    return {"tensorwise unagreed": max(e.values())}


def run(info, tmp: str) -> dict:
    """Entry point on each rank: every grid of this world size, then the control on the last; on 2
    ranks also FP8 training with each optimizer (:func:`fp8_training`, checkpoints under ``tmp``)."""
    results = {}
    if info.world_size == 2:
        results["training data=2"] = fp8_training(info, "data=2", tmp)
    for spec in GRIDS[info.world_size]:
        comm = Comm(Grid.parse(spec), info.rank, timeout_s=60)
        results[spec] = check_grid(comm)
    spec = {2: "x=2", 4: "data=2,x=2", 8: "x=2,y=2,z=2"}[info.world_size]
    results["control " + spec] = control(Comm(Grid.parse(spec), info.rank, timeout_s=60))
    return results


# ---- training: the weights' scales follow every optimizer's updates (issue 33 item 1) ------------
#: name -> overrides of the FP8 training runs compared with the unsharded optimizer
TRAIN_MODES = {
    "unsharded": ["parallel.shard_optimizer=false"],
    "sharded": ["parallel.shard_optimizer=true"],
    "sharded+offload": ["parallel.shard_optimizer=true", "train.offload=optimizer"],
}
TRAIN_BASE = ["train.fp8=tensorwise", "train.fp8_layers=all", "parallel.tuner=false", "train.eval_interval=0"]
TRAIN_STEPS, RESUME_AT = 4, 2


def _fp8_trainer(spec: str, mode: str, rank: int, ds):
    from axo4d.config import load_config
    from axo4d.training.trainer import Trainer

    cfg = load_config("tiny", TRAIN_BASE + [f"train.steps={TRAIN_STEPS}"] + TRAIN_MODES[mode], spec)
    return Trainer(cfg, Comm(Grid.parse(spec), rank, timeout_s=60), ds, torch.device("cpu"))


def fp8_training(info, spec: str, tmp: str) -> dict:
    """FP8 training on ``spec`` with each optimizer of :data:`TRAIN_MODES`: the scales counted per
    step (every step the same: the weights' scales recomputed after each update), losses and final
    weights; and the sharded run resumed from its checkpoint of step :data:`RESUME_AT` (its losses,
    and the counter of weight updates after the load)."""
    from pathlib import Path

    from axo4d.config import load_config
    from axo4d.nn.fp8_plan import plan_of
    from axo4d.training.checkpointing.checkpointer import Checkpointer
    from tests.dist.cases_optimizer import _dataset
    from tests.helpers import full_state_dict

    ds = _dataset(info, load_config("tiny", TRAIN_BASE))
    out, states, saved = {}, {}, None
    for mode in TRAIN_MODES:
        tr = _fp8_trainer(spec, mode, info.rank, ds)
        ck = Checkpointer(Path(tmp) / mode, tr.cfg, tr.comm, tr.model, tr.opt)
        steps = []
        for i in range(TRAIN_STEPS):
            if i == RESUME_AT:
                path = ck.save(i)
                saved = path if mode == "sharded" else saved
            steps.append(tr.step(i))
        tr.settle()
        states[mode] = full_state_dict(tr.model, tr.comm)
        ref = states["unsharded"]
        out[mode] = {
            "scales": [s.fp8["fp8_scales"] for s in steps],
            "losses": [s.loss for s in steps],
            "weights_equal_unsharded": all(torch.equal(states[mode][k], v) for k, v in ref.items()),
            "updates": plan_of(tr.model).weight_scales.updates,
        }
    tr = _fp8_trainer(spec, "sharded", info.rank, ds)
    ck = Checkpointer(Path(tmp) / "resumed", tr.cfg, tr.comm, tr.model, tr.opt)
    start = ck.load(saved, spec)
    restored = plan_of(tr.model).weight_scales.updates
    losses = [tr.step(i).loss for i in range(start, TRAIN_STEPS)]
    out["resumed"] = {"start": start, "updates": restored, "losses": losses}
    return out
