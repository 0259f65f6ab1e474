"""Rank-side checkpoint cases (run by test_checkpoint.py through tests.dist.harness).

``reshard``: on 8 ranks, train grid A, save at step k, keep going to N (the reference);
then resume on A (must be bit-exact), load on grid B (loss within 1e-5, tensors exact),
save from B and load back on A (round trip A -> B -> A: identical tensors).
``single``: load the grid-A checkpoint on one process and continue.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from axo4d.config import load_config
from axo4d.dist.comm import Comm
from axo4d.facts.grid import Grid
from axo4d.training.checkpointing.checkpointer import Checkpointer, logical_shapes, read_info
from axo4d.training.datasets.dataset import open_dataset, prepare_tokens
from axo4d.training.trainer import Trainer
from tests.helpers import full_optimizer_state, gather_full_tensor


def _cfg(spec: str, steps: int):
    # tuner off: its GEMM layout choices (timed per machine) change rounding; exactness needs fixed ones
    base = load_config("tiny", [f"train.steps={steps}", "train.eval_interval=0", "parallel.tuner=false"])
    return dataclasses.replace(base, parallel=dataclasses.replace(base.parallel, grid=spec))


def _trainer(spec: str, steps: int, rank: int, ds, world: bool = True) -> Trainer:
    grid = Grid.parse(spec)
    comm = Comm(grid, rank, timeout_s=60) if world else Comm(grid, 0, init_groups=False)
    return Trainer(_cfg(spec, steps), comm, ds, torch.device("cpu"))


def full_state(tr: Trainer) -> dict[str, torch.Tensor]:
    """Full logical model and optimizer tensors (collective), keyed like the checkpoint."""
    tr.settle()
    shapes = logical_shapes(tr.model)
    out = {}
    for name, p in tr.model.named_parameters():
        cut = tuple(slice(0, n) for n in shapes[name])
        out[f"model/{name}"] = gather_full_tensor(p.data, p, tr.comm)[cut].clone()
    out.update(full_optimizer_state(tr.opt, tr.model, tr.comm))  # sharded or not
    return out


def _diff(a: dict, b: dict) -> list[str]:
    """Names of tensors that are not bitwise equal (or missing)."""
    bad = sorted(set(a) ^ set(b))
    return bad + [k for k in sorted(set(a) & set(b)) if not torch.equal(a[k], b[k])]


def _train(tr: Trainer, start: int, stop: int) -> list[float]:
    return [tr.step(i).loss for i in range(start, stop)]


def _dataset(steps: int, rank: int, world: Comm | None):
    cfg = _cfg("data=1", steps)
    if rank == 0:
        prepare_tokens(cfg.data)
    if world is not None:
        world.barrier()
    return open_dataset(cfg.data, cfg.model.seq_len, cfg.train.seed, cfg.model.vocab_size)


def reshard(info, tmp: str, steps: int, k: int, grid_a: str, grid_b: str, grid_c: str = "") -> dict:
    """Save on A at ``k``; resume on A; load on B and save there; load B's on A and (``grid_c``) on C."""
    world = Comm(Grid(data=info.world_size), info.rank)
    ds = _dataset(steps, info.rank, world)
    root = Path(tmp)
    # reference: uninterrupted run on A, saving at k
    tr = _trainer(grid_a, steps, info.rank, ds)
    ck = Checkpointer(root / "A", tr.cfg, tr.comm, tr.model, tr.opt)
    ref = _train(tr, 0, k)
    path_a = ck.save(k)
    state_k = full_state(tr)
    ref += _train(tr, k, steps)
    final_ref = full_state(tr)
    # exact resume on A
    tr = _trainer(grid_a, steps, info.rank, ds)
    start = Checkpointer(root / "A2", tr.cfg, tr.comm, tr.model, tr.opt).load(path_a, grid_a)
    resumed_state = full_state(tr)
    resumed = _train(tr, start, steps)
    resume_diff = _diff(final_ref, full_state(tr))
    # load on B, save from B
    tr = _trainer(grid_b, steps, info.rank, ds)
    ck_b = Checkpointer(root / "B", tr.cfg, tr.comm, tr.model, tr.opt)
    start_b = ck_b.load(path_a, grid_a)
    on_b = full_state(tr)
    path_b = ck_b.save(start_b)
    losses_b = _train(tr, start_b, steps)
    # back on A
    tr = _trainer(grid_a, steps, info.rank, ds)
    Checkpointer(root / "A3", tr.cfg, tr.comm, tr.model, tr.opt).load(path_b, grid_b)
    back = full_state(tr)
    on_c = {}
    if grid_c:  # B's checkpoint on a third grid (another orientation of the layer pairs)
        tr = _trainer(grid_c, steps, info.rank, ds)
        Checkpointer(root / "C", tr.cfg, tr.comm, tr.model, tr.opt).load(path_b, grid_b)
        on_c = full_state(tr)
    return {
        "ref": ref,
        "start": start,
        "resumed": resumed,
        "resume_load_diff": _diff(state_k, resumed_state),
        "resume_final_diff": resume_diff,
        "start_b": start_b,
        "losses_b": losses_b,
        "load_b_diff": _diff(state_k, on_b),
        "round_trip_diff": _diff(state_k, back),
        "load_c_diff": _diff(state_k, on_c) if grid_c else [],
        "ckpt_a": str(path_a),
        "meta_b": {k: v for k, v in read_info(path_b).items() if k != "config"},
        "files_a": sorted(p.name for p in path_a.iterdir()),
    }


def single(info, ckpt: str, steps: int) -> dict:
    """Load a checkpoint on one process (grid 1) and train to ``steps``."""
    ds = _dataset(steps, info.rank, None)
    tr = _trainer("data=1", steps, 0, ds, world=False)
    start = Checkpointer(Path(ckpt).parent, tr.cfg, tr.comm, tr.model, tr.opt).load(Path(ckpt))
    return {"start": start, "losses": _train(tr, start, steps)}
